"""The fused NF4 matmul's ``mma.sync`` kernels (Gluon, sm_80 on): each weight decoded straight into the register
fragment ``mma.sync.m16n8k16`` reads (``mma_layouts.py``), from bitsandbytes' bytes as they are.

``nf4_mma_kernel``: x's tile read once a program into shared memory, coalesced, and read back in the fragments'
order; or, from one to four rows (``STAGE_X`` off), each warp reads its fragments from global memory itself, the
padding rows past M never read. ``PREFETCH`` issues a step's loads during the step before. Split-K programs store
fp32 partial sums, which ``matmul``'s reduction adds, or (``FOLD``) the tile's last program adds.

``nf4_mma_kwarps_kernel`` splits K inside a program instead of across programs: each of its warps sums one K slice
of the same 16 weight rows (mma.sync batched over the warps) and the slices' sums meet in shared memory, so no
program waits on another's (the folded split-K sum costs a merged decoder layer 7 us at one row, NOTES.md item 98).

Up to three weights read by the same x (``MEMBERS``: q, k and v, or gate and up) run as one launch, their rows one
after another in the output tiles; each program takes its member's pointers by its rows, so every member's sums are
those it would get alone with the same tile.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from nf4_triton.mma_helpers import (
    along6,
    barrier,
    batched_mma_order,
    chunked_ptrs,
    codebook_lanes,
    decoded,
    member,
    mma_order,
    step_loads,
    store_sums,
    weight_indices,
)

__all__ = ["nf4_mma_kernel", "nf4_mma_kwarps_kernel"]


@gluon.jit
def nf4_mma_kernel(
    # inputs
    x_ptr,  # [M, K] fp16 or bf16 activations (row stride stride_xm, unit column stride)
    packed_ptr,  # the weight [N, K] row-major, two codes per byte, high nibble first (4-byte aligned)
    absmax_ptr,  # uint8 [N * K / BLOCKSIZE] when NESTED, else fp32
    code_ptr,  # fp32 [16], the 4-bit codebook (NF4 or FP4)
    absmax2_ptr,  # fp32 [ceil(n_blocks / BLOCKSIZE2)] (NESTED only)
    code2_ptr,  # fp32 [256] (NESTED only)
    offset_ptr,  # fp32 [1] (NESTED only)
    bias_ptr,  # [N] in x's dtype (HAS_BIAS only)
    # outputs
    out_ptr,  # [M, N] in x's dtype (member 0's [M, rows0]; where SPLIT_K > 1, written here with FOLD only)
    partial_ptr,  # fp32 [SPLIT_K, M, N], each program's partial sums (SPLIT_K > 1)
    counter_ptr,  # int32, one per output tile: its programs that have stored; zero before and after (FOLD)
    # sizes
    M,  # rows of x
    N,  # output features (rows of the weight, of all members)
    K,  # input features, a multiple of BLOCK_K
    stride_xm,  # elements between rows of x
    # more weights read by the same x, one launch (MEMBERS > 1): member j's rows follow member j - 1's
    # in the output tiles, each a multiple of BLOCK_N but the last; this call's weight is member 0
    rows0,  # weight rows of member 0
    rows1,  # weight rows of member 1 (member 2 has the rest of N)
    m1_packed_ptr, m1_absmax_ptr, m1_code_ptr, m1_absmax2_ptr, m1_code2_ptr, m1_offset_ptr,  # member 1's
    m1_out_ptr,  # [M, rows1] member 1's output (SPLIT_K == 1 or FOLD)
    m2_packed_ptr, m2_absmax_ptr, m2_code_ptr, m2_absmax2_ptr, m2_code2_ptr, m2_offset_ptr,  # member 2's
    m2_out_ptr,  # [M, N - rows0 - rows1] member 2's output
    # format
    BLOCKSIZE: gl.constexpr,  # elements per absmax (a power of two >= 16)
    BLOCKSIZE2: gl.constexpr,  # absmax values per absmax2 (NESTED only)
    NESTED: gl.constexpr,  # double-quantized absmax
    FP4: gl.constexpr,  # quant_type="fp4"
    X_DTYPE: gl.constexpr,  # gl.float16 or gl.bfloat16: activations, decoded weight and output
    # implementation
    BLOCK_M: gl.constexpr,  # rows of x per program (a multiple of 8)
    BLOCK_N: gl.constexpr,  # weight rows per program (16 * num_warps * repeats)
    BLOCK_K: gl.constexpr,  # columns per step (a multiple of 32 * WORDS)
    SPLIT_K: gl.constexpr,  # programs sharing one output tile along K (fp32 partials when > 1)
    STEPS_PER_SPLIT: gl.constexpr,  # BLOCK_K steps per program
    HAS_BIAS: gl.constexpr,  # add bias (where this kernel writes out)
    FOLD: gl.constexpr,  # SPLIT_K > 1: the tile's last program to store adds the partials, not a second kernel
    USE_INT64: gl.constexpr,  # 64-bit offsets into the weight
    WORDS: gl.constexpr,  # words of a row each thread holds a chunk: 2 (64-column chunks) or 4 (128)
    STAGE_X: gl.constexpr,  # x's tile through shared memory, else each warp's fragments from global memory
    PREFETCH: gl.constexpr,  # a step's loads issued during the step before
    UNROLL: gl.constexpr,  # steps of the K loop in one unrolled body (a divisor of STEPS_PER_SPLIT)
    WORDS_POLICY: gl.constexpr,  # the words' loads' eviction policy: "evict_first" (L1 and L2) or ""
    MEMBERS: gl.constexpr,  # weights in this launch, 1 to 3 (no bias where more than 1)
    W_LAYOUT: gl.constexpr,  # layouts(...)[0]
    X_LAYOUT: gl.constexpr,  # layouts(...)[1]
    MMA: gl.constexpr,  # layouts(...)[2]
    X_GLOBAL: gl.constexpr,  # x_staging(...)[0]: x's loads, where staged
    X_SHARED: gl.constexpr,  # x_staging(...)[1]
    X_FRAGMENTS: gl.constexpr,  # x_staging(...)[2]
):
    CHUNKS: gl.constexpr = BLOCK_K // (32 * WORDS)
    pid_n = gl.program_id(0)
    pid_m = gl.program_id(1)
    pid_k = gl.program_id(2)
    first = pid_k * STEPS_PER_SPLIT

    # This program's member: its first row among the output's, its rows, its weight and output.
    member_start, member_rows, weight = member(
        pid_n, BLOCK_N, MEMBERS, N, rows0, rows1,
        (packed_ptr, absmax_ptr, code_ptr, absmax2_ptr, code2_ptr, offset_ptr, out_ptr),
        (m1_packed_ptr, m1_absmax_ptr, m1_code_ptr, m1_absmax2_ptr, m1_code2_ptr, m1_offset_ptr, m1_out_ptr),
        (m2_packed_ptr, m2_absmax_ptr, m2_code_ptr, m2_absmax2_ptr, m2_code2_ptr, m2_offset_ptr, m2_out_ptr))
    packed_ptr, absmax_ptr, code_ptr, absmax2_ptr, code2_ptr, offset_ptr, out_base = weight
    word_ptrs, shifts, row_block, block, entry = weight_indices(
        pid_n, member_start, member_rows, packed_ptr, code_ptr, K, BLOCK_N, BLOCK_K, BLOCKSIZE, WORDS, FP4, USE_INT64,
        W_LAYOUT)

    if STAGE_X:  # x's tile through shared memory: read once a program, coalesced
        x_row = gl.expand_dims(pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, X_GLOBAL)), 1)
        x_ptrs = (x_ptr + x_row * stride_xm
                  + gl.expand_dims(gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, X_GLOBAL)), 0))
        x_tile = gl.allocate_shared_memory(X_DTYPE, [BLOCK_M, BLOCK_K], X_SHARED)
    else:  # each warp reads its fragments itself, a thread's 8 WORDS columns of a chunk at once; rows past M unread
        x_row, x_ptrs = chunked_ptrs(x_ptr, pid_m * BLOCK_M, stride_xm, BLOCK_M, CHUNKS, WORDS, X_LAYOUT)
    x_mask = x_row < M

    if NESTED:
        offset = gl.load(offset_ptr)
    else:
        offset = 0.0  # unread
    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, MMA)
    if PREFETCH:  # a step's loads issued a step ahead, carried in registers
        words, absmax, absmax2 = step_loads(word_ptrs, block, row_block, absmax_ptr, absmax2_ptr, first * BLOCK_K,
                                            BLOCKSIZE, BLOCKSIZE2, NESTED, BLOCK_K, WORDS_POLICY)
        x = gl.load(x_ptrs + first * BLOCK_K, mask=x_mask, other=0.0)
    for outer in range(STEPS_PER_SPLIT // UNROLL):
        for inner in gl.static_range(UNROLL):  # UNROLL steps in one body: loads hoisted past the last step's math
            step = outer * UNROLL + inner
            k0 = (first + step) * BLOCK_K
            if not PREFETCH:
                words, absmax, absmax2 = step_loads(word_ptrs, block, row_block, absmax_ptr, absmax2_ptr, k0,
                                                    BLOCKSIZE, BLOCKSIZE2, NESTED, BLOCK_K, WORDS_POLICY)
            if PREFETCH:  # the last step loads itself again: in bounds, unused
                k_next = (first + gl.minimum(step + 1, STEPS_PER_SPLIT - 1)) * BLOCK_K
                next_words, next_absmax, next_absmax2 = step_loads(word_ptrs, block, row_block, absmax_ptr,
                                                                   absmax2_ptr, k_next, BLOCKSIZE, BLOCKSIZE2,
                                                                   NESTED, BLOCK_K, WORDS_POLICY)
                next_x = gl.load(x_ptrs + k_next, mask=x_mask, other=0.0)
            weights = decoded(words, shifts, entry, absmax, absmax2, code2_ptr, offset, NESTED, X_DTYPE)
            a = gl.convert_layout(mma_order(weights, BLOCK_N, BLOCK_K, WORDS), gl.DotOperandLayout(0, MMA, 2),
                                  assert_trivial=True)
            if not PREFETCH:
                x = gl.load(x_ptrs + k0, mask=x_mask, other=0.0)
            if STAGE_X:
                barrier()  # every warp has read the last step's tile
                x_tile.store(x)
                barrier()
                x = gl.convert_layout(gl.reshape(x_tile.load(X_FRAGMENTS), [BLOCK_M, CHUNKS, 4, WORDS, 8]),
                                      X_LAYOUT, assert_trivial=True)
            b = gl.convert_layout(gl.permute(mma_order(x, BLOCK_M, BLOCK_K, WORDS), [1, 0]),
                                  gl.DotOperandLayout(1, MMA, 2), assert_trivial=True)
            acc = mma_v2(a, b, acc)
            if PREFETCH:
                words, absmax, absmax2, x = next_words, next_absmax, next_absmax2, next_x

    store_sums(acc, pid_n, pid_m, pid_k, M, N, bias_ptr, out_base, member_start, member_rows, partial_ptr, counter_ptr,
               BLOCK_N, BLOCK_M, SPLIT_K, FOLD, HAS_BIAS, X_DTYPE, MMA)


@gluon.jit
def nf4_mma_kwarps_kernel(
    # inputs, outputs and sizes as nf4_mma_kernel's (no split-K scratch)
    x_ptr, packed_ptr, absmax_ptr, code_ptr, absmax2_ptr, code2_ptr, offset_ptr, bias_ptr,
    out_ptr,  # [M, N] in x's dtype (member 0's [M, rows0])
    M, N, K, stride_xm,
    rows0, rows1,  # member 0's and member 1's weight rows (MEMBERS > 1)
    m1_packed_ptr, m1_absmax_ptr, m1_code_ptr, m1_absmax2_ptr, m1_code2_ptr, m1_offset_ptr, m1_out_ptr,
    m2_packed_ptr, m2_absmax_ptr, m2_code_ptr, m2_absmax2_ptr, m2_code2_ptr, m2_offset_ptr, m2_out_ptr,
    # format
    BLOCKSIZE: gl.constexpr, BLOCKSIZE2: gl.constexpr, NESTED: gl.constexpr, FP4: gl.constexpr,
    X_DTYPE: gl.constexpr,
    # implementation
    BLOCK_M: gl.constexpr,  # rows of x per program (a multiple of 8)
    BLOCK_N: gl.constexpr,  # weight rows per program: one warp's (16 * repeats)
    BLOCK_K: gl.constexpr,  # columns per step (a multiple of 32 * WORDS)
    KWARPS: gl.constexpr,  # warps per program, warp w summing K slice w (K / KWARPS columns)
    STEPS_PER_WARP: gl.constexpr,  # BLOCK_K steps per slice
    HAS_BIAS: gl.constexpr, USE_INT64: gl.constexpr,
    WORDS: gl.constexpr,  # words of a row each thread holds a chunk: 2 or 4
    UNROLL: gl.constexpr,  # steps in one unrolled loop body (a divisor of STEPS_PER_WARP)
    WORDS_POLICY: gl.constexpr,  # as nf4_mma_kernel's
    ACCUMULATORS: gl.constexpr,  # 1, or 2: a body's odd steps summed apart from its even ones, added at the end
    MEMBERS: gl.constexpr,  # weights in this launch, 1 to 3 (no bias where more than 1)
    W_LAYOUT: gl.constexpr,  # kwarps_layouts(...)[0]
    X_LAYOUT: gl.constexpr,  # kwarps_layouts(...)[1]
    MMA: gl.constexpr,  # kwarps_layouts(...)[2]
):
    """nf4_mma_kernel's one-row form without split-K: a program's warps take the K slices of the same weight
    rows (each its words, scales and x, unstaged), and their sums are added through shared memory at the end,
    no fold between programs (mma_fold.log: the fold costs a merged layer 7 us at one row)."""
    CHUNKS: gl.constexpr = BLOCK_K // (32 * WORDS)
    pid_n = gl.program_id(0)
    pid_m = gl.program_id(1)
    member_start, member_rows, weight = member(
        pid_n, BLOCK_N, MEMBERS, N, rows0, rows1,
        (packed_ptr, absmax_ptr, code_ptr, absmax2_ptr, code2_ptr, offset_ptr, out_ptr),
        (m1_packed_ptr, m1_absmax_ptr, m1_code_ptr, m1_absmax2_ptr, m1_code2_ptr, m1_offset_ptr, m1_out_ptr),
        (m2_packed_ptr, m2_absmax_ptr, m2_code_ptr, m2_absmax2_ptr, m2_code2_ptr, m2_offset_ptr, m2_out_ptr))
    packed_ptr, absmax_ptr, code_ptr, absmax2_ptr, code2_ptr, offset_ptr, out_base = weight

    # [KWARPS, BLOCK_N, CHUNKS, 4, WORDS, 8] once broadcast; warp w's columns start at w * K / KWARPS
    first = along6(KWARPS, 0, W_LAYOUT) * (STEPS_PER_WARP * BLOCK_K)
    row = gl.minimum(pid_n * BLOCK_N - member_start + along6(BLOCK_N, 1, W_LAYOUT), member_rows - 1)
    if USE_INT64:
        row = row.to(gl.int64)
    chunk = along6(CHUNKS, 2, W_LAYOUT)
    quad = along6(4, 3, W_LAYOUT)
    word_ptrs = (packed_ptr.to(gl.pointer_type(gl.int32)) + row * (K // (8 * WORDS)) * WORDS + first // 8
                 + chunk * (4 * WORDS) + quad * WORDS + along6(WORDS, 4, W_LAYOUT))
    element = along6(8, 5, W_LAYOUT)
    shifts = 8 * (element // 2) + 4 * (1 - element % 2)
    row_block = row * (K // BLOCKSIZE) + first // BLOCKSIZE  # the slice's first block of the row
    block = row_block + (chunk * (32 * WORDS) + quad * (8 * WORDS)) // BLOCKSIZE
    entry = codebook_lanes(code_ptr, gl.full([1, 1, 1, 1, 1, 1], 0, gl.int32, W_LAYOUT), FP4)

    x_row = pid_m * BLOCK_M + along6(BLOCK_M, 1, X_LAYOUT)
    x_ptrs = (x_ptr + x_row * stride_xm + along6(KWARPS, 0, X_LAYOUT) * (STEPS_PER_WARP * BLOCK_K)
              + along6(CHUNKS, 2, X_LAYOUT) * (32 * WORDS) + along6(4, 3, X_LAYOUT) * (8 * WORDS)
              + along6(WORDS, 4, X_LAYOUT) * 8 + along6(8, 5, X_LAYOUT))
    x_mask = x_row < M
    if NESTED:
        offset = gl.load(offset_ptr)
    else:
        offset = 0.0  # unread
    acc = gl.zeros([KWARPS, BLOCK_N, BLOCK_M], gl.float32, MMA)
    acc_odd = gl.zeros([KWARPS, BLOCK_N, BLOCK_M], gl.float32, MMA)  # ACCUMULATORS == 2: the odd steps' sums
    for outer in range(STEPS_PER_WARP // UNROLL):
        for inner in gl.static_range(UNROLL):
            k0 = (outer * UNROLL + inner) * BLOCK_K
            words, absmax, absmax2 = step_loads(word_ptrs, block, row_block, absmax_ptr, absmax2_ptr, k0,
                                                 BLOCKSIZE, BLOCKSIZE2, NESTED, BLOCK_K, WORDS_POLICY)
            weights = decoded(words, shifts, entry, absmax, absmax2, code2_ptr, offset, NESTED, X_DTYPE)
            a = gl.convert_layout(batched_mma_order(weights, KWARPS, BLOCK_N, BLOCK_K, WORDS),
                                  gl.DotOperandLayout(0, MMA, 2), assert_trivial=True)
            x = gl.load(x_ptrs + k0, mask=x_mask, other=0.0)
            b = gl.convert_layout(gl.permute(batched_mma_order(x, KWARPS, BLOCK_M, BLOCK_K, WORDS), [0, 2, 1]),
                                  gl.DotOperandLayout(1, MMA, 2), assert_trivial=True)
            if ACCUMULATORS == 2 and inner % 2 == 1:  # two chains of dependent mma.sync, not one
                acc_odd = mma_v2(a, b, acc_odd)
            else:
                acc = mma_v2(a, b, acc)
    if ACCUMULATORS == 2:
        acc += acc_odd
    total = gl.sum(acc, axis=0)  # the slices' sums, through shared memory
    OUT: gl.constexpr = gl.SliceLayout(0, MMA)
    n = gl.expand_dims(pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, OUT)), 1)
    m = gl.expand_dims(pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, OUT)), 0)
    if HAS_BIAS:
        total += gl.load(bias_ptr + n, mask=n < N, other=0.0).to(gl.float32)
    gl.store(out_base + m * member_rows + (n - member_start), total.to(X_DTYPE), mask=(m < M) & (n < N))
