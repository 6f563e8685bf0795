"""Reliability: seeded fuzzing against bitsandbytes, and what real training and serving code does
on a GPU (threads, memory, freed and reused weights, other devices).

The fuzz runs everywhere: 96 seeded cases through the CPU interpreter; on a GPU the first
GPU_FUZZ_CASES, and all 520 with --long.
Set NF4_FUZZ_SEED to replay another sequence.
"""

import os
import random
import threading

import pytest
import torch

from helpers import assert_bit_exact, bit_exact, bnb_dequantize, expected_values, failures_in_threads, quantize
from nf4_triton import kernel
from reference import dequantize_reference

FUZZ_SEED = int(os.environ.get("NF4_FUZZ_SEED", "20261121"))
FUZZ_CASES = 520 if torch.cuda.is_available() else 96
BLOCKSIZES = [32, 64, 128, 256, 512, 1024, 2048, 4096]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
STORAGES = [torch.uint8, torch.float16, torch.bfloat16, torch.float32]


def fuzz_case(index):
    """One random weight description, reproducible from (FUZZ_SEED, index)."""
    rng = random.Random(FUZZ_SEED * 100_003 + index)
    dims = rng.choice([1, 2, 2, 2, 3])
    shape = tuple(rng.choice([1, 2, 3, 7, 31, 64, 65, 127, 129, 300]) for _ in range(dims))
    n_bytes = (torch.Size(shape).numel() + 1) // 2
    storages = [s for s in STORAGES if n_bytes % torch.tensor([], dtype=s).element_size() == 0]
    return dict(
        shape=shape,
        blocksize=rng.choice(BLOCKSIZES),
        nested=rng.random() < 0.7,
        quant_type=rng.choice(["nf4", "nf4", "fp4"]),
        dtype=rng.choice(DTYPES),
        storage=rng.choice(storages),
        scale=rng.choice([1.0, 1.0, 1e-30, 1e-8, 1e8, 1e30, 0.0]),
        zero_rows=rng.random() < 0.3,
        seed=rng.randrange(2**31),
    )


def fuzz_weight(case, device):
    """The case's weight, quantized (and rescaled) by bitsandbytes on ``device``: quantized on the CPU,
    the first case took 58.7 s on a GPU host, bitsandbytes' first CPU dequantization (NOTES.md, item 63)."""
    packed, state = quantize(case["shape"], dtype=case["dtype"], nested=case["nested"],
                             blocksize=case["blocksize"], quant_type=case["quant_type"],
                             storage=case["storage"], device=device, seed=case["seed"])
    if case["scale"] != 1.0 or case["zero_rows"]:
        # Re-quantize a rescaled weight: tiny, huge and all-zero absmax blocks.
        import bitsandbytes.functional as F

        weight = F.dequantize_4bit(packed, state).float() * case["scale"]
        if case["zero_rows"] and weight.dim() >= 1:
            weight[: max(1, weight.shape[0] // 2)] = 0
        packed, state = F.quantize_4bit(weight, blocksize=case["blocksize"], compress_statistics=case["nested"],
                                        quant_type=case["quant_type"], quant_storage=case["storage"])
        state.dtype = case["dtype"]
    return packed, state


# A GPU runs the first GPU_FUZZ_CASES by default and the rest of its FUZZ_CASES with --long.
GPU_FUZZ_CASES = 24


@pytest.mark.parametrize("index", [pytest.param(index, marks=pytest.mark.long) if index >= GPU_FUZZ_CASES else index
                                   for index in range(FUZZ_CASES)])
def test_fuzz(index, device):
    case = fuzz_case(index)
    packed, state = fuzz_weight(case, device)
    expected = expected_values(packed, state)
    if packed.is_cuda:  # the reference that stands in for bitsandbytes' CUDA kernel on the CPU
        assert_bit_exact(dequantize_reference(packed, state), expected)
    poisoned = torch.full(tuple(state.shape), float("nan"), dtype=state.dtype, device=device)
    got = kernel.dequantize_nf4(packed, state, out=poisoned)
    assert_bit_exact(got, expected)
    assert_bit_exact(kernel.dequantize_nf4(packed, state), expected)


# ---- GPU only -----------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.long
def test_threads():
    """8 threads, 1000 calls each on their own weights, all exact (the plans are shared state)."""
    weights = [quantize((64 + 8 * i, 96), dtype=DTYPES[i % 3], device="cuda", seed=100 + i) for i in range(8)]
    expected = [bnb_dequantize(*w) for w in weights]

    def work(i):
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            for _ in range(1000):
                if not bit_exact(kernel.dequantize_nf4(*weights[i]), expected[i]):
                    return "wrong values"
        stream.synchronize()

    assert not failures_in_threads(work, 8)


@pytest.mark.gpu
def test_freed_weight_memory_reused():
    """A weight freed and another one written into the same memory, with a new quant state (that
    Python may give the freed state's id): the new values, never a plan left by the first."""
    first_packed, first_state = quantize((256, 256), device="cuda", seed=200)
    memory = torch.empty_like(first_packed).copy_(first_packed)
    kernel.dequantize_nf4(memory, first_state)
    key = id(first_state)
    assert key in kernel.PLANS
    del first_packed, first_state
    assert key not in kernel.PLANS  # the state's weakref dropped the plan
    packed, state = quantize((256, 256), device="cuda", seed=201)
    memory.copy_(packed)
    assert_bit_exact(kernel.dequantize_nf4(memory, state), bnb_dequantize(packed, state))


@pytest.mark.gpu
def test_weight_moved_away_and_back():
    packed, state = quantize((256, 256), device="cuda", seed=202)
    expected = bnb_dequantize(packed, state)
    kernel.dequantize_nf4(packed, state)
    packed = packed.cpu().cuda()
    state.to("cpu")
    state.to("cuda")
    assert_bit_exact(kernel.dequantize_nf4(packed, state), expected)


@pytest.mark.gpu
@pytest.mark.long
def test_memory_steady_and_peak():
    packed, state = quantize((1024, 1024), dtype=torch.bfloat16, device="cuda", seed=203)
    kernel.dequantize_nf4(packed, state)  # compile and leave the plan
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    for _ in range(10_000):
        kernel.dequantize_nf4(packed, state)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == baseline

    output_bytes = 1024 * 1024 * 2
    for call in (lambda: kernel.dequantize_nf4(packed, state), lambda: kernel.validate_and_dequantize(packed, state)):
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        result = call()
        torch.cuda.synchronize()
        assert torch.cuda.max_memory_allocated() - before < output_bytes + 2**20
        del result


@pytest.mark.gpu
def test_outputs_never_share_storage():
    packed, state = quantize((128, 128), device="cuda", seed=204)
    outputs = [kernel.dequantize_nf4(packed, state) for _ in range(4)]
    pointers = {out.untyped_storage().data_ptr() for out in outputs}
    assert len(pointers) == 4


@pytest.mark.gpu(2)
def test_weight_on_second_device():
    """A weight on cuda:1 while cuda:0 is current: right values, on cuda:1, twice (plan or not)."""
    packed, state = quantize((512, 384), dtype=torch.bfloat16, device="cuda:1", seed=205)
    expected = bnb_dequantize(packed, state)
    with torch.cuda.device(0):
        for _ in range(2):
            got = kernel.dequantize_nf4(packed, state)
            assert got.device == torch.device("cuda:1")
            assert_bit_exact(got, expected)


@pytest.mark.gpu
def test_graph_capture_without_warm_up():
    """The first call for a weight made inside CUDA graph capture: exact after replay, or a clean
    error; either way later eager calls are exact."""
    packed, state = quantize((384, 640), dtype=torch.bfloat16, device="cuda", seed=206)
    expected = bnb_dequantize(packed, state)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            captured = kernel.dequantize_nf4(packed, state)
    except Exception as error:  # noqa: BLE001 (a clean error is allowed; a wrong answer is not)
        assert "captur" in str(error).lower() or "graph" in str(error).lower(), error
    else:
        graph.replay()
        torch.cuda.synchronize()
        assert_bit_exact(captured, expected)
    torch.cuda.synchronize()
    for _ in range(2):
        assert_bit_exact(kernel.dequantize_nf4(packed, state), expected)


@pytest.mark.gpu
def test_float_offset_inside_a_graph_outlives_replanning():
    """A graph captured through a plan whose offset came as a float, then the plans replaced
    (set_launch_config) and memory churned: replays still read the offset."""
    packed, state = quantize((256, 320), device="cuda", seed=207)
    state.offset = float(state.offset)
    expected = bnb_dequantize(packed, state)
    kernel.dequantize_nf4(packed, state)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = kernel.dequantize_nf4(packed, state)
    kernel.set_launch_config()
    junk = [torch.full((4096,), 7.0, device="cuda") for _ in range(64)]
    torch.cuda.empty_cache()
    graph.replay()
    torch.cuda.synchronize()
    assert_bit_exact(captured, expected)
    del junk


@pytest.mark.gpu
def test_side_stream_rewrites_the_packed_bytes():
    """Another stream rewrites the weight's bytes; after syncing with it, the plan reads the new ones."""
    packed, state = quantize((512, 768), device="cuda", seed=208)
    new_packed, _ = quantize((512, 768), device="cuda", seed=209)
    kernel.dequantize_nf4(packed, state)  # the plan
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(5_000_000)
        packed.copy_(new_packed)
    torch.cuda.current_stream().wait_stream(side)
    assert_bit_exact(kernel.dequantize_nf4(packed, state), bnb_dequantize(new_packed, state))


def special_values_state(state, nested):
    """A copy of ``state`` with NaN, +-Inf, -0.0 and subnormals in the tables that scale."""
    import copy

    state = copy.deepcopy(state)
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-40, -1e-39, 3e-38, 1.0],
                            device=state.code.device)
    if nested:
        absmax2 = state.state2.absmax
        state.state2.absmax = specials.repeat(-(-absmax2.numel() // 8))[:absmax2.numel()].clone()
        state.state2.code = state.state2.code.clone()
        state.state2.code[::37] = specials.repeat(7)[:state.state2.code[::37].numel()]
    else:
        state.absmax = specials.repeat(-(-state.absmax.numel() // 8))[:state.absmax.numel()].clone()
    return state


@pytest.mark.gpu
@pytest.mark.parametrize("use_asm", [True, False], ids=["asm", "pure-triton"])
@pytest.mark.parametrize("nested", [True, False], ids=["nested", "flat"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_special_values(dtype, nested, use_asm):
    """NaN, Inf, -0.0 and subnormals in the scales: bitsandbytes' bits, NaN payloads included,
    through each variant and through the plan."""
    packed, state = quantize((64 * 256 + 64, 64), dtype=dtype, nested=nested, device="cuda", seed=210)
    state = special_values_state(state, nested)
    expected = bnb_dequantize(packed, state)
    assert_bit_exact(kernel.validate_and_dequantize(packed, state, USE_ASM=use_asm), expected)
    for _ in range(2):
        assert_bit_exact(kernel.dequantize_nf4(packed, state), expected)


@pytest.mark.gpu
@pytest.mark.long
def test_threads_while_plans_are_replaced():
    """7 threads with their own streams call on their own weights while another thread keeps
    replacing every plan (set_launch_config) and emptying the allocator's cache: all exact."""
    weights = [quantize((96 + 32 * i, 160), dtype=DTYPES[i % 3], device="cuda", seed=220 + i) for i in range(7)]
    expected = [bnb_dequantize(*w) for w in weights]
    done = threading.Event()

    def work(i):
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            for _ in range(300):
                got = kernel.dequantize_nf4(*weights[i])
                stream.synchronize()
                if not bit_exact(got, expected[i]):
                    return "wrong values"

    def churn():
        while not done.is_set():
            kernel.set_launch_config()
            torch.cuda.empty_cache()

    churner = threading.Thread(target=churn)
    churner.start()
    try:
        failures = failures_in_threads(work, 7)
    finally:
        done.set()
        churner.join()
    assert not failures


@pytest.mark.gpu
def test_launch_hook_added_then_removed(monkeypatch):
    """A profiler's Triton launch hook needs Triton's own launch: while set, calls go through it
    (and stay exact); once removed, the plan serves again."""
    import triton

    packed, state = quantize((256, 512), device="cuda", seed=230)
    expected = bnb_dequantize(packed, state)
    kernel.dequantize_nf4(packed, state)
    seen = []
    hook = lambda *args, **kwargs: seen.append(1)  # noqa: E731
    if hasattr(triton, "knobs"):
        runtime = triton.knobs.runtime
        chain = runtime.launch_enter_hook
        if hasattr(chain, "add"):
            chain.add(hook)
            remove = lambda: chain.remove(hook)  # noqa: E731
        else:
            runtime.launch_enter_hook = hook
            remove = lambda: setattr(runtime, "launch_enter_hook", chain)  # noqa: E731
    else:
        triton.compiler.CompiledKernel.launch_enter_hook = hook
        remove = lambda: setattr(triton.compiler.CompiledKernel, "launch_enter_hook", None)  # noqa: E731
    try:
        for _ in range(3):
            assert_bit_exact(kernel.dequantize_nf4(packed, state), expected)
    finally:
        remove()
    assert len(seen) == 3
    monkeypatch.setattr(kernel, "validate_and_dequantize", lambda *args, **kwargs: pytest.fail("the plan was not used"))
    assert_bit_exact(kernel.dequantize_nf4(packed, state), expected)
