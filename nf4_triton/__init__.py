"""nf4-triton: bitsandbytes NF4 weights dequantized, and multiplied, by fused Triton kernels.

    from nf4_triton import dequantize_nf4, nf4_linear, dropin
    W = dequantize_nf4(layer)              # a Linear4bit, its Params4bit, or (packed, quant_state)
    y = nf4_linear(x, layer)               # x @ W.T without writing W
    dropin.enable(model)                   # every Linear4bit of a model through these kernels

Modules, from the bottom up: ``fastpath`` (launching and replaying Triton kernels), ``quantstate`` (a weight and
its state found and validated), ``kernel`` (the dequantization), ``routes`` (which kernel computes which call),
the matmul's kernels and their launch, ``matmul`` (its entry points), ``dropin`` (models).
"""

from nf4_triton import dropin
from nf4_triton.kernel import dequantize_nf4
from nf4_triton.matmul import nf4_linear, nf4_linear_group

__all__ = ["dequantize_nf4", "nf4_linear", "nf4_linear_group", "dropin"]
