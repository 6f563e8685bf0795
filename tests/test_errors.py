"""Bad input raises a clear ValueError/TypeError naming what is wrong, before any launch."""

import copy

import pytest
import torch

import kernel
from helpers import quantize


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


@pytest.mark.parametrize("blocksize", [0, 1, 48, 96, 64.0])
def test_bad_blocksize(weight, blocksize):
    packed, state = weight
    with pytest.raises(ValueError, match="blocksize must be a power of two"):
        kernel.dequantize_nf4(packed, altered(state, blocksize=blocksize))


def test_packed_too_small(weight):
    packed, state = weight
    with pytest.raises(ValueError, match="packed weight has 255 bytes, shape \\(8, 64\\) needs 256"):
        kernel.dequantize_nf4(packed[:-1], state)


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
    assert kernel._launch_override is None


def test_shared_tables_refused_where_triton_cannot_compile_them():
    if kernel.TRITON_COMPILES_SHARED_TABLES:
        pytest.skip("this Triton compiles the shared-memory lookup")
    with pytest.raises(ValueError, match="cannot compile the shared-memory codebook lookup"):
        kernel.set_launch_config(1024, 4, True)
    assert kernel._launch_override is None
