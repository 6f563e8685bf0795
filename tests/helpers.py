"""Shared test plumbing: quantized weights made by bitsandbytes, and the bit-exact check."""

import copy
import os
import subprocess
import sys
import threading

import torch

from reference import dequantize_reference, fp4_signed


def quantize(shape, *, dtype=torch.float16, nested=True, blocksize=64, quant_type="nf4",
             storage=torch.uint8, device="cpu", seed=0):
    """A random weight quantized by bitsandbytes; returns (packed, quant_state).

    Rows get scales spread over six orders of magnitude, so that absmax and absmax2 vary.
    """
    import bitsandbytes.functional as F

    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(shape, generator=generator)
    if weight.dim() >= 1 and weight.numel() > 0:
        row_scale = 10.0 ** (torch.rand(weight.shape[0], generator=generator) * 6 - 4)
        weight = weight * row_scale.reshape(-1, *([1] * (weight.dim() - 1)))
    # An empty weight is quantized on the CPU and moved: bitsandbytes' CUDA quantizer does not return
    # for it (the process died in its call on an H100).
    where = device if weight.numel() else "cpu"
    packed, state = F.quantize_4bit(weight.to(where), blocksize=blocksize, compress_statistics=nested,
                                    quant_type=quant_type, quant_storage=storage)
    if where != device:
        packed = packed.to(device)
        state.to(device)
    state.dtype = dtype
    return packed, state


def linear4bit(shape, *, dtype=torch.bfloat16, device="cpu", bias=False, seed=30):
    """A bitsandbytes Linear4bit (out, in = shape) holding the weight and state that ``quantize``
    makes, with compute dtype ``dtype``; returns (layer, packed, state)."""
    import bitsandbytes as bnb

    packed, state = quantize(shape, dtype=dtype, device=device, seed=seed)
    layer = bnb.nn.Linear4bit(shape[1], shape[0], bias=bias, compute_dtype=dtype, quant_type="nf4", device=device)
    layer.weight = bnb.nn.Params4bit(packed, requires_grad=False, quant_state=state, bnb_quantized=True, module=layer)
    if bias:
        generator = torch.Generator().manual_seed(seed)
        layer.bias = torch.nn.Parameter(torch.randn(shape[0], generator=generator).to(dtype).to(device))
    return layer, packed, state


def launch_config_of(launch):
    """(bytes per program, warps, shared codebooks) of a ``kernel.Launch``: comparable to a ``LaunchConfig``."""
    return launch.constexprs["BYTES_PER_PROGRAM"], launch.num_warps, launch.constexprs["SHARED_TABLES"]


def in_a_fresh_process(script):
    """Runs ``script`` in a new Python process (nothing cached yet) from the project's root with the project and
    tests/ importable; fails with its exit status and output where it fails."""
    tests = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(tests)
    path = os.pathsep.join(filter(None, [root, tests, os.environ.get("PYTHONPATH")]))
    try:
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, cwd=root,
                                env=dict(os.environ, PYTHONPATH=path))
    except subprocess.TimeoutExpired as error:
        raise AssertionError(f"no exit within {error.timeout} s; stderr so far:\n{error.stderr}") from error
    assert result.returncode == 0, (f"exit status {result.returncode}\n--- stdout\n{result.stdout[-2000:]}\n"
                                    f"--- stderr\n{result.stderr[-4000:]}")


def offset_copy(packed, start):
    """A copy of ``packed`` whose bytes begin ``start`` bytes into a fresh buffer."""
    buffer = torch.zeros(packed.numel() + 8, dtype=torch.uint8, device=packed.device)
    view = buffer[start:start + packed.numel()].view(packed.shape)
    view.copy_(packed)
    return view


def bnb_dequantize(packed, state):
    """bitsandbytes' own dequantization: its CUDA kernel on the GPU, its pure-PyTorch path on the CPU.

    On the CPU, ``dequantize_4bit`` dispatches to a native kernel that, in bitsandbytes 0.50.2,
    disagrees with the CUDA kernel and with bitsandbytes' PyTorch path when a row is not a multiple
    of the blocksize (16 x 96, blocksize 64: 1067 of 1536 elements differ), so the CPU comparison
    goes through the PyTorch path (``backends.default``), which computes the flat format as CUDA does,
    with the CUDA kernel's -0.0 for FP4 code 8.
    """
    import bitsandbytes.functional as F

    if packed.is_cuda:
        return F.dequantize_4bit(packed, state)
    from bitsandbytes.backends.default import ops as default_ops

    absmax = state.absmax
    if state.nested:
        absmax = F.dequantize_blockwise(state.absmax, state.state2) + state.offset
    code = F.get_4bit_type(state.quant_type, device=packed.device)
    if state.quant_type == "fp4":  # the CUDA kernel's signed zero for code 8 (see reference.py)
        code = fp4_signed(code, torch.arange(16))
    out = default_ops._dequantize_4bit_compute(packed.view(torch.uint8).reshape(-1), absmax.float(), code,
                                               state.blocksize, state.shape, state.dtype)
    return out.t() if packed.shape[0] == 1 else out


def expected_values(packed, state):
    """What bitsandbytes' CUDA kernel returns. On the GPU, that kernel. On the CPU, the reference:
    bitsandbytes' CPU paths keep subnormals that its fast-math CUDA kernels flush, and the GPU tests
    hold the reference equal to the CUDA kernel (fuzz, subnormal scales)."""
    return bnb_dequantize(packed, state) if packed.is_cuda else dequantize_reference(packed, state)


def with_subnormal_scales(state):
    """A copy of ``state`` whose scales make both multiplies meet subnormal inputs or results."""
    state = copy.deepcopy(state)
    if state.nested:
        pattern = torch.tensor([1e-39, 1e-36, 2e-38, 1.0])
        state.state2.absmax = pattern.repeat(-(-state.state2.absmax.numel() // 4))[:state.state2.absmax.numel()]
        state.state2.absmax = state.state2.absmax.to(state.absmax.device)
        state.offset = torch.full_like(state.offset, 3e-41)
    else:
        pattern = torch.tensor([1e-40, 1e-37, 3e-38, 1.0, 0.0])
        state.absmax = pattern.repeat(-(-state.absmax.numel() // 5))[:state.absmax.numel()].to(state.absmax.device)
    return state


def bit_exact(actual, expected):
    """Same shape, strides, dtype and bits (NaN payloads included)."""
    if actual.shape != expected.shape or actual.dtype != expected.dtype or actual.stride() != expected.stride():
        return False
    int_type = {2: torch.int16, 4: torch.int32}[actual.element_size()]
    return torch.equal(actual.contiguous().view(int_type), expected.contiguous().view(int_type))


def assert_bit_exact(actual, expected):
    assert bit_exact(actual, expected), (
        f"not bit-exact: shape {tuple(actual.shape)} vs {tuple(expected.shape)}, dtype {actual.dtype} vs "
        f"{expected.dtype}, max abs diff "
        f"{(actual.float() - expected.float()).abs().max().item() if actual.shape == expected.shape else 'n/a'}"
    )


def snapshot(packed, state):
    """Deep copies of everything a call could modify."""
    return packed.clone(), copy.deepcopy(state.as_dict(packed=True))


def assert_unchanged(packed, state, before):
    packed_before, state_before = before
    assert torch.equal(packed.view(torch.uint8), packed_before.view(torch.uint8)), "the packed weight was modified"
    after = state.as_dict(packed=True)
    assert after.keys() == state_before.keys()
    for key, value in state_before.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(after[key], value), f"quant_state {key} was modified"
        else:
            assert after[key] == value, f"quant_state {key} was modified"


def failures_in_threads(work, count):
    """Run ``work(i)`` in ``count`` threads at once; return what went wrong, a line per thread:
    the message it returned, or the exception it raised."""
    failures = []

    def guarded(i):
        try:
            message = work(i)
        except Exception as error:  # noqa: BLE001 (a thread's exception is reported, not lost)
            message = f"{type(error).__name__}: {error}"
        if message:
            failures.append(f"thread {i}: {message}")

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return failures
