"""The weights the benchmarks time: their shapes and dtypes, each quantized by bitsandbytes, the
bytes a dequantization of one moves, and a module holding one as bitsandbytes' Params4bit."""

import torch

SHAPES = [(4096, 1024), (1024, 4096), (8192, 2048), (2048, 8192), (14336, 4096), (4096, 14336), (28672, 8192)]
QUICK_SHAPES = [(4096, 1024), (8192, 2048), (14336, 4096), (28672, 8192)]
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def make_weight(shape, dtype, seed=0):
    """(packed, quant state) of a random weight on the GPU: NF4, blocksize 64, double-quantized absmax,
    dequantizing to ``dtype``."""
    import bitsandbytes.functional as F

    torch.manual_seed(seed)
    weight = torch.randn(shape, device="cuda", dtype=torch.float16)
    packed, state = F.quantize_4bit(weight, blocksize=64, compress_statistics=True, quant_type="nf4")
    state.dtype = dtype
    return packed, state


def weights(shapes, dtypes):
    """(dtype name, shape, packed, state) for every benchmarked weight, made one at a time."""
    for dtype_name, dtype in dtypes.items():
        for shape in shapes:
            yield (dtype_name, shape, *make_weight(shape, dtype))


def bytes_moved(shape, dtype):
    """Bytes one dequantization reads and writes: n/2 packed + n/64 absmax + the output."""
    n = shape[0] * shape[1]
    return n // 2 + n // 64 + n * torch.finfo(dtype).bits // 8


def params4bit_module(packed, state):
    """A module whose weight is ``packed`` as a bitsandbytes Params4bit, as Linear4bit holds it after
    its move to CUDA (built directly, so that it exists on the CPU too): what PEFT's
    dequantize_module_weight and the challenge's entry point take."""
    import bitsandbytes as bnb

    module = torch.nn.Module()
    module.weight = bnb.nn.Params4bit(packed, requires_grad=False, quant_state=state, blocksize=state.blocksize,
                                      compress_statistics=state.nested, quant_type=state.quant_type,
                                      quant_storage=packed.dtype, bnb_quantized=True)
    return module


def quiet_bitsandbytes_cpu_notice():
    """bitsandbytes warns at import, on CPUs with AVX512-BF16, that its optional CPU matmul
    package ("kernels") is missing. Nothing here uses it: the warning is silenced."""
    import logging

    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
