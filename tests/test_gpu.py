"""GPU-only checks: every kernel variant, more than 2**31 elements, and the challenge's own check."""

import math

import pytest
import torch

import bench.contenders
import bench.harness
from helpers import assert_bit_exact, bnb_dequantize, launch_config_of, quantize
from nf4_triton import fastpath, kernel

pytestmark = pytest.mark.gpu

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


# BF16_VIA_INT changes only the bf16 store: fp16 and fp32 run the native cast alone.
ROUNDINGS = [(dtype, via_int) for dtype in DTYPES for via_int in ((False, True) if dtype == torch.bfloat16 else (False,))]


@pytest.mark.parametrize("byte_loads", [False, True], ids=["auto-loads", "byte-loads"])
@pytest.mark.parametrize("use_asm", [True, False], ids=["asm", "pure-triton"])
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("nested", [True, False], ids=["nested", "flat"])
@pytest.mark.parametrize("dtype,bf16_via_int", ROUNDINGS, ids=lambda v: {True: "int-rne", False: "native-cvt"}.get(v, str(v)))
@pytest.mark.parametrize("shape", [(3, 100), (17, 129), (1024, 4096 + 64)], ids=str)
def test_every_variant(shape, dtype, bf16_via_int, nested, quant_type, use_asm, byte_loads):
    """The inline-PTX and pure-Triton paths, both bf16 roundings and both load widths (the wrapper
    picks words for the last shape, bytes for the odd ones) give bitsandbytes' bits."""
    packed, state = quantize(shape, dtype=dtype, nested=nested, quant_type=quant_type, device="cuda",
                             seed=shape[0])
    overrides = dict(WORD_LOADS=False) if byte_loads else {}
    got = kernel.validate_and_dequantize(packed, state, USE_ASM=use_asm, BF16_VIA_INT=bf16_via_int, **overrides)
    assert_bit_exact(got, bnb_dequantize(packed, state))


# (bytes per program, warps): the small-weight tile, the H100's shared-codebook tiles, and the H200's from 17 and 33 MiB.
SHARED_TILES = [(1024, 4), (2048, 2), (512, 4), (512, 2), (1024, 2)]
# (shape, byte loads forced): odd (read byte by byte), even (int32 words), even read byte by byte.
LAYOUTS = [((17, 129), False), ((1024, 4096 + 64), False), ((1024, 4096 + 64), True)]


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("nested", [True, False], ids=["nested", "flat"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,byte_loads", LAYOUTS, ids=lambda v: {True: "byte-loads", False: "auto-loads"}.get(v, str(v)))
@pytest.mark.parametrize("tile", SHARED_TILES, ids=lambda tile: f"{tile[0]}-{tile[1]}")
def test_shared_tables(tile, shape, byte_loads, dtype, nested, quant_type):
    """The codebooks looked up in shared memory (sm_90's choice from 2.25 to 17 MiB and from 48 MiB of packed
    weight, the H200's from 17 MiB) give bitsandbytes' bits with every tile, layout, dtype and format."""
    if not kernel.TRITON_COMPILES_SHARED_TABLES:
        pytest.skip("this Triton cannot compile the shared-memory lookup")
    packed, state = quantize(shape, dtype=dtype, nested=nested, quant_type=quant_type, device="cuda", seed=tile[0])
    overrides = dict(WORD_LOADS=False) if byte_loads else {}
    got = kernel.validate_and_dequantize(packed, state, SHARED_TABLES=True, BYTES_PER_PROGRAM=tile[0], num_warps=tile[1],
                             **overrides)
    assert_bit_exact(got, bnb_dequantize(packed, state))


SM90_TIERS = kernel.LAUNCH_CONFIGS[(9, 0)] + kernel.FAST_DRAM_LAUNCH_CONFIGS[(9, 0)]


@pytest.mark.parametrize("smallest", sorted({tier.smallest_bytes for tier in SM90_TIERS} - {0}))
def test_every_tier_on_the_gpu(smallest):
    """A weight at the smallest size of each of this GPU's tiers (the H100's, or the H200's where its DRAM is
    as fast) takes that tier's configuration (through its plan too) and stays bit-exact."""
    capability, _, dram_gbps = fastpath.device_facts()
    if capability != (9, 0):
        pytest.skip("the tiers are measured for sm_90")
    assert dram_gbps > 0  # torch reports the memory clock and bus: 4814 GB/s on the H200
    if "H200" in torch.cuda.get_device_name():
        assert dram_gbps >= fastpath.FAST_DRAM_GBPS
    config = kernel.launch_config(capability, smallest, dram_gbps)
    packed, state = quantize((2 * smallest // 4096, 4096), dtype=torch.bfloat16, device="cuda", seed=smallest % 997)
    launch = kernel.choose_launch(packed, torch.bfloat16, 2 * smallest, blocksize=64, blocksize2=256, nested=True,
                                  fp4=False)
    assert launch_config_of(launch) == config
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


@pytest.mark.long
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
    del part_packed, part_state
    # The plan's path too: the validating call, then the plan's (same bits as through out=).
    for _ in range(2):
        assert torch.equal(kernel.dequantize_nf4(packed, state).view(torch.int16), got.view(torch.int16))
    assert kernel.PLANS.get(id(state)) is not None


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
@pytest.mark.parametrize("option", bench.harness.HARNESS_OPTIONS, ids=lambda o: f"{o[2]}x{o[3]}-{o[5]}")
def test_challenge_check(option):
    """The challenge's own warm-up check (bench.harness.challenge_check), with Unsloth's equality when installed."""
    pytest.importorskip("transformers")
    largest = bench.harness.challenge_check(kernel.your_dequantize_nf4, option, bench.contenders.unsloth_fast_dequantize())
    assert math.isfinite(largest)
