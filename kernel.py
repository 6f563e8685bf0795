"""The challenge's file: the fused NF4 dequantization kernel under the name the challenge gives it. The module is
``nf4_triton/kernel.py``; ``import kernel`` from a checkout, or beside a notebook that wrote the package out, is that
module itself (the same object, so ``kernel.dequantize_nf4`` and ``nf4_triton.kernel.dequantize_nf4`` are one)."""

import sys

from nf4_triton import kernel

sys.modules[__name__] = kernel
