"""A fused NF4 matmul: ``y = x @ dequantize_nf4(W).T (+ bias)`` straight from bitsandbytes' bytes.

Each program decodes a ``BLOCK_N x BLOCK_K`` tile of the weight in registers with the
dequantization's own exact arithmetic (``kernel.py``: fp32 ``code * scale`` without FMA, one cast
to the activations' dtype) and multiplies it with the matching tile of ``x``: no 16-bit weight is
ever written. The only difference from dequantize + ``F.linear`` is the order of the fp32 sums.

Two shapes of program, both over bitsandbytes' layout as it is (no repack):
- ``DOT``: the weight tile is the left operand of ``tl.dot`` (tensor cores) against ``x``'s tile
  transposed, so a few rows of ``x`` only pad the narrow side of the product;
- FMA: one row of ``x`` per program, each decoded weight multiplied into fp32 accumulators that
  are reduced along K at the end.
- MMA (``mma.py``, Gluon): the weight decoded straight into ``mma.sync``'s register fragments (on
  sm_90 from 32 rows, ``wgmma``'s register operand), the code values by warp shuffle, only x's tile
  through shared memory. The fastest wherever Gluon runs (Triton 3.6 on, sm_80 on, fp16 and bf16),
  on the H100 from 1 to 256 rows; the two ``tl`` shapes serve the rest.
Where N alone does not fill the GPU, ``SPLIT_K`` programs share a row of outputs: each writes its
fp32 partial sums and a second small kernel adds them in a fixed order (deterministic), adds the
bias and casts; or (``fold``, mma.py) the last program of a tile to store, counted by an atomic,
adds them itself in the same order.
"""

import copy
import threading
import typing

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from nf4_triton import fastpath, kernel, mma_layouts, quantstate
from nf4_triton.fastpath import INTERPRET, device_facts, jit, sum_combine
from nf4_triton.kernel import TL_DTYPE, add_rn, decode, fp32_to_bf16_rne, lookup, mul_ftz

if mma_layouts.AVAILABLE:  # Gluon's kernels (Triton 3.6 on)
    from nf4_triton import mma_sync, wgmma

__all__ = ["nf4_linear", "nf4_linear_group", "group_plan", "GroupPlan", "GROUP_MAX_ROWS", "linear_group", "linear_by_route",
           "linear_unchecked", "check_call", "route_taken", "decoded_weight", "choose_route", "device_route", "Route",
           "MatmulConfig", "MATMUL_ROUTES", "FAST_DRAM_ROUTES", "TL_ROUTES", "routes_for", "mma_runs_on",
           "mma_supported", "mma_kernel", "LAUNCHES", "nf4_matmul_kernel", "split_k_reduce_kernel"]


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------
@jit
def _block_scales(absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, block, mask, BLOCKSIZE2: tl.constexpr,
                  NESTED: tl.constexpr, TABLE_HINT: tl.constexpr, USE_ASM: tl.constexpr, SHARED_TABLES: tl.constexpr):
    """fp32 scale of each quantization block index in ``block`` (the absmax decode of kernel.py);
    ``mask`` None: every index is inside the weight."""
    if NESTED:
        if mask is None:
            absmax_q = tl.load(absmax_ptr + block, eviction_policy=TABLE_HINT)
            absmax2 = tl.load(absmax2_ptr + block // BLOCKSIZE2, eviction_policy=TABLE_HINT)
        else:
            absmax_q = tl.load(absmax_ptr + block, mask=mask, other=0, eviction_policy=TABLE_HINT)
            absmax2 = tl.load(absmax2_ptr + block // BLOCKSIZE2, mask=mask, other=0, eviction_policy=TABLE_HINT)
        absmax_code = lookup(code2_ptr, absmax_q.to(tl.int32), 256, TABLE_HINT, SHARED_TABLES)
        return add_rn(mul_ftz(absmax_code, absmax2, USE_ASM), tl.load(offset_ptr), USE_ASM)
    elif mask is None:
        return tl.load(absmax_ptr + block, eviction_policy=TABLE_HINT)
    else:
        return tl.load(absmax_ptr + block, mask=mask, other=0.0, eviction_policy=TABLE_HINT)


@jit
def _codebook(code_ptr, FP4: tl.constexpr):
    """The 16 code values in fp32; FP4's codes 8 to 15 carry the sign bit as bitsandbytes forms
    them (sign * magnitude, so code 8 is -0.0)."""
    index = tl.arange(0, 16)
    values = tl.load(code_ptr + index)
    if FP4:
        values = (values.to(tl.uint32, bitcast=True) | ((index >> 3).to(tl.uint32) << 31)).to(tl.float32, bitcast=True)
    return values


@jit
def _pair_codebook(codebook):
    """256 entries, one per packed byte: the two code values it holds as one uint64, the high
    nibble's value (the even element) in the low half. One 8-byte lookup decodes two elements."""
    byte = tl.arange(0, 256)
    first = tl.gather(codebook, byte >> 4, 0).to(tl.uint32, bitcast=True).to(tl.uint64)
    second = tl.gather(codebook, byte & 0xF, 0).to(tl.uint32, bitcast=True).to(tl.uint64)
    return first | (second << 32)


@jit
def _weight_tile(packed_ptr, absmax_ptr, code_ptr, absmax2_ptr, code2_ptr, offset_ptr, codebook, pairs, n, k0, N, K,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCKSIZE: tl.constexpr, BLOCKSIZE2: tl.constexpr,
                 NESTED: tl.constexpr, FP4: tl.constexpr, W_DTYPE: tl.constexpr, USE_ASM: tl.constexpr,
                 BF16_VIA_INT: tl.constexpr, LOOKUP: tl.constexpr, EVEN: tl.constexpr, USE_INT64: tl.constexpr):
    """Rows ``n`` (BLOCK_N), columns ``k0 .. k0 + BLOCK_K`` of the weight as W_DTYPE, shaped
    [BLOCK_N, SCALES, WORDS_PER_SCALE, 8]: SCALES quantization blocks per row, each read as int32
    words of 8 codes in column order (K and BLOCKSIZE are multiples of 8).

    The values are those of kernel.py's decode, ``W_DTYPE(fp32(code * scale))``, the code value
    found by one of three lookups (LOOKUP): 0, per element in the global codebook (kernel.py's
    ``decode``); 1, per block a table of the 16 possible products (16 multiplies and casts per
    block, then one shared-memory load per element); 2, per byte in a shared table of code pairs
    (one 8-byte load per two elements). EVEN: the tile lies inside the weight (no masks)."""
    TABLE_HINT: tl.constexpr = "evict_last"
    SCALE_SPAN: tl.constexpr = BLOCKSIZE if BLOCKSIZE < BLOCK_K else BLOCK_K  # columns of a block in the tile
    SCALES: tl.constexpr = BLOCK_K // SCALE_SPAN
    WORDS_PER_SCALE: tl.constexpr = SCALE_SPAN // 8
    row = n.to(tl.int64) if USE_INT64 else n
    row_mask = n < N
    block_in_tile = tl.arange(0, SCALES)

    block = row[:, None] * (K // BLOCKSIZE) + (k0 // BLOCKSIZE + block_in_tile)[None, :]  # [BLOCK_N, SCALES]
    block_mask = row_mask[:, None] & ((k0 + block_in_tile * SCALE_SPAN)[None, :] < K)
    if EVEN:
        block_mask = None
    scales = _block_scales(absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, block, block_mask, BLOCKSIZE2, NESTED,
                           TABLE_HINT, USE_ASM, LOOKUP == 1)

    word = (k0 // 8 + block_in_tile[:, None] * WORDS_PER_SCALE + tl.arange(0, WORDS_PER_SCALE)[None, :])  # [SCALES, W]
    word_ptrs = packed_ptr.to(tl.pointer_type(tl.int32)) + row[:, None, None] * (K // 8) + word[None, :, :]
    if EVEN:
        words = tl.load(word_ptrs)
    else:
        words = tl.load(word_ptrs, mask=row_mask[:, None, None] & (word < K // 8)[None, :, :], other=0)
    if LOOKUP == 2:
        byte = (words[:, :, :, None] >> (8 * tl.arange(0, 4))[None, None, None, :]) & 0xFF  # [BLOCK_N, SCALES, W, 4]
        pair = tl.reshape(tl.gather(pairs, tl.reshape(byte, (byte.numel,)), 0), byte.shape)
        scale = scales[:, :, None, None]
        first = mul_ftz(pair.to(tl.uint32).to(tl.float32, bitcast=True), scale, USE_ASM)
        second = mul_ftz((pair >> 32).to(tl.uint32).to(tl.float32, bitcast=True), scale, USE_ASM)
        weights = _round(tl.reshape(tl.join(first, second), (BLOCK_N, SCALES, WORDS_PER_SCALE, 8)), W_DTYPE,
                         BF16_VIA_INT)
    else:
        element = tl.arange(0, 8)
        shifts = 8 * (element // 2) + 4 * (1 - element % 2)  # element 2j is byte j's high nibble
        codes = (words[:, :, :, None] >> shifts[None, None, None, :]) & 0xF  # [BLOCK_N, SCALES, W, 8]
        if LOOKUP == 1:
            products = _round(mul_ftz(codebook[None, None, :], scales[:, :, None], USE_ASM), W_DTYPE, BF16_VIA_INT)
            table_row = (tl.arange(0, BLOCK_N)[:, None] * SCALES + block_in_tile[None, :]) * 16  # [BLOCK_N, SCALES, 16]
            index = table_row[:, :, None, None] + codes
            weights = tl.reshape(tl.gather(tl.reshape(products, (BLOCK_N * SCALES * 16,)),
                                           tl.reshape(index, (index.numel,)), 0),
                                 (BLOCK_N, SCALES, WORDS_PER_SCALE, 8))
        else:
            weights = _round(decode(codes, tl.broadcast_to(scales[:, :, None, None], codes.shape), code_ptr,
                                     TABLE_HINT, FP4, USE_ASM, False), W_DTYPE, BF16_VIA_INT)
    return weights


@jit
def _round(values, W_DTYPE: tl.constexpr, BF16_VIA_INT: tl.constexpr):
    """fp32 to W_DTYPE, nearest even (bf16 through integers where the hardware or the interpreter
    cannot)."""
    if W_DTYPE == tl.bfloat16 and BF16_VIA_INT:
        return fp32_to_bf16_rne(values)
    else:
        return values.to(W_DTYPE)


@jit
def nf4_matmul_kernel(
    # inputs
    x_ptr,  # [M, K] activations (row stride stride_xm, unit column stride)
    packed_ptr,  # uint8 [N * K / 2], the weight [N, K] row-major, two codes per byte, high nibble first
    absmax_ptr,  # uint8 [N * K / BLOCKSIZE] when NESTED, else fp32
    code_ptr,  # fp32 [16], the 4-bit codebook (NF4 or FP4)
    absmax2_ptr,  # fp32 [ceil(n_blocks / BLOCKSIZE2)] (NESTED only)
    code2_ptr,  # fp32 [256] (NESTED only)
    offset_ptr,  # fp32 [1] (NESTED only)
    bias_ptr,  # [N] in x's dtype (HAS_BIAS only)
    # output
    out_ptr,  # [M, N] in x's dtype; with SPLIT_K > 1, fp32 partial sums [SPLIT_K, M, N]
    # sizes
    M,  # rows of x
    N,  # output features (rows of the weight)
    K,  # input features, a multiple of BLOCKSIZE and of 8
    stride_xm,  # elements between rows of x
    # format
    BLOCKSIZE: tl.constexpr,  # elements per absmax (power of two >= 8)
    BLOCKSIZE2: tl.constexpr,  # absmax values per absmax2 (NESTED only)
    NESTED: tl.constexpr,  # double-quantized absmax
    FP4: tl.constexpr,  # quant_type="fp4"
    X_DTYPE: tl.constexpr,  # tl.float16, tl.bfloat16 or tl.float32: activations, decoded weight and output
    # implementation
    BLOCK_M: tl.constexpr,  # rows of x per program (>= 16 with DOT)
    BLOCK_N: tl.constexpr,  # weight rows per program
    BLOCK_K: tl.constexpr,  # columns per step (a multiple of 8)
    SPLIT_K: tl.constexpr,  # programs sharing one output tile along K (fp32 partials when > 1)
    STEPS_PER_SPLIT: tl.constexpr,  # BLOCK_K steps per program: ceil(K / BLOCK_K) / SPLIT_K (a constant: Triton
    #                                  3.3's interpreter cannot loop to a run-time bound)
    DOT: tl.constexpr,  # tensor-core tl.dot, else fp32 FMA
    HAS_BIAS: tl.constexpr,  # add bias (SPLIT_K == 1 only; the reduction adds it otherwise)
    USE_ASM: tl.constexpr,  # inline-PTX arithmetic (NVIDIA only)
    BF16_VIA_INT: tl.constexpr,  # round to bf16 with integer ops (sm_75, interpreter)
    LOOKUP: tl.constexpr,  # how a code's value is found: 0 global codebook, 1 per-block product tables, 2 byte pairs
    EVEN: tl.constexpr,  # N % BLOCK_N == 0 and K % BLOCK_K == 0: no masks on the weight
    USE_INT64: tl.constexpr,  # 64-bit offsets (the weight has more than 2**31 - 1 elements)
):
    SCALE_SPAN: tl.constexpr = BLOCKSIZE if BLOCKSIZE < BLOCK_K else BLOCK_K
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = m < M
    first = pid_k * STEPS_PER_SPLIT  # this program's share of K: whole BLOCK_K steps

    codebook = _codebook(code_ptr, FP4)
    pairs = _pair_codebook(codebook) if LOOKUP == 2 else codebook
    if DOT:
        acc = tl.full((BLOCK_N, BLOCK_M), 0.0, tl.float32)
    else:
        acc = tl.full((BLOCK_N, BLOCK_K // SCALE_SPAN, SCALE_SPAN // 8), 0.0, tl.float32)
    for step_in_split in range(0, STEPS_PER_SPLIT):
        k0 = (first + step_in_split) * BLOCK_K
        w = _weight_tile(packed_ptr, absmax_ptr, code_ptr, absmax2_ptr, code2_ptr, offset_ptr, codebook, pairs, n, k0,
                         N, K, BLOCK_N, BLOCK_K, BLOCKSIZE, BLOCKSIZE2, NESTED, FP4, X_DTYPE, USE_ASM, BF16_VIA_INT,
                         LOOKUP, EVEN, USE_INT64)
        if DOT:
            k = k0 + tl.arange(0, BLOCK_K)
            x_t = tl.load(x_ptr + m[None, :] * stride_xm + k[:, None], mask=m_mask[None, :] & (k[:, None] < K),
                          other=0.0)  # [BLOCK_K, BLOCK_M]
            w = tl.reshape(w, (BLOCK_N, BLOCK_K))
            if X_DTYPE == tl.float32:
                acc = tl.dot(w, x_t, acc, input_precision="ieee")
            else:
                acc = tl.dot(w, x_t, acc)
        else:  # one row of x (BLOCK_M == 1), shaped like the weight tile's row
            k = k0 + tl.reshape(tl.arange(0, BLOCK_K), (BLOCK_K // SCALE_SPAN, SCALE_SPAN // 8, 8))
            if EVEN:
                x = tl.load(x_ptr + pid_m * stride_xm + k)
            else:
                x = tl.load(x_ptr + pid_m * stride_xm + k, mask=k < K, other=0.0)
            # each thread holds a word's 8 codes: their sum needs no exchange between threads
            acc += tl.reduce(w.to(tl.float32) * x.to(tl.float32)[None, :, :, :], 3, sum_combine)
    if DOT:
        result = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    else:
        result = tl.reshape(tl.reduce(tl.reshape(acc, (BLOCK_N, BLOCK_K // 8)), 1, sum_combine), (1, BLOCK_N))

    out_mask = m_mask[:, None] & (n[None, :] < N)
    if SPLIT_K > 1:
        partial = out_ptr + pid_k.to(tl.int64) * M * N
        tl.store(partial + m[:, None] * N + n[None, :], result, mask=out_mask)
    else:
        if HAS_BIAS:
            result += tl.load(bias_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + m[:, None] * N + n[None, :], _round(result, X_DTYPE, BF16_VIA_INT), mask=out_mask)


@jit
def split_k_reduce_kernel(
    partial_ptr,  # fp32 [SPLIT_K, n_elements]
    bias_ptr,  # [N] (HAS_BIAS only)
    out_ptr,  # [n_elements] = [M, N] in OUT_DTYPE
    n_elements,  # M * N
    N,  # output features (the bias' length)
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    BF16_VIA_INT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    total = tl.full((BLOCK,), 0.0, tl.float32)
    for split in tl.static_range(SPLIT_K):  # a fixed order: the same sums on every call
        total += tl.load(partial_ptr + split * n_elements + offsets, mask=mask, other=0.0)
    if HAS_BIAS:
        total += tl.load(bias_ptr + offsets % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offsets, _round(total, OUT_DTYPE, BF16_VIA_INT), mask=mask)


# --------------------------------------------------------------------------------------------
# Launch configuration
# --------------------------------------------------------------------------------------------
class MatmulConfig(typing.NamedTuple):
    """How the fused matmul is launched."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    dot: bool
    num_warps: int
    num_stages: int = 2
    lookup: int = 2  # 0 global codebook, 1 per-block product tables, 2 byte pairs (1, 2: shared memory, Triton >= 3.4)
    mma: bool = False  # mma.py's Gluon kernel (dot, num_stages and lookup unused; block_m a multiple of 8)
    words: int = 2  # mma.py: words of a weight row a thread loads at once, 2 or 4 (block_k a multiple of 32 words)
    stage_x: bool = True  # mma.py: x's tile through shared memory, else each warp reads its fragments (rows past M unread)
    fold: bool = False  # mma.py with split_k > 1: the tile's last program adds the partial sums (no second kernel)
    wgmma: bool = False  # mma.py on sm_90: warp-group MMA over x's tile in shared memory (num_warps a multiple of 4)
    prefetch: bool = False  # mma.py: each step's loads issued during the step before
    unroll: int = 1  # mma.py: K steps in one unrolled loop body (the largest divisor of a program's steps up to this)
    kwarps: int = 1  # mma.py, x unstaged, no split_k: a program's warps each sum one K slice of one warp's block_n rows,
    # their sums added through shared memory (nf4_mma_kwarps_kernel; num_warps = kwarps, K a multiple of block_k * kwarps)
    stream: bool = False  # mma.py: the weight's words loaded evict-first in L1 and L2; where sums are folded or read
    # back 0.4 to 1.8 us less (19.7 -> 18.9 us at one row of 14336x4096), at q|k|v's one-row K slices 0.6 more: routed
    # where it won (item 101)
    accumulators: int = 1  # mma.py's K slices (kwarps > 1): 2 sums each unrolled loop body's odd steps apart from its
    # even ones, added at the end: 33.4 -> 33.1 us at one row of gate|up merged, slower elsewhere (items 102, 103)


class Route(typing.NamedTuple):
    """How ``nf4_linear`` computes up to ``max_rows`` rows of x against a weight of at least
    ``min_weight`` elements, ``min_in`` to ``max_in`` input and at least ``min_out`` output features:
    "fused" (with ``config``), "dequantize" (dequantize_nf4 + cuBLAS) or "bitsandbytes" (its own 4-bit
    matmul: its GEMV at one row, its fused kernel for a few)."""

    max_rows: int
    path: str
    config: typing.Optional[MatmulConfig] = None
    min_weight: int = 0
    min_in: int = 0
    min_out: int = 0
    max_in: int = 2**62


C = MatmulConfig
_M = 1 << 20
_TL_128_WIDE = C(128, 64, 128, 1, True, 4, 3, 2)  # the tl kernel's 128-row wgmma tiles, in both tables below
_TL_128 = C(128, 64, 128, 2, True, 4, 3, 2)
# Compute capability -> routes, the first one a call fits wins (else dequantize + cuBLAS).
# The tl kernels' table, for calls mma.py's kernel cannot run (Triton before 3.6, fp32 x, sm_75).
# sm_90: the fastest path at each point of the H100 sweep in bf16 (CUDA-graph GPU time per call,
# ``bench/matmul.py --sweep``; NOTES.md item 70), us for bitsandbytes / dequantize + cuBLAS / fused:
TL_ROUTES = {
    (9, 0): (
        # its GEMV at one row, its small-batch kernel at two: 29.3 / 100.3 / 36.8 and 44.4 / 100.3 / 51.1 at 4096x14336
        Route(2, "bitsandbytes"),
        # 66.0 / 100.4 / 49.5 at 4096x14336, M=16; 123.5 / 100.4 / 47.8 at 14336x4096; 37.7 / 26.1 / 17.8 at 4096x4096
        Route(16, "fused", C(16, 64, 256, 4, True, 4, 2, 2), min_weight=16 * _M),
        # 17.3 / 11.3 / 10.5 at 4096x1024, M=16 (product tables; 64 wide: 16.0)
        Route(16, "fused", C(16, 32, 256, 4, True, 4, 2, 1)),
        # 121.3 / 98.7 / 60.9 at 4096x14336, M=64; 364.8 / 385.0 / 231.7 at 8192x28672
        Route(64, "fused", C(64, 128, 128, 2, True, 4, 3, 2), min_weight=56 * _M, min_out=14336),
        # 124.5 / 101.4 / 81.6 at 14336x4096, M=64; 461.4 / 386.7 / 210.3 at 28672x8192
        Route(64, "fused", C(64, 64, 128, 2, True, 4, 3, 2), min_weight=56 * _M),
        # 122.7 / 99.9 / 71.6 at 4096x14336, M=128; 464.4 / 387.3 / 281.9 at 8192x28672
        Route(128, "fused", _TL_128_WIDE, min_weight=56 * _M, min_out=14336),
        # 129.5 / 106.6 / 97.2 at 14336x4096, M=128; 468.7 / 394.7 / 236.9 at 28672x8192. From 256 rows on,
        # and from 32 rows on below 56M weights, dequantize + cuBLAS: 106.0 / 139.0 at 4096x14336, M=256
        Route(128, "fused", _TL_128, min_weight=56 * _M),
    ),
}
# Reasoned, not measured (no T4, A100 or L4 has run it): the fused kernel up to 16 rows, where it
# reads the least memory per result, the narrow tile of the H100's small layers; dequantize + cuBLAS
# beyond. bf16 on sm_75 has no tensor-core product: nf4_linear dequantizes there.
TL_DEFAULT_ROUTES = (Route(16, "fused", C(16, 32, 256, 4, True, 4, 2, 1)),)
TL_ROUTES.update({capability: TL_DEFAULT_ROUTES for capability in ((7, 5), (8, 0), (8, 6), (8, 9))})
# Where mma.py's kernel runs. sm_90: the fastest path at each point of the H100 sweeps in bf16 (Triton
# 3.6.0, CUDA-graph GPU time per call), us for bitsandbytes / dequantize + cuBLAS / the tl kernel's
# route (NOTES.md item 77) / mma.py's with x staged in shared memory (items 78, 80; one round each):
_MMA_TILE = C(8, 64, 256, 8, True, 4, mma=True)._replace  # the 8-row tile, varied below
_UNSTAGED = _MMA_TILE(split_k=4, words=4, stage_x=False)  # 1 to 4 rows of the widest layers
# 1 and 2 rows: K slices across a program's warps (16 weight rows, 512 columns a warp and step), no split-K sum
_KWARPS = C(8, 16, 512, 1, True, 4, mma=True, words=4, stage_x=False, unroll=4, kwarps=4)._replace
# sm_90's warp-group MMA from 32 rows, loads a step ahead (item 82): 4 warps, 64 weight rows by 128 columns, split 4
_WGMMA_TILE = C(128, 64, 128, 4, True, 4, mma=True, wgmma=True, prefetch=True)._replace
MATMUL_ROUTES = {
    (9, 0): (
        # 1 to 4 rows, each warp reading its x fragments (item 81), against x staged: 20.6 / 21.0 / 22.6 against 23.6 /
        # 23.6 / 23.7 at 4096x14336, 69.8 / 71.6 / 77.2 against 80.4 / 81.0 / 81.2 at 8192x28672; 26.7 against 24.2
        # at 8 rows. 8192x28672 unrolled (item 87): 71.9 / 73.0 against 69.7 / 71.0 at 1 / 2 rows, so not there
        Route(4, "fused", _UNSTAGED, min_weight=128 * _M, min_out=14336),
        # K slices across 4 warps (item 99, bf16 / fp16): one row of 4096x14336 18.7 / 18.7 against 19.9 / 19.9, of
        # gate|up merged (4096x28672) 34.0 / 33.8 against 35.4 / 35.3; two rows 19.6 / 19.6 against 20.8 / 20.9 (256
        # columns 19.8), gate|up 35.5 / 35.5 at 256 columns (512: 36.4) against 37.3 / 37.3
        # the words streamed (item 101; H100 / H200, us): gate|up 33.8 -> 33.5 / 33.6 -> 33.5 at one row, 35.6 -> 34.6 /
        # 35.4 -> 34.8 at two; not 4096x14336's two rows (19.4 both)
        # two accumulators (item 103; H200, 7 / 9 rounds): gate|up 33.39 -> 33.02 us in bf16, 33.42 -> 33.06 in fp16 at one
        # row; at two rows, on q|k|v, o and down they lose
        Route(1, "fused", _KWARPS(stream=True, accumulators=2), min_weight=112 * _M, min_in=4096, min_out=28672),
        Route(1, "fused", _KWARPS(stream=True), min_weight=56 * _M, min_in=4096, min_out=14336),
        Route(2, "fused", _KWARPS(block_k=256, stream=True), min_weight=112 * _M, min_in=4096, min_out=28672),
        Route(2, "fused", _KWARPS(), min_weight=56 * _M, min_in=4096, min_out=14336),
        # where 2048 columns do not divide K: 512 columns a step, the loop unrolled (item 87), 20.0 / 20.8 against
        # 20.8 / 21.2 at 1 / 2 rows of 4096x14336
        Route(2, "fused", _UNSTAGED._replace(block_k=512, unroll=4), min_weight=56 * _M, min_in=4096, min_out=14336),
        Route(4, "fused", _UNSTAGED._replace(stream=True), min_weight=56 * _M, min_out=14336),  # streamed 23.0 -> 22.2 at 4
        # 4 words a thread (16-byte loads, 64 registers against 79): 1 and 8 rows of 4096x14336 29.5 / 67.0 against
        # 23.3 / 23.9 at split 4 (2 words at split 8: 24.8 / 26.1)
        # streamed (item 101, H100): 24.9 -> 23.7 at 8 rows of 4096x14336, 43.2 -> 41.4 of gate|up
        Route(8, "fused", _MMA_TILE(split_k=4, words=4, stream=True), min_weight=56 * _M, min_out=14336),
        # 28672x8192: 80.6 / 81.4 at 1 / 2 rows at split 4 against x staged's 82.6 / 82.5 at split 8 (87.9 / 88.9
        # unstaged), 83.0 staged at 4 rows. The split-K sum folded in (item 81): 82.8 / 84.3 against 83.3 / 85.1 at
        # 4 / 8 rows; 82.2 / 83.1 against 80.9 / 81.6 at 1 / 2 rows, so not there (nor on 4096x14336: 24.5 against 24.4)
        # Splits 2 to 32 (item 85, split_sweep.log): 74.4 / 76.4 at 1 / 2 rows at split 32 against split 4's 81.4 /
        # 82.4; 80.9 / 81.8 at 4 / 8 rows at split 16 against split 8's 82.5 / 83.0 (split 32 80.5 / 83.2)
        # 512 columns a step, the loop unrolled (item 87): 72.7 / 74.7 against 74.8 / 76.6 at 1 / 2 rows
        Route(2, "fused", _MMA_TILE(block_k=512, split_k=32, words=4, stage_x=False, unroll=4), min_weight=128 * _M),
        Route(2, "fused", _MMA_TILE(split_k=32, words=4, stage_x=False), min_weight=128 * _M),
        Route(8, "fused", _MMA_TILE(split_k=16, words=4, fold=True), min_weight=128 * _M),
        # 14336x4096, 1 to 4 rows: 24.4 / 24.6 / 25.3 against 25.9 / 25.9 / 26.0 staged, folded 23.5 / 24.0 / 24.5;
        # one row: 30.0 / 100.2 at 14336x4096 for bitsandbytes / dequantize + cuBLAS. Split 16 (item 85): 20.9 / 21.8 /
        # 23.3 / 24.7 at 1 / 2 / 4 / 8 rows against split 8's 23.6 / 24.0 / 24.7 / 25.6 (split 32: 23.1 / 24.3 /
        # 26.0 / 26.5); K of 14336 and more only, the 70B's 8192x8192 not swept
        # the loop unrolled (item 87): 19.4 / 20.7 / 22.6 against 20.9 / 21.9 / 23.3 at 1 / 2 / 4 rows
        # the words streamed (item 101; H100 / H200): 19.7 -> 18.9 / 19.7 -> 18.9 at one row, 20.7 -> 19.8 / 20.5 -> 20.0
        # at two, 22.7 -> 22.1 at 4, 24.8 -> 24.0 / 24.4 -> 23.9 at 8
        # 512 columns a step at 1 and 2 rows (item 103; H200, bf16 / fp16): 18.82 -> 18.70 / 18.81 -> 18.61 us at one row,
        # 20.08 -> 19.86 / 20.03 -> 19.82 at two, each of 14 splits summing the same 1024 columns in the same order. At
        # K = 14336 alone, where it was measured: elsewhere 512 columns can halve the split (18944: 1 against 2)
        Route(2, "fused", _MMA_TILE(block_k=512, split_k=16, words=4, stage_x=False, fold=True, unroll=4, stream=True),
              min_weight=56 * _M, min_in=14336, max_in=14336),
        Route(4, "fused", _MMA_TILE(split_k=16, words=4, stage_x=False, fold=True, unroll=4, stream=True),
              min_weight=56 * _M, min_in=14336),
        Route(8, "fused", _MMA_TILE(split_k=16, words=4, fold=True, stream=True), min_weight=56 * _M, min_in=14336),
        Route(4, "fused", _MMA_TILE(words=4, stage_x=False, fold=True), min_weight=56 * _M),
        # one row of q|k|v merged (4096x6144), K slices across 4 warps (item 99, bf16 / fp16): 10.7 / 10.7 against
        # 11.1 / 11.1 us; 12.0 / 12.0 against 13.4 / 13.4 at 4096x8192, 16.3 / 16.2 against 17.9 / 17.8 at 4096x11008
        # (8 warps of 128 columns: 10.6, 13.3, 18.3); two rows of 4096x6144 at 256 columns 10.6 / 10.6 against 12.5 / 12.6
        Route(1, "fused", _KWARPS(), min_weight=24 * _M, min_in=4096, min_out=6144),
        # streamed at two rows (item 101; H100 / H200): 10.6 -> 10.2 / 10.4 -> 10.0; at one row 10.7 -> 11.3, so not there
        Route(2, "fused", _KWARPS(block_k=256, stream=True), min_weight=24 * _M, min_in=4096, min_out=6144),
        # where 1024 columns do not divide K (where 2048 do not but 1024 do, one row takes the 256-column slices above,
        # not measured at one row; items 88, 90): 512 columns at split 8, folded, 11.2 against 12.7 us at split 16 of
        # 128 columns at one row of 4096x6144; 13.3 against 15.2 at 4096x8192, 17.9 against 19.2 at 4096x11008
        Route(1, "fused", _MMA_TILE(block_k=512, split_k=8, words=4, stage_x=False, fold=True, unroll=4),
              min_weight=24 * _M, min_in=4096, min_out=6144),
        # 4096x4096, K slices across 8 warps of 128 columns (item 99, bf16 / fp16): 8.3 / 8.3 against 9.0 / 8.9 us at
        # one row, 8.6 / 8.6 against 9.8 / 9.9 at two (4 warps of 512: 9.3 and 9.1); measured at 4096x4096 alone, so
        # not below its 256 programs of 16 rows (14336x4096's K-slice tiles lost with 256, 22.6 against 19.6 at one
        # row, item 98; it takes an earlier route)
        Route(2, "fused", _KWARPS(block_k=128, num_warps=8, kwarps=8), min_weight=16 * _M, min_out=4096),
        # where 1024 columns do not divide K: one row of 4096x4096 10.8 / 25.5 / - / 8.9 at split 16 of 128 columns,
        # unstaged (split 8 of 256, staged: 9.6); a tie at 2 rows (9.6 against 9.8), 11.8 against 10.2 at 8 (item 83)
        Route(1, "fused", _MMA_TILE(block_k=128, split_k=16, words=4, stage_x=False, fold=True), min_weight=16 * _M),
        # 8 rows: 124.4 / 100.2 / 47.8 / 26.5 at 14336x4096 (2 words 26.3); 37.3 / 25.2 / 17.8 / 11.1 at 4096x4096
        # (11.0). Folded: 25.7 against 26.4, 10.4 against 11.3 (2 to 8 rows: 0.5 to 1.2 us less)
        # streamed (item 101; H100 / H200): 13.0 -> 12.6 / 12.5 -> 12.2 at 8 rows of q|k|v, 10.5 -> 10.0 / 10.0 -> 9.6 of o
        Route(8, "fused", _MMA_TILE(words=4, fold=True, stream=True), min_weight=16 * _M),
        # below 16M weights split 16 (item 83): 5.4 / 6.0 / 6.4 us at 1 / 2 / 8 rows of 4096x1024 against split 8's
        # 6.4 / 6.7 / 6.9; bitsandbytes 7.1 / 9.3 / 17.5. 8 warps and 128 weight rows at 1 and 2 rows (item 87): 5.3 /
        # 6.0 against 5.5 / 6.1
        # streamed (item 101): 5.3 -> 5.0, 6.0 -> 5.8 and 6.4 -> 6.1 at 1, 2 and 8 rows
        Route(2, "fused", _MMA_TILE(block_n=128, split_k=16, num_warps=8, words=4, fold=True, stream=True)),
        Route(8, "fused", _MMA_TILE(split_k=16, words=4, fold=True, stream=True)),
        # 16 rows: 67.8 / 100.4 / 49.5 / 29.7 at 4096x14336 (2 words 30.6); 124.6 / 100.3 / - / 29.0 at 14336x4096
        # (4 words 31.4); 37.5 / 26.1 / - / 12.0 at 4096x4096 (12.1); 17.4 / 11.4 / - / 7.7 at 4096x1024 (8.4)
        # streamed (item 101): 55.1 -> 54.3 at gate|up, 28.3 -> 27.7 at 14336x4096
        Route(16, "fused", _MMA_TILE(block_m=16, split_k=4, words=4, stream=True), min_weight=56 * _M, min_out=14336),
        Route(16, "fused", _MMA_TILE(block_m=16, fold=True, stream=True), min_weight=56 * _M),  # folded 28.4 against 29.2
        Route(16, "fused", _MMA_TILE(block_m=16, words=4)),
        # 32 rows: 69.4 / 98.8 / - / 36.2 at 4096x14336; 125.2 / 100.3 / - / 34.7 at 14336x4096; 35.9 / 24.8 / - /
        # 15.0 at 4096x4096; 18.0 / 11.6 / - / 10.0 at 4096x1024. wgmma (item 82): 34.0 at 4096x14336 (38.0 at
        # 14336x4096); loads a step ahead: 9.8 against 10.5 at 4096x1024
        Route(32, "fused", _WGMMA_TILE(block_m=32, block_k=64), min_weight=56 * _M, min_out=14336),
        Route(32, "fused", _MMA_TILE(block_m=32, block_n=128, block_k=64, split_k=16), min_weight=56 * _M),
        Route(32, "fused", _MMA_TILE(block_m=32, split_k=4), min_weight=16 * _M),
        Route(32, "fused", _MMA_TILE(block_m=32, block_n=128, block_k=64, split_k=16, prefetch=True)),
        # 64 rows: 122.5 / 99.0 / 60.9 / 50.6 at 4096x14336, 126.0 / 101.7 / 81.6 / 59.5 at 14336x4096, 36.6 / 24.7
        # / - / 19.8 at 4096x4096 and 18.4 / 12.5 / - / 12.4 at 4096x1024 with mma.sync; wgmma 42.2 / 44.6 / 17.4,
        # 145 at 28672x8192 (bitsandbytes 465, dequantize + cuBLAS 383); mma.sync loading a step ahead 10.7 at
        # 4096x1024
        Route(64, "fused", _WGMMA_TILE(block_m=64, block_n=128, split_k=2, num_warps=8, prefetch=False),
              min_weight=56 * _M, min_out=14336),
        Route(64, "fused", _WGMMA_TILE(block_m=64), min_weight=128 * _M),
        Route(64, "fused", _WGMMA_TILE(block_m=64, block_k=64, split_k=8), min_weight=56 * _M),
        Route(64, "fused", _WGMMA_TILE(block_m=64), min_weight=16 * _M),
        Route(64, "fused", _MMA_TILE(block_m=64, block_k=64, prefetch=True)),
        # 128 rows: 124.1 / 100.1 / 66.1 (the tl kernel's wgmma tile) / 60.5 (wgmma) at 4096x14336, 130.7 / 105.8 /
        # 81.5 (mma.sync) / 58.0 at 14336x4096, 39.3 / 28.2 / - / 21.2 at 4096x4096, 18.9 / 13.0 / - / 11.9 at
        # 4096x1024; 463.5 / 385.5 / 238.1 / 218.4 at 8192x28672, 472.6 / 392.1 / - / 208.7 at 28672x8192
        Route(128, "fused", _WGMMA_TILE(block_m=128, block_n=128, block_k=64, split_k=2, num_warps=8),
              min_weight=56 * _M, min_out=14336),
        Route(128, "fused", _WGMMA_TILE(block_m=128, split_k=2), min_weight=128 * _M),
        Route(128, "fused", _WGMMA_TILE(block_m=128), min_weight=16 * _M),
        Route(128, "fused", _WGMMA_TILE(block_m=128, split_k=8)),
        # 256 rows: 130.4 / 106.2 / 97.6 at 4096x14336, 137.2 / 112.3 / 108.5 at 14336x4096, 481.0 / 404.1 / 387.5
        # at 8192x28672, 473.9 / 396.3 / 337.6 at 28672x8192; below 56M weights and beyond 256 rows dequantize +
        # cuBLAS (31.4 against wgmma's 35.6 at 4096x4096; 138.5 against 195.9 at 512 rows of 4096x14336)
        Route(256, "fused", _WGMMA_TILE(block_m=128, block_n=128, block_k=64, split_k=1, num_warps=8),
              min_weight=56 * _M, min_out=14336),
        Route(256, "fused", _WGMMA_TILE(block_m=128, block_n=128, block_k=64, split_k=2, num_warps=8),
              min_weight=128 * _M),
        Route(256, "fused", _WGMMA_TILE(block_m=128, split_k=2), min_weight=56 * _M),
    ),
}
# Reasoned, not measured (no A100 or L4 has run it): mma.py's 16-row tile up to 16 rows, where it
# reads the least memory per result; dequantize + cuBLAS beyond. sm_75 has no mma.sync.m16n8k16.
DEFAULT_ROUTES = (Route(16, "fused", _MMA_TILE(block_m=16)),)
MATMUL_ROUTES.update({capability: DEFAULT_ROUTES for capability in ((8, 0), (8, 6), (8, 9))})
MATMUL_ROUTES[(7, 5)] = TL_DEFAULT_ROUTES
# GPUs whose DRAM peaks at kernel.FAST_DRAM_GBPS or more (the H200) dequantize from 129 rows: there the dequantization
# is faster and dequantize + cuBLAS beats wgmma's two 128-row tiles at 256 rows, 87.6 against 109.2 us at 14336x4096
# and 314.1 against 346.2 at 28672x8192 in bf16 (H100: 112.7 against 108.0, 400.6 against 338.0); at 128 rows the
# fused tiles still win, 58.5 against 79.0 and 212.4 against 278.5 (NOTES.md item 109)
FAST_DRAM_ROUTES = {(9, 0): tuple(route for route in MATMUL_ROUTES[(9, 0)] if route.max_rows <= 128)}
_DEQUANTIZE = Route(2**62, "dequantize")


def mma_runs_on(capability):
    """Whether mma.py's kernel can run on a GPU of this capability: Gluon's mma_v2 (Triton 3.6 on),
    compiled (not the interpreter), NVIDIA from sm_80."""
    return mma_layouts.AVAILABLE and not INTERPRET and torch.version.hip is None and tuple(capability) >= (8, 0)


def routes_for(capability, routes=None, dram_gbps=0):
    """The routes of a table (``MATMUL_ROUTES``, or ``TL_ROUTES`` where mma.py's kernel cannot run)
    for a GPU of ``capability`` whose DRAM peaks at ``dram_gbps`` (``FAST_DRAM_ROUTES`` from
    ``kernel.FAST_DRAM_GBPS``); a GPU the table does not name takes its default."""
    table = MATMUL_ROUTES if routes is None else routes
    if table is MATMUL_ROUTES and dram_gbps >= kernel.FAST_DRAM_GBPS and tuple(capability) in FAST_DRAM_ROUTES:
        return FAST_DRAM_ROUTES[tuple(capability)]
    return table.get(tuple(capability), DEFAULT_ROUTES if table is MATMUL_ROUTES else TL_DEFAULT_ROUTES)


def choose_route(capability, rows, in_features, out_features, routes=None, dram_gbps=0):
    """The Route for ``rows`` rows of x against an (out_features, in_features) weight on a GPU of
    ``capability`` whose DRAM peaks at ``dram_gbps``, from ``routes`` (``routes_for``): a pure function
    of the six. A route of more than 256 columns a step, or of K slices across warps, is passed over
    where its columns do not divide K."""
    for route in routes_for(capability, routes, dram_gbps):
        if (rows <= route.max_rows and in_features * out_features >= route.min_weight
                and route.min_in <= in_features <= route.max_in and out_features >= route.min_out
                and (route.config is None or (route.config.block_k <= 256 and route.config.kwarps == 1)
                     or in_features % (route.config.block_k * route.config.kwarps) == 0)):
            return route
    return _DEQUANTIZE


def device_route(device, rows, in_features, out_features, routes=None):
    """``choose_route`` for a call on ``device`` (None: the current CUDA device), from its ``device_facts``."""
    capability, _, dram_gbps = device_facts(device)
    return choose_route(capability, rows, in_features, out_features, routes, dram_gbps)


# The fused matmul's launches, by everything they read but x, the output and the split-K partial sums (the
# weight's and the bias' addresses, the sizes, x's row stride, the alignments Triton specializes on, the
# config, the fold counters): a repeated call replays them without Triton's argument binding. Host time a
# call through the drop-in at 8 rows, one H100 host: 93 us with, 280 without (bitsandbytes' forward 97;
# NOTES.md item 76). Under NF4_TRITON_PLANS=0 none is kept.
LAUNCHES = {}
MOST_LAUNCHES = 4096


# Split-K scratch. The fp32 partial sums are a call's own, from the caching allocator (stream-ordered, so no
# other call, on any thread or stream, reads or writes them before this call's kernels are done with them):
# a stream's scratch shared between calls let two threads' launches interleave between one call's fused
# kernel and its reduction (NOTES.md item 110). The tile counters of a folded sum are one kernel's alone
# while it runs, and it leaves them at zero, so each stream keeps one slice of them for its eager launches;
# a launch captured into a CUDA graph takes counters never handed out again, so no replay shares them.
FOLD_COUNTERS = 1 << 22  # int32 zeros a device keeps for folds (16 MiB), made at its first fold outside a capture
STREAM_COUNTERS = 4096  # output tiles a stream's eager launches fold at most
_SCRATCH = {}  # device index -> _FoldCounters


class _FoldCounters:
    """One device's fold counters, handed out in slices: one slice a stream, one a captured launch."""

    def __init__(self):
        self.counters = None
        self.handed_out = 0
        self.streams = {}  # raw stream -> its slice
        self.lock = threading.Lock()  # two threads never get one slice, nor hand a stream two

    def _take(self, device, count, capturing):
        """``count`` zero counters no one else holds, or None where too few are left (the lock held)."""
        if self.counters is None:
            if capturing:
                return None
            self.counters = torch.zeros(FOLD_COUNTERS, dtype=torch.int32, device=device)
            torch.cuda.synchronize(device)  # zero before any stream reads them
        if self.handed_out + count > FOLD_COUNTERS:
            return None
        self.handed_out += count
        return self.counters[self.handed_out - count:self.handed_out]

    def for_launch(self, device, tiles, capturing):
        """Counters for a folded launch of ``tiles`` output tiles on the current stream of ``device``, or None."""
        if capturing:  # this launch's own, for every replay
            with self.lock:
                return self._take(device, tiles, True)
        if tiles > STREAM_COUNTERS:
            return None
        stream = torch._C._cuda_getCurrentRawStream(device.index)
        counters = self.streams.get(stream)
        if counters is None:
            with self.lock:
                counters = self.streams.get(stream)
                if counters is None:
                    counters = self.streams[stream] = self._take(device, STREAM_COUNTERS, False)
        return counters


def split_taken(steps, split_k):
    """The split a call runs: the largest divisor of its BLOCK_K steps up to the route's ``split_k``, so that
    every program takes whole steps (56 steps of 14336 at split 16 run as 14 splits of 4)."""
    for split in range(max(split_k, 1), 1, -1):  # from the route's split down: most calls stop at the first
        if steps % split == 0:
            return split
    return 1


def unroll_taken(steps_per_split, unroll):
    """The steps a call's loop body holds: the largest divisor of a program's steps up to the route's ``unroll``."""
    return split_taken(steps_per_split, unroll)


def fold_counters(device, tiles, capturing):
    """int32 zero counters for a folded split-K launch of ``tiles`` output tiles on the current stream of
    ``device`` (``capturing``: that stream is being captured into a CUDA graph), or None where none are left."""
    counters = _SCRATCH.get(device.index)
    if counters is None:
        counters = _SCRATCH.setdefault(device.index, _FoldCounters())
    return counters.for_launch(device, tiles, capturing)


def _empty_fp32(elements, device):
    """A new fp32 tensor of ``elements`` on ``device`` (on the GPU through the allocation entry launch plans use)."""
    if device.type == "cuda" and torch._C._cuda_getDevice() == device.index:
        return fastpath.empty_cuda((elements,), (1,), torch.float32)
    return torch.empty(elements, dtype=torch.float32, device=device)


def launch_fused(x2d, packed, tables, bias, out, *, n, k, blocksize, blocksize2, nested, fp4, config,
                 use_asm=None, bf16_via_int=None, members=()):
    """Launch the fused matmul (and the split-K reduction, where not folded) for validated arguments.
    ``members``: (packed, tables, out) of up to two more weights of the same format read by the same x
    (mma.py, no bias, their rows after this weight's, ``n`` the rows of all): one launch where its
    split-K sum folds, else one launch each."""
    absmax, code, absmax2, code2, offset = tables
    if packed.data_ptr() % 4:
        packed = packed.clone()  # int32 word loads need 4-byte alignment; a fresh allocation has it
    m = x2d.shape[0]
    x_dtype = TL_DTYPE[x2d.dtype]
    if use_asm is None:
        use_asm = not INTERPRET and torch.version.hip is None
    if bf16_via_int is None:
        bf16_via_int = INTERPRET or device_facts(x2d.device)[0] < (8, 0)
    code_lookup = config.lookup if kernel.TRITON_COMPILES_SHARED_TABLES else 0  # gathers compile from Triton 3.4
    steps = -(-k // config.block_k)  # not triton.cdiv: a constexpr function, 1.5 us a host call
    split_k = split_taken(steps, config.split_k)
    grid = (-(-n // config.block_n), -(-m // config.block_m), split_k)
    capturing = not INTERPRET and torch.cuda.is_current_stream_capturing()
    partials = counters = None
    if split_k > 1:  # this call's own (the caching allocator's, stream-ordered): no other call touches them
        partials = _empty_fp32(split_k * m * n, x2d.device)
        if config.mma and config.fold and not INTERPRET:
            counters = fold_counters(x2d.device, grid[0] * grid[1], capturing)
    fold = counters is not None
    if members and split_k > 1 and not fold:  # no counters left for the group's tiles: one launch a weight
        for packed_j, tables_j, out_j in ((packed, tables, out),) + tuple(members):
            launch_fused(x2d, packed_j, tables_j, None, out_j, n=out_j.shape[1], k=k, blocksize=blocksize,
                         blocksize2=blocksize2, nested=nested, fp4=fp4, config=config)
        return out
    # what a repeated call passes anew beside x: mma.py's output (and its partial sums), the tl kernel's output
    # or partial sums
    target = out if config.mma or split_k == 1 else partials
    device = x2d.device.index
    key = None
    if (not INTERPRET and fastpath.ENABLED and not fastpath.launch_hooks_active() and not members
            and torch._C._cuda_getDevice() == device and not capturing):
        key = (device, x2d.dtype, m, n, k, x2d.stride(0), x2d.data_ptr() % 16, out.data_ptr() % 16, packed.data_ptr(),
               absmax.data_ptr(), code.data_ptr(), absmax2.data_ptr(), code2.data_ptr(), offset.data_ptr(),
               None if bias is None else bias.data_ptr(), blocksize, blocksize2, nested, fp4, config, use_asm,
               bf16_via_int, code_lookup, None if counters is None else counters.data_ptr())
        launches = LAUNCHES.get(key)
        if launches is not None:
            stream = torch._C._cuda_getCurrentRawStream(device)
            fused, reduce = launches
            if partials is None:
                fused(stream, x2d.data_ptr(), out.data_ptr())
            elif config.mma:  # kwarps tiles never split
                fused(stream, x2d.data_ptr(), out.data_ptr(), partials.data_ptr())
            else:
                fused(stream, x2d.data_ptr(), partials.data_ptr())
            if reduce is not None:
                reduce(stream, partials.data_ptr(), out.data_ptr())
            return out
    # a launch not replayed (a replayed one's config, in its key, was checked when it was first made)
    if config.accumulators != 1 and not (config.accumulators == 2 and config.mma and config.kwarps > 1):
        raise ValueError(f"{config}: 1 accumulator, or 2 with K slices across warps")
    head = (x2d, packed, absmax, code, absmax2, code2, offset, bias if bias is not None else out, target)
    options = dict(BLOCKSIZE=blocksize, BLOCKSIZE2=blocksize2, NESTED=nested, FP4=fp4, X_DTYPE=x_dtype,
                   BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                   HAS_BIAS=bias is not None and (split_k == 1 or fold), USE_INT64=n * k > 2**31 - 1,
                   num_warps=config.num_warps)
    if config.mma:
        weights = ((packed, tables, out),) + tuple(members)
        padded = weights + (weights[0],) * (3 - len(weights))  # absent members: never read
        scratch = () if config.kwarps > 1 else (out if partials is None else partials, out if counters is None else counters)
        args = head + scratch + (m, n, k, x2d.stride(0), out.shape[1], padded[1][2].shape[1] if members else 0)
        for packed_j, tables_j, out_j in padded[1:]:
            args += (packed_j if packed_j.data_ptr() % 4 == 0 else packed_j.clone(), *tables_j, out_j)
        if config.kwarps > 1 and (steps % config.kwarps or config.split_k != 1 or config.stage_x or config.wgmma
                                  or config.num_warps != config.kwarps):
            raise ValueError(f"{config}: K slices across warps need split_k 1, x unstaged, a warp a slice and "
                             f"{config.kwarps} slices of whole {config.block_k}-column steps (K = {k})")
        kernel_fn, constexprs = mma_kernel(config, steps, split_k, fold, len(weights))
        options.update(constexprs)
    else:
        kernel_fn = nf4_matmul_kernel
        args = head + (m, n, k, x2d.stride(0))
        options.update(SPLIT_K=split_k, STEPS_PER_SPLIT=steps // split_k, DOT=config.dot, USE_ASM=use_asm,
                       BF16_VIA_INT=bf16_via_int, LOOKUP=code_lookup,
                       EVEN=n % config.block_n == 0 and k % config.block_k == 0, num_stages=config.num_stages)
    # the arguments a replay passes anew: x, the output or partial sums (8) and mma.py's partial sums (9)
    varying = (0, 8, 9) if config.mma and partials is not None else (0, 8)
    fused = fastpath.run(kernel_fn, grid, args, options, None if key is None else varying)
    reduce = None
    if split_k > 1 and not fold:
        block = 1024
        reduce = fastpath.run(split_k_reduce_kernel, (triton.cdiv(m * n, block), 1, 1), (
            partials, bias if bias is not None else out, out, m * n, n), dict(
            SPLIT_K=split_k, HAS_BIAS=bias is not None, OUT_DTYPE=x_dtype, BF16_VIA_INT=bf16_via_int, BLOCK=block,
            num_warps=4), None if key is None else (0, 2))
    if key is not None:
        if len(LAUNCHES) >= MOST_LAUNCHES:
            LAUNCHES.clear()
        LAUNCHES[key] = (fused, reduce)
    return out


def mma_kernel(config, steps, split_k, fold, members):
    """The Gluon kernel for ``config`` and its constexprs beyond the shared ones (block sizes, formats, bias), for
    a call of ``steps`` BLOCK_K steps at ``split_k`` (``split_taken``), ``fold`` (its split-K sum in the kernel)
    and ``members`` weights: ``mma_sync.nf4_mma_kwarps_kernel`` for K slices across warps,
    ``wgmma.nf4_wgmma_kernel`` for sm_90's warp-group MMA, else ``mma_sync.nf4_mma_kernel``."""
    policy = "evict_first" if config.stream else ""
    if config.kwarps > 1:  # no split between programs
        per_warp = steps // config.kwarps
        return mma_sync.nf4_mma_kwarps_kernel, dict(
            STEPS_PER_WARP=per_warp, UNROLL=unroll_taken(per_warp, config.unroll), MEMBERS=members, WORDS_POLICY=policy,
            ACCUMULATORS=config.accumulators,
            **mma_layouts.kwarps_constexprs(config.kwarps, config.block_n, config.block_k, config.block_m, config.words))
    shared = dict(SPLIT_K=split_k, STEPS_PER_SPLIT=steps // split_k, FOLD=fold, PREFETCH=config.prefetch,
                  UNROLL=unroll_taken(steps // split_k, config.unroll), MEMBERS=members, WORDS_POLICY=policy)
    tile = (config.num_warps, config.block_n, config.block_k, config.block_m, config.words)
    if config.wgmma:
        return wgmma.nf4_wgmma_kernel, dict(shared, **mma_layouts.wgmma_constexprs(*tile))
    return mma_sync.nf4_mma_kernel, dict(shared, STAGE_X=config.stage_x, **mma_layouts.mma_sync_constexprs(*tile))


def mma_supported(x2d, k, blocksize, config):
    """Whether mma.py's kernel runs this call: on x's GPU (``mma_runs_on``; wgmma on sm_90 alone), fp16
    or bf16 x, K whole tiles, each thread's columns of a chunk within one block."""
    capability = device_facts(x2d.device)[0]
    return (x2d.dtype is not torch.float32 and k % (config.block_k * config.kwarps) == 0
            and blocksize >= 8 * config.words
            and mma_runs_on(capability) and (not config.wgmma or tuple(capability)[0] == 9))


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------
def _require(condition, message, caller="nf4_linear"):
    if not condition:
        raise ValueError(f"{caller}: {message}")


def _fused_supported(blocksize, k, x):
    """Whether the fused kernel reads this layout (whole int32 words within one block per row; a
    packed view off a 4-byte boundary is copied at launch) on this GPU: sm_75 has no bf16
    tensor-core product, and Triton before 3.4 fails to compile its fp16 dot there. Elsewhere
    nf4_linear dequantizes."""
    if blocksize < 8 or k % blocksize:
        return False
    return INTERPRET or device_facts(x.device)[0] >= (8, 0) or (
        x.dtype is not torch.bfloat16 and SM75_COMPILES)


SM75_COMPILES = kernel.TRITON_COMPILES_SHARED_TABLES  # both from Triton 3.4 (3.3.1 aborts in its LLVM lowering)


def nf4_linear(x, weight, quant_state=None, bias=None):
    """``x @ W.T (+ bias)`` for a bitsandbytes 4-bit weight W of shape (out, in), computed by the
    route ``choose_route`` gives (the fused kernel, dequantize + cuBLAS, or bitsandbytes' own
    kernel at one row on the small layers of the GPUs it was measured on).

    ``weight``: a ``Linear4bit``, its ``Params4bit``, or the packed tensor with its ``QuantState``
    (NF4 or FP4, nested or flat absmax, any packed storage dtype). ``x``: (..., in) in fp16, bf16
    or fp32; the result is (..., out) in x's dtype. The weight is decoded as ``dequantize_nf4``
    decodes it, rounded once to x's dtype; only the order of the fp32 sums differs from
    ``F.linear(x, W)``. ``bias``: (out,) in x's dtype, or None (a module's own bias is not taken).
    """
    packed, qs, out_features, in_features = _validated(x, weight, quant_state, bias)
    rows = x.numel() // in_features if in_features else 0
    route = device_route(x.device, rows, in_features, out_features)
    return linear_unchecked(x, packed, qs, bias, route, out_features, in_features)  # checked by _validated


def _validated(x, weight, quant_state, bias, caller="nf4_linear"):
    """(packed, quant_state, out_features, in_features) of ``nf4_linear``'s arguments, or a ValueError
    naming what is wrong."""
    packed, qs = quantstate.resolve(weight, quant_state)
    _require(isinstance(x, torch.Tensor), f"x must be a tensor, got {type(x).__name__}", caller)
    _require(isinstance(packed, torch.Tensor),
             f"weight must be a tensor, Params4bit or Linear4bit, got {type(weight).__name__}", caller)
    _require(qs is not None, "no quant_state given and the weight carries none", caller)
    _require(hasattr(qs, "shape") and hasattr(qs, "absmax"),
             f"quant_state must be a bitsandbytes 4-bit QuantState, got {type(qs).__name__}", caller)
    _require(packed.device.type != "meta", "the weight is a meta tensor: it has no bytes to read", caller)
    shape = qs.shape
    _require(isinstance(shape, (tuple, list, torch.Size)) and len(shape) == 2,
             f"the quant_state's shape must be (out, in), got {shape!r}", caller)
    out_features, in_features = (int(dim) for dim in shape)
    check_call(x, bias, out_features, in_features, caller)
    _require(x.device == packed.device, f"x is on {x.device} but the weight is on {packed.device}", caller)
    return packed, qs, out_features, in_features


def check_call(x, bias, out_features, in_features, caller):
    """x's dtype and features, and the bias' shape, dtype and device, against a weight (out, in)."""
    _require(x.dtype in quantstate.OUTPUT_DTYPES, f"x must be float16, bfloat16 or float32, got {x.dtype}", caller)
    _require(x.dim() >= 1 and x.shape[-1] == in_features,
             f"x has {x.shape[-1] if x.dim() else 0} features in its last dimension, the weight takes {in_features}",
             caller)
    if bias is not None:
        _require(isinstance(bias, torch.Tensor) and bias.shape == (out_features,),
                 f"bias must be a tensor of shape ({out_features},), got {getattr(bias, 'shape', bias)!r}", caller)
        _require(bias.dtype == x.dtype, f"bias must be {x.dtype} like x, got {bias.dtype}", caller)
        _require(bias.device == x.device, f"bias is on {bias.device} but x is on {x.device}", caller)


def nf4_linear_group(x, weights):
    """``[nf4_linear(x, weight) for weight in weights]`` (no bias), in one launch of the fused kernel
    where ``group_plan`` allows it: the projections a layer reads from one input, such as q, k and v
    or gate and up. Each output equals that weight's alone through the same tile; the tile is the
    route's for the rows of all (NOTES.md item 88)."""
    # a count or a type name, never a repr: that reads the layers back from the GPU (a sync, an error under capture)
    is_list = isinstance(weights, (list, tuple))
    got = len(weights) if is_list else f"a {type(weights).__name__}"
    _require(is_list and 1 <= got <= 3, f"weights must be a list of 1 to 3 layers, got {got}", "nf4_linear_group")
    states = [_validated(x, weight, None, None, "nf4_linear_group")[:2] for weight in weights]
    lead, in_features = x.shape[:-1], x.shape[-1]
    x2d = x.reshape(-1, in_features)
    plan = group_plan(x2d, states)
    if plan is None:
        return [nf4_linear(x, weight) for weight in weights]
    return [y.reshape(*lead, y.shape[1]) for y in linear_group(x2d, states, plan)]


class GroupPlan(typing.NamedTuple):
    """One launch over several weights: its tile and each weight's ``quantstate.check_state`` layout."""
    config: MatmulConfig
    layouts: list


# The most rows of x a group launch takes: merged, a decoder layer's linears take 11 to 22 us less from 1 to 64
# rows (item 88); at 128 rows a 32-layer prefill of 1x128 took 13.79 ms against 12.74 unmerged (item 90)
GROUP_MAX_ROWS = 64


def group_plan(x2d, states):
    """The GroupPlan of one launch over several weights [(packed, quant_state)] read by ``x2d``, or None
    where x has more than ``GROUP_MAX_ROWS`` rows, that launch is not mma.py's route for their rows
    together, their formats or input features differ, or a weight but the last has rows the tile does
    not divide; split-K folded."""
    if len(states) < 2 or not 0 < x2d.shape[0] <= GROUP_MAX_ROWS or x2d.numel() == 0 or not x2d.is_cuda or INTERPRET:
        return None
    layouts, formats = [], []
    for packed, qs in states:
        if len(qs.shape) != 2 or int(qs.shape[1]) != x2d.shape[1]:
            return None
        layouts.append(quantstate.checked_state(packed, qs))
        formats.append(layouts[-1][1:4] + (qs.quant_type, layouts[-1][4][1].dtype, packed.device))
    rows = [int(qs.shape[0]) for _, qs in states]
    route = device_route(x2d.device, x2d.shape[0], x2d.shape[1], sum(rows))
    config = route.config
    if (route.path != "fused" or not config.mma or len(set(formats)) != 1 or formats[0][-1] != x2d.device
            or not _fused_supported(formats[0][0], x2d.shape[1], x2d)
            or not mma_supported(x2d, x2d.shape[1], formats[0][0], config)
            or any(count % config.block_n for count in rows[:-1])):
        return None
    if split_taken(x2d.shape[1] // config.block_k, config.split_k) > 1:
        config = config._replace(fold=True)
    return GroupPlan(config, layouts)


def linear_group(x2d, states, plan):
    """The outputs (rows, out_j) of ``x2d`` against each weight [(packed, quant_state)], one launch as
    ``plan`` (from ``group_plan``) says."""
    x2d = _rows_contiguous(x2d)
    _, blocksize, nested, blocksize2, _ = plan.layouts[0]
    rows = [int(qs.shape[0]) for _, qs in states]
    fp4 = states[0][1].quant_type == "fp4"
    packed = [quantstate.packed_bytes(p) for p, _ in states]
    tables = [layout[4] for layout in plan.layouts]
    if torch.compiler.is_compiling():
        return torch.ops.nf4_triton.linear_group(x2d, packed, *(list(column) for column in zip(*tables)), rows,
                                                 blocksize, blocksize2, nested, fp4, [int(value) for value in plan.config])
    return _launch_group(x2d, packed, tables, rows, blocksize, blocksize2, nested, fp4, plan.config)


def _rows_contiguous(x2d):
    """x2d itself where its rows are whole and unit-strided (what the kernels read), else a contiguous copy."""
    if x2d.stride(-1) != 1 or (x2d.shape[0] > 1 and x2d.stride(0) < x2d.shape[1]):
        return x2d.contiguous()
    return x2d


def _launch_linear(x2d, packed, tables, bias, out_features, blocksize, blocksize2, nested, fp4, config):
    """Allocate one weight's output and launch the fused kernel into it."""
    y = torch.empty((x2d.shape[0], out_features), dtype=x2d.dtype, device=x2d.device)
    return launch_fused(x2d, packed, tables, bias, y, n=out_features, k=x2d.shape[1], blocksize=blocksize,
                        blocksize2=blocksize2, nested=nested, fp4=fp4, config=config)


def _launch_group(x2d, packed, tables, rows, blocksize, blocksize2, nested, fp4, config):
    """Allocate each weight's output and launch the fused kernel over all of them."""
    outs = [torch.empty((x2d.shape[0], count), dtype=x2d.dtype, device=x2d.device) for count in rows]
    launch_fused(x2d, packed[0], tables[0], None, outs[0], n=sum(rows), k=x2d.shape[1], blocksize=blocksize,
                 blocksize2=blocksize2, nested=nested, fp4=fp4, config=config,
                 members=tuple(zip(packed[1:], tables[1:], outs[1:])))
    return outs


def linear_by_route(x, packed, qs, bias, route):
    """``nf4_linear`` through the given Route (tests and benchmarks force each one; the drop-in's
    call, its layer checked). x's dtype and features and the bias are checked here, the weight's
    layout where the fused kernel reads it. A non-contiguous bias is read contiguous; x or a bias
    that requires grad, with grad enabled, takes dequantize + F.linear (autograd) instead of the
    fused kernel; so does bf16 x under Triton's interpreter, whose tl.dot of bf16 is wrong (3.9)."""
    _require(isinstance(route, Route), f"route must be a matmul.Route, got {type(route).__name__}", "linear_by_route")
    out_features, in_features = (int(dim) for dim in qs.shape)
    check_call(x, bias, out_features, in_features, "linear_by_route")
    return linear_unchecked(x, packed, qs, bias, route, out_features, in_features)


def linear_unchecked(x, packed, qs, bias, route, out_features, in_features):
    """``linear_by_route`` for arguments its caller checked as it does (x's dtype and features, the bias'
    shape, dtype and device, a Route): ``nf4_linear`` and the drop-in, 6 us a call less."""
    path = route.path
    if path == "bitsandbytes" and (INTERPRET or torch.compiler.is_compiling()):
        path = "dequantize"  # its kernels run on CUDA tensors, and outside a compiled graph
    if in_features == 0 or (path == "fused" and torch.is_grad_enabled() and (
            x.requires_grad or (bias is not None and bias.requires_grad))):
        path = "dequantize"
    if path != "dequantize":
        lead = x.shape[:-1]
        x2d = _rows_contiguous(x.reshape(-1, in_features))
    if path == "fused":
        _, blocksize, nested, blocksize2, tables = quantstate.checked_state(packed, qs)
        if x2d.numel() == 0 or out_features == 0 or not _fused_supported(blocksize, in_features, x2d):
            path = "dequantize"
        elif (taken := route_taken(x2d, out_features, blocksize, route)) is not route:
            return linear_unchecked(x, packed, qs, bias, taken, out_features, in_features)
        elif INTERPRET and x2d.dtype is torch.bfloat16 and route.config.dot:
            path = "dequantize"
    if path == "bitsandbytes":
        import bitsandbytes

        return bitsandbytes.matmul_4bit(x2d, packed, quant_state=qs, bias=bias).reshape(*lead, out_features)
    if path == "dequantize":
        return F.linear(x, decoded_weight(packed, qs, x.dtype), bias)
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()  # the kernels read it with unit stride
    if torch.compiler.is_compiling():
        absmax, code, absmax2, code2, offset = tables
        y = torch.ops.nf4_triton.linear(x2d, quantstate.packed_bytes(packed), absmax, code, absmax2, code2, offset, bias,
                                        out_features, blocksize, blocksize2, nested, qs.quant_type == "fp4",
                                        [int(value) for value in route.config])
        return y.reshape(*lead, out_features)
    y = _launch_linear(x2d, quantstate.packed_bytes(packed), tables, bias, out_features, blocksize, blocksize2, nested,
                       qs.quant_type == "fp4", route.config)
    return y.reshape(*lead, out_features)


def route_taken(x2d, out_features, blocksize, route):
    """The route a call of x2d (rows, in) takes: ``route``, or where it is mma.py's and that kernel cannot
    run the call, the ``tl`` table's route for the same call (which may be bitsandbytes'). Not the
    fallbacks to dequantize of ``linear_by_route`` (an empty call, a layout the fused kernels do not
    read, bitsandbytes under the interpreter or torch.compile)."""
    if route.path == "fused" and route.config.mma and not mma_supported(x2d, x2d.shape[1], blocksize, route.config):
        return device_route(x2d.device, x2d.shape[0], x2d.shape[1], out_features, TL_ROUTES)
    return route


def decoded_weight(packed, qs, dtype):
    """W (out, in) in ``dtype``, each value rounded once from its fp32 decode."""
    if qs.dtype is not dtype:
        qs = copy.copy(qs)  # the caller's state is not touched
        qs.dtype = torch.float32
    weight = kernel.dequantize_nf4(packed, qs)
    if packed.dim() > 0 and packed.shape[0] == 1:
        weight = weight.t()  # dequantize returns a one-row packed weight transposed (bitsandbytes' rule)
    return weight.to(dtype)


# --------------------------------------------------------------------------------------------
# torch.compile: the fused kernel as a torch.library operator
# --------------------------------------------------------------------------------------------
def _linear_op(
    x: torch.Tensor,
    packed: torch.Tensor,
    absmax: torch.Tensor,
    code: torch.Tensor,
    absmax2: torch.Tensor,
    code2: torch.Tensor,
    offset: torch.Tensor,
    bias: typing.Optional[torch.Tensor],
    out_features: int,
    blocksize: int,
    blocksize2: int,
    nested: bool,
    fp4: bool,
    config: list[int],
) -> torch.Tensor:
    """The operator's body: ``linear_by_route``'s launch (inputs validated by ``nf4_linear``)."""
    return _launch_linear(x, packed, (absmax, code, absmax2, code2, offset), bias, out_features, blocksize, blocksize2,
                          nested, fp4, _config_of(config))


_BOOL_FIELDS = tuple(name for name, kind in MatmulConfig.__annotations__.items() if kind is bool)


def _config_of(values):
    """A MatmulConfig from the operator's list of ints (its bool fields travel as 0 or 1)."""
    config = MatmulConfig._make(values)
    return config._replace(**{name: bool(getattr(config, name)) for name in _BOOL_FIELDS})


def _linear_op_fake(x, packed, absmax, code, absmax2, code2, offset, bias, out_features, blocksize, blocksize2,
                    nested, fp4, config):
    return x.new_empty((x.shape[0], out_features))


_linear_custom_op = torch.library.custom_op("nf4_triton::linear", _linear_op, mutates_args=())
_linear_custom_op.register_fake(_linear_op_fake)


def _linear_group_op(
    x: torch.Tensor,
    packed: list[torch.Tensor],
    absmax: list[torch.Tensor],
    code: list[torch.Tensor],
    absmax2: list[torch.Tensor],
    code2: list[torch.Tensor],
    offset: list[torch.Tensor],
    out_features: list[int],
    blocksize: int,
    blocksize2: int,
    nested: bool,
    fp4: bool,
    config: list[int],
) -> list[torch.Tensor]:
    """``linear_group``'s launch as an operator (inputs validated by ``group_plan``)."""
    return _launch_group(x, packed, list(zip(absmax, code, absmax2, code2, offset)), out_features, blocksize,
                         blocksize2, nested, fp4, _config_of(config))


def _linear_group_op_fake(x, packed, absmax, code, absmax2, code2, offset, out_features, blocksize, blocksize2,
                          nested, fp4, config):
    return [x.new_empty((x.shape[0], count)) for count in out_features]


_linear_group_custom_op = torch.library.custom_op("nf4_triton::linear_group", _linear_group_op, mutates_args=())
_linear_group_custom_op.register_fake(_linear_group_op_fake)
