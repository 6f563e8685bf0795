"""The Gluon helpers that ``mma_sync.py``'s and ``wgmma.py``'s kernels share: index tensors in a tile's layouts,
the permutation into the mma's K order, a step's loads, a group launch's member, and the decode of a step's
weights with ``kernel.py``'s arithmetic.

A code's value comes from a warp shuffle: lane ``l`` holds ``codebook[l % 16]``, and ``shfl.sync.idx`` reads only the
low 5 bits of its index, so a word shifted right by ``4 j`` is the index of its nibble ``j`` without a mask. Then
kernel.py's arithmetic: the fp32 product ``code * scale`` (``mul.rn.ftz``) rounded once to x's dtype (one ``cvt`` for
two weights). Each weight is bit for bit ``dequantize_nf4``'s; only the order of the fp32 sums differs.

Needs Gluon (Triton 3.6 on): imported only where ``mma_layouts.AVAILABLE``.
"""

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

__all__ = ["along", "along6", "mma_order", "batched_mma_order", "chunked_ptrs", "step_loads", "member",
           "codebook_lanes", "decoded", "barrier", "weight_indices", "store_sums"]


@triton.constexpr_function
def _sliced_but(dim, layout):
    """``layout`` (5-D) sliced along every dimension but ``dim``, the last first: an arange along ``dim``'s layout."""
    for axis in range(4, -1, -1):
        if axis != dim:
            layout = gl.SliceLayout(axis, layout)
    return layout


@gluon.jit
def along(n: gl.constexpr, dim: gl.constexpr, layout: gl.constexpr):
    """arange(n) along dimension ``dim`` of a 5-D layout, shaped to broadcast against it."""
    v = gl.arange(0, n, layout=_sliced_but(dim, layout))
    for axis in gl.static_range(5):
        if axis != dim:
            v = gl.expand_dims(v, axis)
    return v


@gluon.jit
def along6(n: gl.constexpr, dim: gl.constexpr, layout: gl.constexpr):
    """arange(n) along dimension ``dim`` of a 6-D layout, shaped to broadcast against it."""
    if dim == 0:
        return gl.expand_dims(along(n, 0, gl.SliceLayout(5, layout)), 5)
    else:
        return gl.expand_dims(along(n, dim - 1, gl.SliceLayout(0, layout)), 0)

@gluon.jit
def mma_order(values, ROWS: gl.constexpr, BLOCK_K: gl.constexpr, WORDS: gl.constexpr):
    """[ROWS, chunk, t, word, code] in column order -> [ROWS, BLOCK_K] in the mma's K order."""
    values = gl.reshape(values, [ROWS, BLOCK_K // (32 * WORDS), 4, WORDS, 2, 2, 2])  # row, chunk, t, word, s % 2, p, q
    values = gl.permute(values, [0, 1, 3, 4, 5, 2, 6])  # row, chunk, s // 2, s % 2, p, t, q
    return gl.reshape(values, [ROWS, BLOCK_K])

@gluon.jit
def batched_mma_order(values, KWARPS: gl.constexpr, ROWS: gl.constexpr, BLOCK_K: gl.constexpr, WORDS: gl.constexpr):
    """[slice, ROWS, chunk, t, word, code] in column order -> [slice, ROWS, BLOCK_K] in the mma's K order."""
    values = gl.reshape(values, [KWARPS, ROWS, BLOCK_K // (32 * WORDS), 4, WORDS, 2, 2, 2])
    values = gl.permute(values, [0, 1, 2, 4, 5, 6, 3, 7])
    return gl.reshape(values, [KWARPS, ROWS, BLOCK_K])

@gluon.jit
def chunked_ptrs(x_ptr, first_row, stride_xm, ROWS: gl.constexpr, CHUNKS: gl.constexpr, WORDS: gl.constexpr,
                  LAYOUT: gl.constexpr):
    """(row, pointer) of x's [ROWS, chunk, t, word, code] in ``LAYOUT``: thread t's 8 WORDS columns of a chunk."""
    row = first_row + along(ROWS, 0, LAYOUT)
    return row, (x_ptr + row * stride_xm + along(CHUNKS, 1, LAYOUT) * (32 * WORDS) + along(4, 2, LAYOUT) * (8 * WORDS)
                 + along(WORDS, 3, LAYOUT) * 8 + along(8, 4, LAYOUT))

@gluon.jit
def step_loads(word_ptrs, block, row_block, absmax_ptr, absmax2_ptr, k0, BLOCKSIZE: gl.constexpr,
                BLOCKSIZE2: gl.constexpr, NESTED: gl.constexpr, BLOCK_K: gl.constexpr, WORDS_POLICY: gl.constexpr):
    """A step's weight loads: (words, absmax, absmax2 where NESTED, else absmax again); the words' loads with
    ``WORDS_POLICY`` ("evict_first", or "" for none)."""
    step_block = block + k0 // BLOCKSIZE
    absmax = gl.load(absmax_ptr + step_block)
    absmax2 = absmax
    if NESTED:
        if BLOCK_K <= BLOCKSIZE * BLOCKSIZE2:  # a row's blocks of a step share one absmax2
            absmax2 = gl.load(absmax2_ptr + (row_block + k0 // BLOCKSIZE) // BLOCKSIZE2)
        else:
            absmax2 = gl.load(absmax2_ptr + step_block // BLOCKSIZE2)
    return gl.load(word_ptrs + k0 // 8, eviction_policy=WORDS_POLICY), absmax, absmax2

@gluon.jit
def member(pid_n, BLOCK_N: gl.constexpr, MEMBERS: gl.constexpr, N, rows0, rows1, weight, m1, m2):
    """(first output row, rows, (packed, absmax, code, absmax2, code2, offset, out) pointers) of the member
    whose rows hold output tile ``pid_n``; ``weight``, ``m1`` and ``m2``: each member's pointers."""
    member_start = pid_n * 0
    member_rows = N + 0
    if MEMBERS > 1:
        if pid_n * BLOCK_N < rows0:
            member_rows = rows0 + 0
        elif MEMBERS == 2 or pid_n * BLOCK_N < rows0 + rows1:
            member_start, member_rows, weight = rows0 + 0, rows1 + 0, m1
        else:
            member_start, member_rows, weight = rows0 + rows1, N - rows0 - rows1, m2
    return member_start, member_rows, weight

@gluon.jit
def codebook_lanes(code_ptr, like, FP4: gl.constexpr):
    """Each lane's codebook[lane % 16] in ``like``'s shape and layout: the shuffle's table, one register."""
    lane = gl.inline_asm_elementwise("mov.u32 $0, %laneid;", "=r,r", [like], dtype=gl.int32, is_pure=True, pack=1) % 16
    entry = gl.load(code_ptr + lane)
    if FP4:  # bitsandbytes forms an FP4 value as sign * magnitude: code 8 is -0.0
        entry = (entry.to(gl.uint32, bitcast=True) | ((lane >> 3).to(gl.uint32) << 31)).to(gl.float32, bitcast=True)
    return entry

@gluon.jit
def decoded(words, shifts, entry, absmax, absmax2, code2_ptr, offset, NESTED: gl.constexpr, X_DTYPE: gl.constexpr):
    """A step's weights in x's dtype, each kernel.py's: code * scale in fp32 (ftz), rounded once."""
    if NESTED:  # kernel.py's absmax decode: code2[absmax] * absmax2 (ftz), + offset; code2 stays in L1
        scale = gl.inline_asm_elementwise(
            "{.reg .f32 t; mul.rn.ftz.f32 t, $1, $2; add.rn.f32 $0, t, $3;}", "=r,r,r,r",
            [gl.load(code2_ptr + absmax.to(gl.int32)), absmax2, offset], dtype=gl.float32, is_pure=True, pack=1)
    else:
        scale = absmax
    codes = words >> shifts  # the shuffle reads bits 4:0: nibble j, and a bit of the next
    if X_DTYPE == gl.bfloat16:
        weights = gl.inline_asm_elementwise(
            "{.reg .b32 a, b; shfl.sync.idx.b32 a, $3, $1, 0x1f, -1; shfl.sync.idx.b32 b, $4, $2, 0x1f, -1;"
            " mul.rn.ftz.f32 a, a, $5; mul.rn.ftz.f32 b, b, $6; cvt.rn.bf16x2.f32 $0, b, a;}",
            "=r,r,r,r,r,r,r", [codes, entry, scale], dtype=gl.bfloat16, is_pure=True, pack=2)
    else:
        weights = gl.inline_asm_elementwise(
            "{.reg .b32 a, b; shfl.sync.idx.b32 a, $3, $1, 0x1f, -1; shfl.sync.idx.b32 b, $4, $2, 0x1f, -1;"
            " mul.rn.ftz.f32 a, a, $5; mul.rn.ftz.f32 b, b, $6; cvt.rn.f16x2.f32 $0, b, a;}",
            "=r,r,r,r,r,r,r", [codes, entry, scale], dtype=gl.float16, is_pure=True, pack=2)
    return weights


barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier  # its name before Triton 3.7


@gluon.jit
def weight_indices(pid_n, member_start, member_rows, packed_ptr, code_ptr, K, BLOCK_N: gl.constexpr,
                   BLOCK_K: gl.constexpr, BLOCKSIZE: gl.constexpr, WORDS: gl.constexpr, FP4: gl.constexpr,
                   USE_INT64: gl.constexpr, W_LAYOUT: gl.constexpr):
    """(word pointers, the codes' shifts, each row's first block, each thread's block, its codebook entry) of a
    program's weight rows, [BLOCK_N, chunk, t, word, code] once broadcast. Rows past the member's read its last row
    (no masks in the loop); their sums are not stored."""
    CHUNKS: gl.constexpr = BLOCK_K // (32 * WORDS)
    row = gl.minimum(pid_n * BLOCK_N - member_start + along(BLOCK_N, 0, W_LAYOUT), member_rows - 1)
    if USE_INT64:
        row = row.to(gl.int64)
    chunk = along(CHUNKS, 1, W_LAYOUT)
    quad = along(4, 2, W_LAYOUT)
    # (K // (8 WORDS)) * WORDS: the compiler sees that a row's words start WORDS-aligned (16-byte loads)
    word_ptrs = (packed_ptr.to(gl.pointer_type(gl.int32)) + row * (K // (8 * WORDS)) * WORDS
                 + chunk * (4 * WORDS) + quad * WORDS + along(WORDS, 3, W_LAYOUT))
    element = along(8, 4, W_LAYOUT)
    shifts = 8 * (element // 2) + 4 * (1 - element % 2)  # element 2j is byte j's high nibble
    # a thread's 8 WORDS columns of a chunk lie in one block (BLOCKSIZE >= 32 where WORDS is 4)
    row_block = row * (K // BLOCKSIZE)
    block = row_block + (chunk * (32 * WORDS) + quad * (8 * WORDS)) // BLOCKSIZE
    entry = codebook_lanes(code_ptr, gl.full([1, 1, 1, 1, 1], 0, gl.int32, W_LAYOUT), FP4)
    return word_ptrs, shifts, row_block, block, entry


@gluon.jit
def store_sums(acc, pid_n, pid_m, pid_k, M, N, bias_ptr, out_base, member_start, member_rows, partial_ptr,
               counter_ptr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, SPLIT_K: gl.constexpr, FOLD: gl.constexpr,
               HAS_BIAS: gl.constexpr, X_DTYPE: gl.constexpr, MMA: gl.constexpr):
    """A program's fp32 sums [BLOCK_N, BLOCK_M] out: in x's dtype (with the bias), or as its split's partial sums,
    which the tile's last program to store adds in split_k_reduce_kernel's order where FOLD."""
    n = gl.expand_dims(pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, MMA)), 1)
    m = gl.expand_dims(pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, MMA)), 0)
    out_mask = (m < M) & (n < N)
    if SPLIT_K > 1:
        partial = partial_ptr + m * N + n
        gl.store(partial + pid_k.to(gl.int64) * M * N, acc, mask=out_mask)
        if FOLD:
            barrier()  # every thread's partial sums stored before the count's release (a gpu-scope fence)
            tile = pid_m * gl.num_programs(0) + pid_n
            arrived = gl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K - 1:  # the tile's last program: split_k_reduce_kernel's sum, in its order
                total = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, MMA)
                for split in gl.static_range(SPLIT_K):
                    total += gl.load(partial + split * M * N, mask=out_mask, other=0.0, cache_modifier=".cg")
                if HAS_BIAS:
                    total += gl.load(bias_ptr + n, mask=n < N, other=0.0).to(gl.float32)
                gl.store(out_base + m * member_rows + (n - member_start), total.to(X_DTYPE), mask=out_mask)
                gl.atomic_xchg(counter_ptr + tile, 0, sem="relaxed", scope="gpu")  # zero for the next launch
    else:
        if HAS_BIAS:
            acc += gl.load(bias_ptr + n, mask=n < N, other=0.0).to(gl.float32)
        gl.store(out_base + m * member_rows + (n - member_start), acc.to(X_DTYPE), mask=out_mask)
