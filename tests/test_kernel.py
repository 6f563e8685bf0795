"""Bit-exactness with bitsandbytes: on the GPU when there is one, else through the interpreter.

Small, odd shapes; the benchmark shapes live in the benchmark. Every case also checks that the
packed weight and the quant state are left untouched.
"""

import types

import pytest
import torch
import triton

import bench.weights
from helpers import (
    assert_bit_exact,
    assert_unchanged,
    bit_exact,
    bnb_dequantize,
    expected_values,
    launch_config_of,
    offset_copy,
    quantize,
    snapshot,
    with_subnormal_scales,
)
from nf4_triton import fastpath, kernel
from reference import KNOWN_BAD, KNOWN_BAD_SUBNORMAL, dequantize_reference

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
SHAPES = [(1, 64), (3, 100), (17, 129), (64, 4096), (7,), (2, 3, 40)]


def check(packed, state):
    """The check every implementation must pass: bit-exact with bitsandbytes and the reference."""
    before = snapshot(packed, state)
    got = kernel.dequantize_nf4(packed, state)
    assert_unchanged(packed, state, before)
    assert_bit_exact(got, bnb_dequantize(packed, state))
    assert_bit_exact(got, dequantize_reference(packed, state))
    return got


@pytest.mark.parametrize("nested", [True, False], ids=["nested", "flat"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_shapes(shape, dtype, nested, device):
    packed, state = quantize(shape, dtype=dtype, nested=nested, device=device, seed=len(shape) + shape[0])
    check(packed, state)


# (33, 257): an odd byte count, read byte by byte; (32, 256): read as int32 words.
LOAD_SHAPES = [(33, 257), (32, 256)]


@pytest.mark.parametrize("nested", [True, False], ids=["nested", "flat"])
@pytest.mark.parametrize("blocksize", [32, 64, 128, 256, 512, 1024, 2048, 4096])
@pytest.mark.parametrize("shape", LOAD_SHAPES, ids=str)
def test_blocksizes(shape, blocksize, nested, device):
    packed, state = quantize(shape, blocksize=blocksize, nested=nested, device=device, seed=blocksize)
    check(packed, state)


@pytest.mark.parametrize("nested", [True, False], ids=["nested", "flat"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", LOAD_SHAPES, ids=str)
def test_fp4(shape, dtype, nested, device):
    packed, state = quantize(shape, dtype=dtype, nested=nested, quant_type="fp4", device=device, seed=4)
    check(packed, state)


@pytest.mark.parametrize("start", [0, 1, 2, 3, 4])
def test_packed_alignment(start, device):
    """Word loads only where the packed bytes start on a 4-byte boundary; bytes elsewhere."""
    packed, state = quantize((32, 256), device=device, seed=13)
    view = offset_copy(packed, start)
    assert kernel.word_aligned(view) == (start % 4 == 0)
    check(view, state)


def test_byte_loads_forced(device):
    """The byte-load path on a weight the word path would take gives the same bits."""
    packed, state = quantize((64, 4096), dtype=torch.bfloat16, device=device, seed=14)
    expected = bnb_dequantize(packed, state)
    assert_bit_exact(kernel.validate_and_dequantize(packed, state, WORD_LOADS=False), expected)
    assert_bit_exact(kernel.validate_and_dequantize(packed, state, WORD_LOADS=True), expected)


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("nested", [True, False], ids=["nested", "flat"])
@pytest.mark.parametrize("word_loads", [True, False], ids=["words", "bytes"])
def test_shared_tables_forced(word_loads, nested, quant_type, device):
    """The codebooks looked up in shared memory (tl.gather) give the same bits as the global gathers,
    with either load width, nested or not, NF4 or FP4."""
    if device == "cuda" and not kernel.TRITON_COMPILES_SHARED_TABLES:
        pytest.skip(f"Triton {triton.__version__} cannot compile the shared-memory lookup")
    packed, state = quantize((16, 4096 + 64), dtype=torch.float16, nested=nested, quant_type=quant_type,
                             device=device, seed=15)
    expected = bnb_dequantize(packed, state)
    assert_bit_exact(kernel.validate_and_dequantize(packed, state, SHARED_TABLES=True, WORD_LOADS=word_loads), expected)
    assert_bit_exact(kernel.validate_and_dequantize(packed, state, SHARED_TABLES=False, WORD_LOADS=word_loads), expected)


def test_kernel_args_are_the_kernels_arguments():
    """KernelArgs names the kernel's runtime arguments in its order; every later argument is a constexpr."""
    names = kernel.dequantize_4bit_kernel.arg_names
    fields = kernel.KernelArgs._fields
    assert tuple(names[:len(fields)]) == fields
    variant = kernel.kernel_variant(torch.float16, nested=True, capability=(9, 0), l2_bytes=50 << 20)
    assert set(names[len(fields):]) == set(variant)


def test_shared_tables_by_weight_size():
    """The shared-memory lookup follows the H100's size tiers (never where Triton cannot compile it,
    nor on GPUs whose table has no such tier)."""
    variant = lambda n_bytes, capability: kernel.kernel_variant(torch.float16, nested=True, n_elements=2 * n_bytes,
                                                                capability=capability, l2_bytes=50 << 20)
    for tier in kernel.LAUNCH_CONFIGS[(9, 0)]:
        if tier.config.shared_tables:
            assert variant(tier.smallest_bytes, (9, 0))["SHARED_TABLES"] == kernel.TRITON_COMPILES_SHARED_TABLES
    assert not variant(1 << 20, (9, 0))["SHARED_TABLES"]
    assert not any(variant(n, cc)["SHARED_TABLES"] for n in (1 << 20, 8 << 20, 1 << 30) for cc in ((8, 9), (7, 5)))


@pytest.mark.parametrize("storage", [torch.uint8, torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_quant_storage(storage, device):
    packed, state = quantize((16, 96), dtype=torch.bfloat16, storage=storage, device=device, seed=5)
    assert packed.dtype == storage
    check(packed, state)


def test_many_absmax2_blocks(device):
    # 300 x 220 elements: 1032 absmax blocks, so five absmax2 values.
    packed, state = quantize((300, 220), device=device, seed=6)
    check(packed, state)


def test_transposed_packed(device):
    packed, state = quantize((4, 6), device=device, seed=7)
    flat = packed.reshape(1, -1)  # Unsloth's shape[0] == 1 layout: the result comes back transposed
    got = kernel.dequantize_nf4(flat, state)
    assert got.shape == (6, 4) and not got.is_contiguous()
    assert_bit_exact(got, bnb_dequantize(flat, state))


def test_out_buffer(device):
    packed, state = quantize((17, 129), dtype=torch.bfloat16, device=device, seed=8)
    out = torch.full(tuple(state.shape), float("nan"), dtype=state.dtype, device=device)
    got = kernel.dequantize_nf4(packed, state, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert_bit_exact(out, bnb_dequantize(packed, state))


def test_every_element_written(device):
    packed, state = quantize((3, 101), dtype=torch.float16, device=device, seed=9)
    out = torch.full(tuple(state.shape), float("nan"), dtype=state.dtype, device=device)
    kernel.dequantize_nf4(packed, state, out=out)
    assert not out.isnan().any()


def test_empty(device):
    packed, state = quantize((0, 64), device=device)
    assert kernel.dequantize_nf4(packed, state).shape == (0, 64)


def test_module_and_params(device):
    bnb = pytest.importorskip("bitsandbytes")
    if device == "cpu":
        pytest.skip("Linear4bit quantizes when moved to CUDA")
    layer = bnb.nn.Linear4bit(128, 96, bias=None, compute_dtype=torch.float16, compress_statistics=True,
                              quant_type="nf4").to(device)
    layer.weight.quant_state.dtype = torch.float16
    expected = bnb_dequantize(layer.weight.data, layer.weight.quant_state)
    for got in (kernel.dequantize_nf4(layer), kernel.dequantize_nf4(layer.weight),
                kernel.your_dequantize_nf4(layer),
                kernel.dequantize_nf4(layer.weight.data, layer.weight.quant_state)):
        assert_bit_exact(got, expected)


def test_entry_point_on_params4bit(device):
    """your_dequantize_nf4 reads the Params4bit's data with its __torch_function__ switched off: the
    same tensor and the same bits as the challenge's own `layer.weight.data` call, nothing changed."""
    packed, state = quantize((96, 128), device=device, seed=4)
    layer = bench.weights.params4bit_module(packed, state)
    before = snapshot(packed, state)
    assert_bit_exact(kernel.your_dequantize_nf4(layer), expected_values(packed, state))
    assert_bit_exact(kernel.your_dequantize_nf4(layer),
                     kernel.dequantize_nf4(layer.weight.data, layer.weight.quant_state))
    assert_unchanged(packed, state, before)
    assert torch._C._is_torch_function_enabled()


@pytest.mark.parametrize("name", sorted(KNOWN_BAD))
def test_known_bad_is_rejected(name, device):
    """Each known-bad variant must fail the same bit-exact check the kernel passes."""
    packed, state = quantize((300, 220), device=device, seed=10)
    expected = bnb_dequantize(packed, state)
    assert bit_exact(dequantize_reference(packed, state), expected)
    assert not bit_exact(KNOWN_BAD[name](packed, state), expected)


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("nested", [True, False], ids=["nested", "flat"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_subnormal_scales(dtype, nested, quant_type, device):
    """Scales in and near the subnormal range: bitsandbytes' fast-math CUDA kernels flush them, so
    zeros keep the signs that flushing gives (a zero block of a real weight lands here)."""
    packed, state = quantize((48, 256), dtype=dtype, nested=nested, quant_type=quant_type, device=device, seed=12)
    state = with_subnormal_scales(state)
    expected = expected_values(packed, state)
    assert_bit_exact(kernel.dequantize_nf4(packed, state), expected)
    assert_bit_exact(dequantize_reference(packed, state), expected)
    if nested or dtype != torch.float16:
        # (flat fp16 cannot tell: every subnormal fp32 product rounds to an fp16 zero of its sign)
        assert not bit_exact(KNOWN_BAD_SUBNORMAL(packed, state), expected)


@pytest.mark.parametrize("config", [(64, 1, False), (512, 2, False), (4096, 8, False), (1024, 4, True)])
def test_launch_config_override(config, device):
    if config[2] and not kernel.TRITON_COMPILES_SHARED_TABLES:
        pytest.skip(f"Triton {triton.__version__} cannot compile the shared-memory lookup")
    packed, state = quantize((33, 257), dtype=torch.bfloat16, device=device, seed=11)
    try:
        kernel.set_launch_config(*config)
        assert kernel.launch_config((9, 0), 1 << 30) == config
        check(packed, state)
    finally:
        kernel.set_launch_config()
    assert kernel.launch_config((9, 0)) == (1024, 4, False)


def test_launch_config_tiers():
    """The H100's tiers by packed size (a shared-memory tier falls back to the one before it where
    Triton cannot compile the lookup); other GPUs take their one configuration."""
    shared = kernel.TRITON_COMPILES_SHARED_TABLES
    mib = 1 << 20
    expected = {
        2 * mib: (1024, 4, False),
        9 * mib // 4: (2048, 4, shared),
        17 * mib // 4 - 1: (2048, 4, shared),
        17 * mib // 4: (2048, 2, True) if shared else (2048, 4, False),
        17 * mib - 1: (2048, 2, True) if shared else (2048, 4, False),
        17 * mib: (2048, 4, False),
        48 * mib - 1: (2048, 4, False),
        48 * mib: (512, 4, True) if shared else (2048, 4, False),
    }
    assert {n: kernel.launch_config((9, 0), n) for n in expected} == expected
    assert kernel.launch_config((9, 0), 9 * mib // 4 - 1) == (1024, 4, False)
    assert kernel.launch_config((8, 9), 1 << 30) == (1024, 4, False)
    assert kernel.launch_config((12, 0), 1 << 30) == (1024, 4, False)


def test_fast_dram_tiers(monkeypatch):
    """sm_90 with a DRAM peak of FAST_DRAM_GBPS or more (the H200) takes 1024 bytes over 2 warps from 17 MiB, 512
    over 2 from 33 MiB and the H100's tiers below 17; a slower sm_90 (the H100), an unknown peak and other GPUs keep
    their own table; a launch reads the device's peak."""
    h200, h100 = 4814, 3352
    assert kernel.launch_tiers((9, 0), h200) is kernel.FAST_DRAM_LAUNCH_CONFIGS[(9, 0)]
    assert kernel.launch_tiers((9, 0), fastpath.FAST_DRAM_GBPS) is kernel.FAST_DRAM_LAUNCH_CONFIGS[(9, 0)]
    assert kernel.launch_tiers((9, 0), fastpath.FAST_DRAM_GBPS - 1) is kernel.LAUNCH_CONFIGS[(9, 0)]
    assert kernel.launch_tiers((9, 0), h100) is kernel.launch_tiers((9, 0)) is kernel.LAUNCH_CONFIGS[(9, 0)]
    assert kernel.launch_tiers((8, 9), h200) is kernel.LAUNCH_CONFIGS[(8, 9)]
    assert kernel.launch_tiers((10, 0), h200) is kernel.DEFAULT_LAUNCH_TIERS
    shared = kernel.TRITON_COMPILES_SHARED_TABLES
    mid_global = kernel.LaunchConfig(2048, 4, False)
    expected = {  # packed bytes -> (the H200's config, the H100's)
        17 * kernel.MiB - 1: (mid_global if not shared else (2048, 2, True),) * 2,
        17 * kernel.MiB: ((1024, 2, True) if shared else mid_global, mid_global),
        33 * kernel.MiB - 1: ((1024, 2, True) if shared else mid_global, mid_global),
        33 * kernel.MiB: ((512, 2, True) if shared else mid_global, mid_global),
        48 * kernel.MiB: ((512, 2, True) if shared else mid_global, (512, 4, True) if shared else mid_global),
    }
    for n_bytes, (fast, slow) in expected.items():
        assert (kernel.launch_config((9, 0), n_bytes, h200), kernel.launch_config((9, 0), n_bytes, h100)) == (fast, slow)
    for n_bytes in (0, 1 << 20, 8 << 20, 16 << 20):
        assert kernel.launch_config((9, 0), n_bytes, h200) == kernel.launch_config((9, 0), n_bytes, h100)
    largest = 48 * kernel.MiB
    packed = torch.empty(largest, dtype=torch.uint8)  # never read: the launch is chosen, not made
    for peak in (h200, h100):
        monkeypatch.setattr(kernel, "device_facts", lambda device, peak=peak: ((9, 0), 60 << 20, peak))
        launch = kernel.choose_launch(packed, torch.float16, 2 * largest, blocksize=64, blocksize2=256, nested=True,
                                      fp4=False)
        assert launch_config_of(launch) == kernel.launch_config((9, 0), largest, peak)


def test_peak_dram_gbps():
    """Two transfers a memory clock over the bus: the H200's reported clock and bus give its 4.8 TB/s, the H100
    SXM's datasheet figures (HBM3 at 2619 MHz, 5120 bits) its 3.35."""
    assert fastpath.peak_dram_gbps(types.SimpleNamespace(memory_clock_rate=3_201_000, memory_bus_width=6016)) == 4814
    assert fastpath.peak_dram_gbps(types.SimpleNamespace(memory_clock_rate=2_619_000, memory_bus_width=5120)) == 3352
    assert fastpath.peak_dram_gbps(types.SimpleNamespace()) == 0  # a torch that does not report them
