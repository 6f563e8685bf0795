"""GPU-only checks: every kernel variant, more than 2**31 elements, and the challenge's own check."""

import math
import os
import subprocess
import sys

import pytest
import torch

import bench
import kernel
from helpers import assert_bit_exact, bit_exact, bnb_dequantize, quantize
from reference import dequantize_reference

pytestmark = pytest.mark.gpu

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


@pytest.mark.parametrize("byte_loads", [False, True], ids=["auto-loads", "byte-loads"])
@pytest.mark.parametrize("bf16_via_int", [False, True], ids=["native-cvt", "int-rne"])
@pytest.mark.parametrize("use_asm", [True, False], ids=["asm", "pure-triton"])
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("nested", [True, False], ids=["nested", "flat"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(3, 100), (17, 129), (1024, 4096 + 64)], ids=str)
def test_every_variant(shape, dtype, nested, quant_type, use_asm, bf16_via_int, byte_loads):
    """The inline-PTX and pure-Triton paths, both bf16 roundings and both load widths (the wrapper
    picks words for the last shape, bytes for the odd ones) give bitsandbytes' bits."""
    packed, state = quantize(shape, dtype=dtype, nested=nested, quant_type=quant_type, device="cuda",
                             seed=shape[0])
    overrides = dict(WORD_LOADS=False) if byte_loads else {}
    got = kernel._dequantize(packed, state, None, USE_ASM=use_asm, BF16_VIA_INT=bf16_via_int, **overrides)
    assert_bit_exact(got, bnb_dequantize(packed, state))


@pytest.mark.parametrize("byte_loads", [False, True], ids=["auto-loads", "byte-loads"])
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("nested", [True, False], ids=["nested", "flat"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(3, 100), (17, 129), (1024, 4096 + 64)], ids=str)
def test_every_variant_with_shared_tables(shape, dtype, nested, quant_type, byte_loads):
    """The codebooks looked up in shared memory (the H100's choice from 2.25 to 17 MiB and from 48 MiB
    of packed weight) give bitsandbytes' bits on every shape, dtype, format and load width."""
    if not kernel.TRITON_COMPILES_SHARED_TABLES:
        pytest.skip("this Triton cannot compile the shared-memory lookup")
    packed, state = quantize(shape, dtype=dtype, nested=nested, quant_type=quant_type, device="cuda",
                             seed=shape[0] + 1)
    overrides = dict(WORD_LOADS=False) if byte_loads else {}
    got = kernel._dequantize(packed, state, None, SHARED_TABLES=True, **overrides)
    assert_bit_exact(got, bnb_dequantize(packed, state))


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("nested", [True, False], ids=["nested", "flat"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(17, 129), (1024, 4096 + 64)], ids=str)
@pytest.mark.parametrize("tile", [(2048, 2), (512, 4)], ids=lambda tile: f"{tile[0]}-{tile[1]}")
def test_tier_tiles_with_shared_tables(tile, shape, dtype, nested, quant_type):
    """The H100's shared-codebook tiles (2048 bytes over 2 warps, 512 over 4) on odd and even shapes."""
    if not kernel.TRITON_COMPILES_SHARED_TABLES:
        pytest.skip("this Triton cannot compile the shared-memory lookup")
    packed, state = quantize(shape, dtype=dtype, nested=nested, quant_type=quant_type, device="cuda", seed=tile[0])
    got = kernel._dequantize(packed, state, None, SHARED_TABLES=True, BYTES_PER_PROGRAM=tile[0], num_warps=tile[1])
    assert_bit_exact(got, bnb_dequantize(packed, state))


@pytest.mark.parametrize("smallest", sorted({tier[0] for tier in kernel.LAUNCH_CONFIGS[(9, 0)]} - {0}))
def test_every_tier_on_the_gpu(smallest):
    """A weight at the smallest size of each H100 tier takes that tier's configuration (through its
    plan too) and stays bit-exact."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the tiers are measured for sm_90")
    bytes_per_program, _, shared = kernel.launch_config((9, 0), smallest)
    packed, state = quantize((2 * smallest // 4096, 4096), dtype=torch.bfloat16, device="cuda", seed=smallest % 997)
    variant = kernel.kernel_variant(torch.bfloat16, nested=True, n_elements=2 * smallest)
    assert (variant["BYTES_PER_PROGRAM"], variant["SHARED_TABLES"]) == (bytes_per_program, shared)
    expected = bnb_dequantize(packed, state)
    for _ in range(2):  # the validating call, then the plan
        assert_bit_exact(kernel.dequantize_nf4(packed, state), expected)


def synthetic_state(n_elements, dtype, seed=0):
    """A valid nested NF4 state built directly (bitsandbytes' quantizer is not needed for it)."""
    import bitsandbytes.functional as F

    generator = torch.Generator(device="cuda").manual_seed(seed)
    n_blocks = -(-n_elements // 64)
    packed = torch.randint(0, 256, ((n_elements + 1) // 2, 1), dtype=torch.uint8, device="cuda", generator=generator)
    absmax = torch.randint(0, 256, (n_blocks,), dtype=torch.uint8, device="cuda", generator=generator)
    absmax2 = torch.rand(-(-n_blocks // 256), device="cuda", generator=generator) * 0.1
    state2 = F.QuantState(absmax=absmax2, code=F.create_dynamic_map().cuda(), blocksize=256, dtype=torch.float32)
    return packed, F.QuantState(absmax=absmax, shape=torch.Size([n_elements]), code=F.get_4bit_type("nf4", device="cuda"),
                                blocksize=64, quant_type="nf4", dtype=dtype, offset=torch.tensor(0.0123, device="cuda"),
                                state2=state2)


def sub_state(packed, state, start, count):
    """Elements [start, start + count) as a weight of their own (start aligned to 64 * 256)."""
    import bitsandbytes.functional as F

    assert start % (state.blocksize * state.state2.blocksize) == 0
    block, block2 = start // state.blocksize, start // (state.blocksize * state.state2.blocksize)
    n_blocks = -(-count // state.blocksize)
    state2 = F.QuantState(absmax=state.state2.absmax[block2:block2 + -(-n_blocks // 256)], code=state.state2.code,
                          blocksize=256, dtype=torch.float32)
    part = F.QuantState(absmax=state.absmax[block:block + n_blocks], shape=torch.Size([count]), code=state.code,
                        blocksize=64, quant_type="nf4", dtype=state.dtype, offset=state.offset, state2=state2)
    return packed[start // 2:(start + count + 1) // 2], part


def test_more_than_2_pow_31_elements():
    n_elements = 2**31 + 192
    packed, state = synthetic_state(n_elements, torch.float16)
    got = torch.full((n_elements,), float("nan"), dtype=torch.float16, device="cuda")
    kernel.dequantize_nf4(packed, state, out=got)
    chunk = 2**30
    for start in range(0, n_elements, chunk):
        count = min(chunk, n_elements - start)
        part_packed, part_state = sub_state(packed, state, start, count)
        assert_bit_exact(got[start:start + count], bnb_dequantize(part_packed, part_state))
    assert not got.isnan().any()


def test_caller_stream():
    """The kernel runs on the current stream, right after the packed weight was written there."""
    packed, state = quantize((512, 1024), device="cuda", seed=11)
    expected = bnb_dequantize(packed, state)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fresh = torch.empty_like(packed)
        torch.cuda._sleep(10_000_000)
        fresh.copy_(packed)
        got = kernel.dequantize_nf4(fresh, state)
    stream.synchronize()
    assert_bit_exact(got, expected)


# ---- the challenge's check (challenge.md), without its timing -----------------------------------
@pytest.mark.parametrize("option", bench.HARNESS_OPTIONS, ids=lambda o: f"{o[2]}x{o[3]}-{o[5]}")
def test_challenge_check(option):
    """The challenge's own warm-up check (bench.challenge_check), with Unsloth's equality when installed."""
    pytest.importorskip("transformers")
    largest = bench.challenge_check(kernel.your_dequantize_nf4, option, bench.unsloth_fast_dequantize())
    assert math.isfinite(largest)


# ---- launch plans: the fast path must never serve stale results ---------------------------------
def test_plan_is_used_and_exact():
    packed, state = quantize((256, 320), dtype=torch.bfloat16, device="cuda", seed=12)
    expected = bnb_dequantize(packed, state)
    first = kernel.dequantize_nf4(packed, state)
    assert (packed.data_ptr(), id(state)) in kernel._PLANS
    second, third = kernel.dequantize_nf4(packed, state), kernel.dequantize_nf4(packed, state)
    for got in (first, second, third):
        assert_bit_exact(got, expected)
    assert len({first.data_ptr(), second.data_ptr(), third.data_ptr()}) == 3
    # Triton 3.3 to 3.6 forward to their C launch function in a way the plan can record: it must
    # take the direct launch there, not silently fall back to Triton's launcher.
    assert kernel._PLANS[(packed.data_ptr(), id(state))].launch_kernel.__name__ == "direct"


def test_plan_after_requantization_in_place():
    packed, state = quantize((256, 320), device="cuda", seed=13)
    kernel.dequantize_nf4(packed, state)
    new_packed, new_state = quantize((256, 320), device="cuda", seed=14)
    packed.copy_(new_packed)
    state.absmax.copy_(new_state.absmax)
    state.state2.absmax.copy_(new_state.state2.absmax)
    state.offset.copy_(new_state.offset)
    assert_bit_exact(kernel.dequantize_nf4(packed, state), bnb_dequantize(new_packed, new_state))


def _changed_after_plan(change):
    """A weight whose plan exists, then one field of its state rebound (or, for "blocksize-shape",
    another weight and state); returns (packed, state, what the call must now return)."""
    packed, state = quantize((256, 320), device="cuda", seed=15)
    kernel.dequantize_nf4(packed, state)
    other_packed, other = quantize((256, 320), device="cuda", seed=16)
    if change == "absmax":
        state.absmax = other.absmax
    elif change == "code":
        state.code = state.code.flip(0)
    elif change == "offset":
        state.offset = state.offset + 0.25
    elif change == "state2":
        state.state2, state.offset = other.state2, other.offset
    elif change == "state2-absmax":
        state.state2.absmax = other.state2.absmax * 2
    elif change == "state2-code":
        state.state2.code = state.state2.code.flip(0)
    elif change == "dtype":
        state.dtype = torch.float32
    elif change == "shape":
        state.shape = torch.Size((320, 256))
    elif change == "quant_type":  # the table rewritten in place to FP4's (same object), the type flipped
        state.code.copy_(quantize((256, 320), quant_type="fp4", device="cuda", seed=16)[1].code)
        state.quant_type = "fp4"
    else:
        packed, state = quantize((320, 256), blocksize=128, device="cuda", seed=17)
    # bitsandbytes decodes NF4 with its built-in table; the format (and this kernel) read the state's.
    expected = dequantize_reference(packed, state) if change == "code" else bnb_dequantize(packed, state)
    return packed, state, expected


STATE_CHANGES = ["absmax", "code", "offset", "state2", "state2-absmax", "state2-code", "dtype", "shape",
                 "quant_type"]
INVALIDATING_CHANGES = ["blocksize", "state2-blocksize", "nested"]


@pytest.mark.parametrize("change", STATE_CHANGES + ["blocksize-shape"])
def test_plan_after_state_changes(change):
    """Every field a plan relies on, rebound after the plan was made: the next call sees it."""
    packed, state, expected = _changed_after_plan(change)
    assert_bit_exact(kernel.dequantize_nf4(packed, state), expected)


def _invalidated_after_plan(change):
    packed, state = quantize((256, 320), device="cuda", seed=21)
    kernel.dequantize_nf4(packed, state)
    if change == "blocksize":
        state.blocksize = 32  # twice the blocks the absmax holds
    elif change == "state2-blocksize":
        state.state2.blocksize = 128  # twice the blocks state2's absmax holds
    else:
        state.nested = False  # a uint8 absmax read as fp32 scales
    return packed, state


@pytest.mark.parametrize("change", INVALIDATING_CHANGES)
def test_plan_does_not_hide_an_invalid_state(change):
    """A change that makes the state unusable for the packed weight raises after a plan exists,
    as it would without one."""
    packed, state = _invalidated_after_plan(change)
    with pytest.raises(ValueError, match="absmax"):
        kernel.dequantize_nf4(packed, state)


@pytest.mark.parametrize("change", STATE_CHANGES + INVALIDATING_CHANGES)
def test_identity_only_plan_check_is_caught(change, monkeypatch):
    """Known-bad: a plan that checks only the state object's identity serves a stale result for
    every change above (or no error), so each of those tests can fail."""
    monkeypatch.setattr(kernel._LaunchPlan, "matches", lambda self, weight, qs: self.state_ref() is qs)
    if change in INVALIDATING_CHANGES:
        packed, state = _invalidated_after_plan(change)
        kernel.dequantize_nf4(packed, state)  # no error: the stale plan answered
    else:
        packed, state, expected = _changed_after_plan(change)
        assert not bit_exact(kernel.dequantize_nf4(packed, state), expected)


def test_plan_dropped_with_its_state():
    import gc

    packed, state = quantize((64, 64), device="cuda", seed=18)
    kernel.dequantize_nf4(packed, state)
    key = (packed.data_ptr(), id(state))
    assert key in kernel._PLANS
    del state
    gc.collect()
    assert key not in kernel._PLANS


def test_state_without_dict_gets_no_plan():
    """A quant state with __slots__ (no __dict__, no weakref) cannot be watched by a plan: every
    call takes the validating path, and a rebound field is served fresh."""
    packed, state = quantize((256, 320), device="cuda", seed=20)
    fields = ("absmax", "shape", "code", "dtype", "blocksize", "quant_type", "offset", "state2", "nested")
    slotted = type("SlottedState", (), {"__slots__": fields})()
    for name in fields:
        setattr(slotted, name, getattr(state, name))
    for _ in range(2):
        assert_bit_exact(kernel.dequantize_nf4(packed, slotted), bnb_dequantize(packed, state))
    assert (packed.data_ptr(), id(slotted)) not in kernel._PLANS
    state.absmax = slotted.absmax = state.absmax.flip(0)
    assert_bit_exact(kernel.dequantize_nf4(packed, slotted), bnb_dequantize(packed, state))


def test_plan_with_float_offset():
    """An offset given as a Python float: the tensor the wrapper makes must outlive the plan's use."""
    packed, state = quantize((256, 320), device="cuda", seed=19)
    state.offset = float(state.offset)
    expected = bnb_dequantize(packed, state)
    for _ in range(3):
        junk = [torch.randn(1024, device="cuda") for _ in range(8)]  # reuse freed blocks
        assert_bit_exact(kernel.dequantize_nf4(packed, state), expected)
        del junk


EXIT_SCRIPT = """
import sys
sys.path[:0] = [{root!r}, {tests!r}]
import torch
import kernel
from helpers import quantize

packed, state = quantize((64, 64), device="cuda")
kernel.dequantize_nf4(packed, state)  # a kept plan
plan = kernel._launch_plan(packed, state)  # and one that is not
# Held by the module itself, so the state dies while the module's globals are being cleared.
kernel._held_until_exit = (packed, state, plan)
"""


def test_plans_alive_at_interpreter_exit():
    """A plan's weakref callback may run after the module's globals are gone: no error at exit."""
    tests = os.path.dirname(os.path.abspath(__file__))
    script = EXIT_SCRIPT.format(root=os.path.dirname(tests), tests=tests)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Exception ignored" not in result.stderr, result.stderr[-3000:]
