"""A plain-torch reference of the bitsandbytes 4-bit format, and known-bad variants of it.

The reference is the format written out (see ``kernel.py``); the known-bad variants each carry one
classic mistake. The tests run them through the same bit-exact check as the kernel and require
that the check rejects every one: proof that the check can fail.
"""

import functools
import math

import torch


def dequantize_reference(packed, quant_state, *, swap_nibbles=False, drop_offset=False, absmax2_shift=0,
                         keep_subnormals=False):
    """Dequantize on the CPU in fp32 as bitsandbytes' CUDA kernels do: one rounding per operation,
    subnormals flushed in the multiplies (not in the offset's add), then one cast."""
    qs = quant_state
    n = math.prod(qs.shape)
    data = packed.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    high, low = (data >> 4).long(), (data & 0xF).long()
    if swap_nibbles:
        high, low = low, high
    nibbles = torch.stack([high, low], dim=1).reshape(-1)[:n]
    n_blocks = -(-n // qs.blocksize)
    if qs.nested:
        absmax2_index = torch.arange(n_blocks) // qs.state2.blocksize + absmax2_shift
        absmax2_index = absmax2_index.clamp(0, qs.state2.absmax.numel() - 1)
        mul = torch.mul if keep_subnormals else mul_ftz
        scale = mul(qs.state2.code.cpu()[qs.absmax.cpu().long()], qs.state2.absmax.cpu()[absmax2_index])
        if not drop_offset:
            scale = scale + torch.as_tensor(qs.offset, dtype=torch.float32).cpu()
    else:
        scale = qs.absmax.cpu().float()
    code = qs.code.cpu()[nibbles]
    if qs.quant_type == "fp4":
        code = fp4_signed(code, nibbles)
    values = (torch.mul if keep_subnormals else mul_ftz)(code, scale[torch.arange(n) // qs.blocksize])
    out = values.to(qs.dtype).reshape(qs.shape)
    if packed.shape[0] == 1 and out.dim() == 2:
        out = out.t()
    return out.to(packed.device)


def flush_subnormal(x):
    """fp32 subnormals to zero of the same sign."""
    bits = x.contiguous().view(torch.int32)
    return torch.where(bits & 0x7F800000 == 0, bits & -(2**31), bits).view(torch.float32)


def mul_ftz(a, b):
    """The fp32 multiply of bitsandbytes' CUDA kernels, built with --use_fast_math: subnormal
    inputs and result flushed to signed zero."""
    return flush_subnormal(flush_subnormal(a) * flush_subnormal(b))


def fp4_signed(values, nibbles):
    """bitsandbytes' CUDA kernel forms FP4 as sign * magnitude: code 8 is -0.0, the table's is +0.0."""
    return torch.where(nibbles >= 8, -values.abs(), values)


KNOWN_BAD = {
    "nibble order swapped": functools.partial(dequantize_reference, swap_nibbles=True),
    "offset dropped": functools.partial(dequantize_reference, drop_offset=True),
    "absmax2 index off by one": functools.partial(dequantize_reference, absmax2_shift=1),
}
# Rejected on weights whose scales reach subnormal range (tests/test_kernel.py); on ordinary
# weights it agrees with bitsandbytes.
KNOWN_BAD_SUBNORMAL = functools.partial(dequantize_reference, keep_subnormals=True)


def linear_reference(x, weight, bias=None):
    """``x @ weight.T + bias`` in fp64 on the CPU: the exact sum of the rounded operands."""
    y = x.detach().cpu().double() @ weight.detach().cpu().double().T
    return y if bias is None else y + bias.detach().cpu().double()


def linear_error_bound(y, x, weight, bias=None):
    """What an fp32 accumulation and one rounding of the result to y's dtype may differ from
    ``linear_reference`` by, elementwise: one unit in the last place of y (the rounding, with room
    for a sum that lands on a binade edge) plus K * 2**-24 of the sum of absolute products."""
    magnitude = y.detach().cpu().abs()
    ulp = (torch.nextafter(magnitude, torch.full_like(magnitude, math.inf)) - magnitude).double()
    absolute = x.detach().cpu().double().abs() @ weight.detach().cpu().double().abs().T
    if bias is not None:
        absolute = absolute + bias.detach().cpu().double().abs()
    return ulp + x.shape[-1] * 2.0**-24 * absolute
