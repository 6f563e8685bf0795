"""The fused NF4 matmul's warp-group kernel (Gluon, sm_90): the weight decoded into the register fragments that are
``wgmma``'s register operand (``mma_layouts.py``), x's tile, stored once a step in the permuted K order to the
128-byte swizzle ``wgmma`` reads, its shared operand. A warp group multiplies its 64 weight rows by up to 256 rows of
x in one instruction, where from 32 rows mma.sync's rate and x's fragment reads bound the product. ``PREFETCH``
issues a step's loads during the step before (after x's store and its proxy fence, which waits for every load a
thread has in flight). Its arguments, members and split-K sums are ``mma_sync.nf4_mma_kernel``'s.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

from nf4_triton.mma_helpers import barrier, chunked_ptrs, decoded, member, mma_order, step_loads, store_sums, weight_indices

__all__ = ["nf4_wgmma_kernel"]


@gluon.jit
def nf4_wgmma_kernel(
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
    BLOCK_N: gl.constexpr,  # weight rows per program (16 * num_warps * repeats; num_warps a multiple of 4)
    BLOCK_K: gl.constexpr,  # columns per step (a multiple of 32 * WORDS)
    SPLIT_K: gl.constexpr,  # programs sharing one output tile along K (fp32 partials when > 1)
    STEPS_PER_SPLIT: gl.constexpr,  # BLOCK_K steps per program
    HAS_BIAS: gl.constexpr,  # add bias (where this kernel writes out)
    FOLD: gl.constexpr,  # SPLIT_K > 1: the tile's last program to store adds the partials, not a second kernel
    USE_INT64: gl.constexpr,  # 64-bit offsets into the weight
    WORDS: gl.constexpr,  # words of a row each thread holds a chunk: 2 (64-column chunks) or 4 (128)
    PREFETCH: gl.constexpr,  # a step's loads issued during the step before
    UNROLL: gl.constexpr,  # steps of the K loop in one unrolled body (a divisor of STEPS_PER_SPLIT)
    WORDS_POLICY: gl.constexpr,  # the words' loads' eviction policy: "evict_first" (L1 and L2) or ""
    MEMBERS: gl.constexpr,  # weights in this launch, 1 to 3 (no bias where more than 1)
    W_LAYOUT: gl.constexpr,  # layouts(..., wgmma=True)[0]
    MMA: gl.constexpr,  # layouts(..., wgmma=True)[2]
    X_GLOBAL: gl.constexpr,  # x_staging(..., wgmma=True)[0]: x's loads
    X_SHARED: gl.constexpr,  # x_staging(..., wgmma=True)[1]
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

    # x's tile in shared memory in the mma's K order, wgmma's operand: 16-byte loads, rows past M zero
    x_row, x_ptrs = chunked_ptrs(x_ptr, pid_m * BLOCK_M, stride_xm, BLOCK_M, CHUNKS, WORDS, X_GLOBAL)
    x_tile = gl.allocate_shared_memory(X_DTYPE, [BLOCK_M, BLOCK_K], X_SHARED)
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
                x = gl.load(x_ptrs + k0, mask=x_mask, other=0.0)
            # x's tile stored before the next step's loads: the proxy fence waits for the thread's loads
            barrier()  # every warp group's wgmma of the last step has read the tile
            x_tile.store(mma_order(x, BLOCK_M, BLOCK_K, WORDS))
            fence_async_shared()  # the stores visible to wgmma's reads
            barrier()
            if PREFETCH:  # the last step loads itself again: in bounds, unused
                k_next = (first + gl.minimum(step + 1, STEPS_PER_SPLIT - 1)) * BLOCK_K
                next_words, next_absmax, next_absmax2 = step_loads(word_ptrs, block, row_block, absmax_ptr,
                                                                   absmax2_ptr, k_next, BLOCKSIZE, BLOCKSIZE2,
                                                                   NESTED, BLOCK_K, WORDS_POLICY)
                next_x = gl.load(x_ptrs + k_next, mask=x_mask, other=0.0)
            weights = decoded(words, shifts, entry, absmax, absmax2, code2_ptr, offset, NESTED, X_DTYPE)
            a = gl.convert_layout(mma_order(weights, BLOCK_N, BLOCK_K, WORDS), gl.DotOperandLayout(0, MMA, 2),
                                  assert_trivial=True)
            acc = warpgroup_mma(a, x_tile.permute((1, 0)), acc)
            if PREFETCH:
                words, absmax, absmax2, x = next_words, next_absmax, next_absmax2, next_x

    store_sums(acc, pid_n, pid_m, pid_k, M, N, bias_ptr, out_base, member_start, member_rows, partial_ptr, counter_ptr,
               BLOCK_N, BLOCK_M, SPLIT_K, FOLD, HAS_BIAS, X_DTYPE, MMA)
