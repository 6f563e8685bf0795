"""Bad input raises a clear ValueError/TypeError naming what is wrong, before any launch."""

import copy

import numpy as np
import pytest
import torch

from helpers import assert_bit_exact, expected_values, quantize
from nf4_triton import kernel


@pytest.fixture
def weight(device):
    return quantize((8, 64), dtype=torch.float16, device=device)


def altered(state, **fields):
    state = copy.copy(state)
    for name, value in fields.items():
        setattr(state, name, value)
    return state


class NotAState:
    pass


def test_not_a_quant_state(weight):
    packed, _ = weight
    with pytest.raises(ValueError, match="quant_state has no 'absmax'"):
        kernel.dequantize_nf4(packed, NotAState())


def test_missing_quant_state(weight):
    packed, _ = weight
    with pytest.raises(ValueError, match="no quant_state given"):
        kernel.dequantize_nf4(packed)


def test_not_a_tensor():
    with pytest.raises(TypeError, match="weight must be a tensor"):
        kernel.dequantize_nf4([1, 2, 3], object())


def test_missing_field(weight):
    packed, state = weight
    state = altered(state)
    del state.code
    with pytest.raises(ValueError, match="quant_state has no 'code'"):
        kernel.dequantize_nf4(packed, state)


def test_nested_without_state2(weight):
    packed, state = weight
    with pytest.raises(ValueError, match="no state2"):
        kernel.dequantize_nf4(packed, altered(state, state2=None))


def test_unknown_quant_type(weight):
    packed, state = weight
    with pytest.raises(ValueError, match="quant_type must be 'nf4' or 'fp4'"):
        kernel.dequantize_nf4(packed, altered(state, quant_type="int4"))


@pytest.mark.parametrize("dtype", [torch.int8, torch.float64, torch.uint8], ids=str)
def test_unsupported_output_dtype(weight, dtype):
    packed, state = weight
    with pytest.raises(ValueError, match="output dtype must be float16, bfloat16 or float32"):
        kernel.dequantize_nf4(packed, altered(state, dtype=dtype))


@pytest.mark.parametrize("blocksize, message", [
    (0, "blocksize must be a power of two"), (1, "blocksize must be a power of two"),
    (48, "blocksize must be a power of two"), (96, "blocksize must be a power of two"),
    (64.0, "blocksize must be an integer, got 64.0"), ("64", "blocksize must be an integer"),
], ids=repr)
def test_bad_blocksize(weight, blocksize, message):
    packed, state = weight
    with pytest.raises(ValueError, match=message):
        kernel.dequantize_nf4(packed, altered(state, blocksize=blocksize))


@pytest.mark.parametrize("make", [lambda: np.int64(64), lambda: torch.tensor(64)], ids=["numpy", "0-dim tensor"])
def test_integer_like_blocksize(weight, make):
    """An integer-like blocksize is the integer it holds, with and without double quantization."""
    packed, state = weight
    expected = kernel.dequantize_nf4(packed, state)
    assert_bit_exact(kernel.dequantize_nf4(packed, altered(state, blocksize=make())), expected)
    if state.nested:
        state2 = altered(state.state2, blocksize=make())
        assert_bit_exact(kernel.dequantize_nf4(packed, altered(state, state2=state2)), expected)


@pytest.mark.parametrize("shape, message", [
    ((8, -64), "shape entries must be >= 0"), ((8, 64.0), "every shape entry must be an integer"),
    ("8x64", "shape must be a tuple of sizes"),
], ids=repr)
def test_bad_shape(weight, shape, message):
    packed, state = weight
    with pytest.raises(ValueError, match=message):
        kernel.dequantize_nf4(packed, altered(state, shape=shape))


def test_offset_given_as_a_string(weight):
    packed, state = weight
    with pytest.raises(ValueError, match="offset must be a float or a one-element tensor, got '0.5'"):
        kernel.dequantize_nf4(packed, altered(state, offset="0.5"))


@pytest.mark.parametrize("layout", ["sparse", "meta"])
def test_packed_without_dense_storage(weight, layout):
    """A sparse packed weight or one on the meta device: a named ValueError, also once a plan exists."""
    packed, state = weight
    kernel.dequantize_nf4(packed, state)  # leaves a plan for the state
    bad = packed.to_sparse() if layout == "sparse" else packed.to("meta")
    with pytest.raises(ValueError, match="dense tensor" if layout == "sparse" else "meta"):
        kernel.dequantize_nf4(bad, state)


def test_packed_too_small(weight):
    packed, state = weight
    with pytest.raises(ValueError, match="packed weight has 255 bytes, shape \\(8, 64\\) needs 256"):
        kernel.dequantize_nf4(packed[:-1], state)


def test_packed_view_past_its_storage(weight):
    """A storage resized smaller under its view: the bytes past it are not the weight's."""
    packed, state = weight
    packed.untyped_storage().resize_(100)
    with pytest.raises(ValueError, match="packed weight spans 256 bytes but its storage holds 100 from where it starts"):
        kernel.dequantize_nf4(packed, state)
    view = torch.zeros(512, dtype=torch.uint8, device=packed.device)[200:456].view(256, 1)
    view.untyped_storage().resize_(300)
    with pytest.raises(ValueError, match="storage holds 100 from where it starts"):
        kernel.dequantize_nf4(view, state)


def test_absmax_too_small(weight):
    packed, state = weight
    with pytest.raises(ValueError, match="absmax has 7 elements, needs at least 8"):
        kernel.dequantize_nf4(packed, altered(state, absmax=state.absmax[:-1]))


def test_absmax_wrong_dtype(weight):
    packed, state = weight
    with pytest.raises(ValueError, match="absmax must be torch.uint8"):
        kernel.dequantize_nf4(packed, altered(state, absmax=state.absmax.float()))


def test_offset_with_two_values(weight):
    packed, state = weight
    with pytest.raises(ValueError, match="offset must hold one value, got 2"):
        kernel.dequantize_nf4(packed, altered(state, offset=state.offset.repeat(2)))


def test_state_on_other_device(weight):
    packed, state = weight
    with pytest.raises(ValueError, match="code is on meta but the packed weight is on"):
        kernel.dequantize_nf4(packed, altered(state, code=state.code.to("meta")))


def test_non_contiguous_packed(weight):
    packed, state = weight
    strided = torch.stack([packed, packed], dim=1)[:, 0]
    assert not strided.is_contiguous()
    with pytest.raises(ValueError, match="packed weight must be contiguous"):
        kernel.dequantize_nf4(strided, state)


@pytest.mark.parametrize(
    "make_out, message",
    [
        (lambda s, d: torch.empty(8, 32, dtype=s.dtype, device=d), "out has shape \\(8, 32\\), expected \\(8, 64\\)"),
        (lambda s, d: torch.empty(8, 64, dtype=torch.bfloat16, device=d), "out has dtype torch.bfloat16, expected torch.float16"),
        (lambda s, d: torch.empty(8, 64, dtype=s.dtype, device="meta"), "out is on meta"),
        (lambda s, d: torch.empty(64, 8, dtype=s.dtype, device=d).t(), "out must be contiguous"),
        (lambda s, d: [0.0] * 512, "out must be a tensor"),
    ],
    ids=["shape", "dtype", "device", "layout", "type"],
)
def test_bad_out(weight, device, make_out, message):
    packed, state = weight
    with pytest.raises(ValueError, match=message):
        kernel.dequantize_nf4(packed, state, out=make_out(state, device))


@pytest.mark.gpu
def test_cpu_packed_with_cuda_state(weight):
    packed, state = weight
    with pytest.raises(ValueError, match="(interpreter|on cuda:0 but the packed weight is on cpu)"):
        kernel.dequantize_nf4(packed.cpu(), state)


@pytest.mark.gpu
def test_cuda_out_for_cpu_weight_and_next_call_exact(weight):
    packed, state = weight
    out = torch.empty(8, 64, dtype=state.dtype, device="cpu")
    with pytest.raises(ValueError, match="out is on cpu but the packed weight is on cuda"):
        kernel.dequantize_nf4(packed, state, out=out)
    import bitsandbytes.functional as F

    assert torch.equal(kernel.dequantize_nf4(packed, state), F.dequantize_4bit(packed, state))


@pytest.mark.parametrize("config, message", [((96, 4), "bytes_per_program must be a power of two"),
                                             ((1024, 3), "num_warps must be a power of two"),
                                             ((8, 4), "bytes_per_program must be a power of two >= 16"),
                                             ((1024, 4, 1), "shared_tables must be a bool")])
def test_bad_launch_config(config, message):
    with pytest.raises(ValueError, match=message):
        kernel.set_launch_config(*config)
    assert kernel.launch_config((9, 0)) == kernel.LAUNCH_CONFIGS[(9, 0)][0].config  # the table still decides


def test_shared_tables_refused_where_triton_cannot_compile_them():
    if kernel.TRITON_COMPILES_SHARED_TABLES:
        pytest.skip("this Triton compiles the shared-memory lookup")
    with pytest.raises(ValueError, match="cannot compile the shared-memory codebook lookup"):
        kernel.set_launch_config(1024, 4, True)
    assert kernel.launch_config((9, 0)) == kernel.LAUNCH_CONFIGS[(9, 0)][0].config  # the table still decides


@pytest.mark.parametrize("target", ["packed weight", "absmax", "code"])
def test_out_overlapping_an_input(target, device):
    """An out buffer that shares bytes with an input would overwrite what the launch reads: refused,
    the input left as it was."""
    packed, state = quantize((64, 64), dtype=torch.float32, nested=False, device=device)
    source = {"packed weight": packed, "absmax": state.absmax, "code": state.code}[target]
    source_bytes = source.view(torch.uint8).reshape(-1).clone()
    # One buffer: the input's bytes at its start, and the float32 output over all of it.
    storage = torch.zeros(64 * 64 * 4, dtype=torch.uint8, device=device)
    storage[:source_bytes.numel()].copy_(source_bytes)
    inside = storage[:source_bytes.numel()].view(source.dtype)
    if target == "packed weight":
        packed = inside
    elif target == "absmax":
        state.absmax = inside
    else:
        state.code = inside
    out = storage.view(torch.float32).view(64, 64)
    with pytest.raises(ValueError, match=f"out overlaps the {target}"):
        kernel.dequantize_nf4(packed, state, out=out)
    assert torch.equal(storage[:source_bytes.numel()], source_bytes)


def test_out_that_requires_grad(weight):
    """out is written outside autograd: one that requires grad is refused."""
    packed, state = weight
    out = torch.empty(8, 64, dtype=state.dtype, device=packed.device, requires_grad=True)
    with pytest.raises(ValueError, match="out must not require grad"):
        kernel.dequantize_nf4(packed, state, out=out)


def test_out_written_bumps_its_version(weight):
    """A graph that saved out before it was written refuses to run backward, as after any in-place write."""
    packed, state = weight
    out = torch.zeros(8, 64, dtype=state.dtype, device=packed.device)
    x = torch.ones(8, 64, dtype=state.dtype, device=packed.device, requires_grad=True)
    y = (x * out).sum()
    kernel.dequantize_nf4(packed, state, out=out)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_offset_past_fp32_range(device):
    """A float offset beyond fp32's range is rounded as fp32 rounds it (to infinity), not refused by the
    cache key's packing."""
    packed, state = quantize((8, 64), dtype=torch.float32, device=device, seed=4)
    state.offset = 1e39
    assert_bit_exact(kernel.dequantize_nf4(packed, state), expected_values(packed, state))


def test_plan_keeps_its_offset_tensor(device):
    """A float offset's tensor stays alive while a kept launch reads it: after another value's tensor
    replaced it for the state, the first value again is served exact, not from freed memory."""
    packed, state = quantize((64, 64), dtype=torch.float32, device=device, seed=5)
    first = float(state.offset)
    state.offset = first
    expected = expected_values(packed, state)
    assert_bit_exact(kernel.dequantize_nf4(packed, state), expected)  # a plan kept
    state.offset = 0.25
    with pytest.raises(ValueError):  # a call that checks, keeps no plan, and makes the state a new offset tensor
        kernel.dequantize_nf4(packed, state, out=torch.empty(3, device=device))
    state.offset = first
    junk = [torch.full((1,), 1e4, device=device) for _ in range(2000)]  # reuse what was freed
    assert_bit_exact(kernel.dequantize_nf4(packed, state), expected)
    del junk


@pytest.mark.parametrize("storage", [torch.float16, torch.float32], ids=str)
def test_packed_with_a_unit_dimension_strided(storage, device):
    """A contiguous packed weight whose dimension of size one has another stride ((1, n).t() of a wider
    storage dtype) is read as its bytes."""
    packed, state = quantize((8, 64), dtype=torch.float16, storage=storage, device=device, seed=6)
    transposed = packed.reshape(1, -1).clone().t()
    assert transposed.is_contiguous() and transposed.stride() != packed.stride()
    assert_bit_exact(kernel.dequantize_nf4(transposed, state), expected_values(packed, state))
