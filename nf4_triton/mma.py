"""The fused NF4 matmul in Gluon: each weight decoded straight into the register fragment that
``mma.sync.m16n8k16`` reads, from bitsandbytes' bytes as they are.

Inside each chunk of K (32 W columns, W = 2 or 4 words a thread) the order of the sum is
permuted, the same way for the weight and for x, so that the codes a thread's A fragments hold
are W contiguous words of one weight row: one load of 4 W bytes and one scale a row and chunk, no
shared memory for the weight and no exchange between threads (the layouts' conversion is
asserted trivial at compile time). x's tile, which every warp needs whole, is read once a program
into shared memory, coalesced, and read back in the fragments' order; or, from one to four rows
(``STAGE_X`` off), each warp reads its fragments from global memory itself, the padding rows past
M never read: fewer L1 wavefronts, where shuffles and x's reads are most of them. Thread ``t`` of a
row quad holds physical columns ``8 W t .. 8 W t + 8 W - 1`` of a chunk; column ``8 W t + 4 s + 2 p + q``
sits in k-step ``s`` at logical column ``16 s + 8 p + 2 t + q``, which is where mma.sync expects
A[g][2t + q] (p = 0) and A[g][2t + 8 + q] (p = 1), and B likewise.

A code's value comes from a warp shuffle: lane ``l`` holds ``codebook[l % 16]``, and
``shfl.sync.idx`` reads only the low 5 bits of its index, so a word shifted right by ``4 j`` is
the index of its nibble ``j`` without a mask. Then kernel.py's arithmetic: the fp32 product
``code * scale`` (``mul.rn.ftz``) rounded once to x's dtype (one ``cvt`` for two weights). Each
weight is bit for bit ``dequantize_nf4``'s; only the order of the fp32 sums differs.

On sm_90 (``WGMMA``) the same fragments are the register operand of ``wgmma``, and x's tile,
stored once a step in the permuted K order to the 128-byte swizzle ``wgmma`` reads, its shared
operand: a warp group multiplies its 64 weight rows by up to 256 rows of x in one instruction,
where from 32 rows mma.sync's rate and x's fragment reads bound the product. ``PREFETCH`` issues a
step's loads during the step before (after x's store and its proxy fence, which waits for every
load a thread has in flight).

Up to three weights read by the same x (``MEMBERS``: q, k and v, or gate and up) run as one launch,
their rows one after another in the output tiles; each program takes its member's pointers by its
rows, so every member's sums are those it would get alone with the same tile.

``nf4_mma_kwarps_kernel`` splits K inside a program instead of across programs: each of its warps sums one K
slice of the same 16 weight rows (mma.sync batched over the warps) and the slices' sums meet in shared memory, so
no program waits on another's (the folded split-K sum costs a merged decoder layer 7 us at one row, NOTES.md
item 98).

Needs Gluon's ``mma_v2`` and linear layouts (Triton 3.6 on), sm_80 on (``WGMMA``: sm_90), fp16 or bf16 x, K a
multiple of the tile's columns and blocks of at least a thread's 8 W columns; ``matmul.py``
routes the rest to its ``tl`` kernel.
"""

import functools

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

    AVAILABLE = hasattr(gl, "DistributedLinearLayout")
    _barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier  # its name before Triton 3.7
except ImportError:  # Triton before 3.6
    AVAILABLE = False

__all__ = ["AVAILABLE", "layouts", "x_staging", "layout_constexprs", "kwarps_layouts", "kwarps_constexprs",
           "nf4_mma_kernel", "nf4_mma_kwarps_kernel"]


def _bases(dim, rank, count, first=1):
    """``count`` basis vectors along ``dim``: first, 2 first, 4 first, ..."""
    return [[first << i if d == dim else 0 for d in range(rank)] for i in range(count)]


def _log2(value):
    assert value > 0 and value & (value - 1) == 0, f"{value} is not a power of two"
    return value.bit_length() - 1


@functools.lru_cache(maxsize=None)
def layouts(num_warps, block_n, block_k, block_m, words, wgmma=False):
    """(weight layout, x layout, mma layout) of a tile. The weight's codes are indexed
    [BLOCK_N, chunk, t, word, code]: 8 codes of a word, ``words`` words (2 or 4), 4 threads of a
    quad, BLOCK_K / (32 words) chunks; x the same with rows of x for rows of the weight. ``wgmma``:
    the accumulator of sm_90's warp-group MMA (warp w holds weight rows 16 w .. 16 w + 15 of each
    64 x num_warps / 4, as mma.sync's)."""
    reps = block_n // (16 * num_warps)
    chunks = block_k // (32 * words)
    weight = gl.DistributedLinearLayout(
        reg_bases=_bases(4, 5, 3) + _bases(3, 5, _log2(words)) + _bases(0, 5, 1, 8) + _bases(1, 5, _log2(chunks))
        + _bases(0, 5, _log2(reps), 16 * num_warps),
        lane_bases=_bases(2, 5, 2) + _bases(0, 5, 3),
        warp_bases=_bases(0, 5, _log2(num_warps), 16),
        block_bases=[],
        shape=[block_n, chunks, 4, words, 8])
    x = gl.DistributedLinearLayout(
        reg_bases=_bases(4, 5, 3) + _bases(3, 5, _log2(words)) + _bases(1, 5, _log2(chunks))
        + _bases(0, 5, _log2(block_m // 8), 8),
        lane_bases=_bases(2, 5, 2) + _bases(0, 5, 3),
        warp_bases=[[0] * 5] * _log2(num_warps),  # every warp holds all of x's tile
        block_bases=[],
        shape=[block_m, chunks, 4, words, 8])
    if wgmma:
        mma = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, block_m, 16])
    else:
        mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, 8])
    return weight, x, mma


@functools.lru_cache(maxsize=None)
def x_staging(num_warps, block_k, block_m, words, wgmma=False):
    """(global layout, shared layout, read layout) of x's tile [BLOCK_M, BLOCK_K] on its way through
    shared memory: read from global in 16-byte vectors with lanes along K; 16-byte vectors swizzled by
    row so that a warp's reads (a quad's 4 threads, 8 rows) take 4 wavefronts; read back as
    ``layouts(...)[1]`` over [BLOCK_M, BLOCK_K]. ``wgmma``: read as [BLOCK_M, chunk, t, word, code]
    (a row's 32 words contiguous over a warp's lanes, the rest of its lanes over adjacent rows),
    stored in the mma's K order to wgmma's 128-byte swizzle, where adjacent rows' phases put the
    4-byte pairs of one store in distinct banks; wgmma reads it itself (no read layout)."""
    if wgmma:
        lane_rows = 3 - _log2(words)
        reg_rows = _log2(block_m) - lane_rows - _log2(num_warps)
        assert reg_rows >= 0, f"{block_m} rows of x is fewer than a row per {8 // words} lanes of {num_warps} warps"
        load = gl.DistributedLinearLayout(
            reg_bases=_bases(4, 5, 3) + _bases(1, 5, _log2(block_k // (32 * words))) + _bases(0, 5, reg_rows, 1 << lane_rows),
            lane_bases=_bases(3, 5, _log2(words)) + _bases(2, 5, 2) + _bases(0, 5, lane_rows),
            warp_bases=_bases(0, 5, _log2(num_warps), 1 << (reg_rows + lane_rows)),
            block_bases=[],
            shape=[block_m, block_k // (32 * words), 4, words, 8])
        shared = gl.NVMMASharedLayout(swizzle_byte_width=128 if block_k >= 64 else 2 * block_k, element_bitwidth=16)
        return load, shared, load
    lanes_k = min(32, block_k // 8)
    coalesced = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[32 // lanes_k, lanes_k],
                                 warps_per_cta=[num_warps, 1], order=[1, 0])
    shared = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0])
    fragments = gl.DistributedLinearLayout(
        reg_bases=_bases(1, 2, 3 + _log2(words)) + _bases(1, 2, _log2(block_k // (32 * words)), 32 * words)
        + _bases(0, 2, _log2(block_m // 8), 8),
        lane_bases=_bases(1, 2, 2, 8 * words) + _bases(0, 2, 3),
        warp_bases=[[0, 0]] * _log2(num_warps),  # every warp reads all of x's tile
        block_bases=[],
        shape=[block_m, block_k])
    return coalesced, shared, fragments


def layout_constexprs(num_warps, block_n, block_k, block_m, words, wgmma=False):
    """The kernel's layout arguments for one tile: WORDS, WGMMA, ``layouts`` and ``x_staging`` by their names."""
    return dict(zip(("WORDS", "WGMMA", "W_LAYOUT", "X_LAYOUT", "MMA", "X_GLOBAL", "X_SHARED", "X_FRAGMENTS"),
                    (words, wgmma) + layouts(num_warps, block_n, block_k, block_m, words, wgmma)
                    + x_staging(num_warps, block_k, block_m, words, wgmma)))


@functools.lru_cache(maxsize=None)
def kwarps_layouts(kwarps, block_n, block_k, block_m, words):
    """(weight layout, x layout, mma layout) of a tile whose ``kwarps`` warps each take one K slice of the same
    ``block_n`` weight rows: ``layouts`` for one warp with a leading slice dimension over the warps, and mma.sync
    batched over it (warps along the batch)."""
    weight, x, _ = layouts(1, block_n, block_k, block_m, words)
    slices = _bases(0, 6, _log2(kwarps))

    def leading(layout):
        return gl.DistributedLinearLayout(
            reg_bases=[[0] + basis for basis in layout.reg_bases], lane_bases=[[0] + basis for basis in layout.lane_bases],
            warp_bases=slices, block_bases=[], shape=[kwarps] + list(layout.shape))

    mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[kwarps, 1, 1], instr_shape=[1, 16, 8])
    return leading(weight), leading(x), mma


def kwarps_constexprs(kwarps, block_n, block_k, block_m, words):
    """nf4_mma_kwarps_kernel's layout arguments for one tile by their names."""
    return dict(zip(("KWARPS", "WORDS", "W_LAYOUT", "X_LAYOUT", "MMA"),
                    (kwarps, words) + kwarps_layouts(kwarps, block_n, block_k, block_m, words)))


if AVAILABLE:
    @gluon.jit
    def _along(n: gl.constexpr, dim: gl.constexpr, layout: gl.constexpr):
        """arange(n) along dimension ``dim`` of a 5-D layout, shaped to broadcast against it."""
        if dim == 0:
            v = gl.arange(0, n, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, layout)))))
            return gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(v, 1), 2), 3), 4)
        elif dim == 1:
            v = gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, layout)))))
            return gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(v, 0), 2), 3), 4)
        elif dim == 2:
            v = gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, gl.SliceLayout(4, layout)))))
            return gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(v, 0), 1), 3), 4)
        elif dim == 3:
            v = gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(4, layout)))))
            return gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(v, 0), 1), 2), 4)
        else:
            v = gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, layout)))))
            return gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(v, 0), 1), 2), 3)

    @gluon.jit
    def _along6(n: gl.constexpr, dim: gl.constexpr, layout: gl.constexpr):
        """arange(n) along dimension ``dim`` of a 6-D layout, shaped to broadcast against it."""
        if dim == 0:
            return gl.expand_dims(_along(n, 0, gl.SliceLayout(5, layout)), 5)
        else:
            return gl.expand_dims(_along(n, dim - 1, gl.SliceLayout(0, layout)), 0)

    @gluon.jit
    def _mma_order(values, ROWS: gl.constexpr, BLOCK_K: gl.constexpr, WORDS: gl.constexpr):
        """[ROWS, chunk, t, word, code] in column order -> [ROWS, BLOCK_K] in the mma's K order."""
        values = gl.reshape(values, [ROWS, BLOCK_K // (32 * WORDS), 4, WORDS, 2, 2, 2])  # row, chunk, t, word, s % 2, p, q
        values = gl.permute(values, [0, 1, 3, 4, 5, 2, 6])  # row, chunk, s // 2, s % 2, p, t, q
        return gl.reshape(values, [ROWS, BLOCK_K])

    @gluon.jit
    def _batched_mma_order(values, KWARPS: gl.constexpr, ROWS: gl.constexpr, BLOCK_K: gl.constexpr, WORDS: gl.constexpr):
        """[slice, ROWS, chunk, t, word, code] in column order -> [slice, ROWS, BLOCK_K] in the mma's K order."""
        values = gl.reshape(values, [KWARPS, ROWS, BLOCK_K // (32 * WORDS), 4, WORDS, 2, 2, 2])
        values = gl.permute(values, [0, 1, 2, 4, 5, 6, 3, 7])
        return gl.reshape(values, [KWARPS, ROWS, BLOCK_K])

    @gluon.jit
    def _chunked_ptrs(x_ptr, first_row, stride_xm, ROWS: gl.constexpr, CHUNKS: gl.constexpr, WORDS: gl.constexpr,
                      LAYOUT: gl.constexpr):
        """(row, pointer) of x's [ROWS, chunk, t, word, code] in ``LAYOUT``: thread t's 8 WORDS columns of a chunk."""
        row = first_row + _along(ROWS, 0, LAYOUT)
        return row, (x_ptr + row * stride_xm + _along(CHUNKS, 1, LAYOUT) * (32 * WORDS) + _along(4, 2, LAYOUT) * (8 * WORDS)
                     + _along(WORDS, 3, LAYOUT) * 8 + _along(8, 4, LAYOUT))

    @gluon.jit
    def _step_loads(word_ptrs, block, row_block, absmax_ptr, absmax2_ptr, k0, BLOCKSIZE: gl.constexpr,
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
    def _member(pid_n, BLOCK_N: gl.constexpr, MEMBERS: gl.constexpr, N, rows0, rows1, weight, m1, m2):
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
    def _codebook_lanes(code_ptr, like, FP4: gl.constexpr):
        """Each lane's codebook[lane % 16] in ``like``'s shape and layout: the shuffle's table, one register."""
        lane = gl.inline_asm_elementwise("mov.u32 $0, %laneid;", "=r,r", [like], dtype=gl.int32, is_pure=True, pack=1) % 16
        entry = gl.load(code_ptr + lane)
        if FP4:  # bitsandbytes forms an FP4 value as sign * magnitude: code 8 is -0.0
            entry = (entry.to(gl.uint32, bitcast=True) | ((lane >> 3).to(gl.uint32) << 31)).to(gl.float32, bitcast=True)
        return entry

    @gluon.jit
    def _decoded(words, shifts, entry, absmax, absmax2, code2_ptr, offset, NESTED: gl.constexpr, X_DTYPE: gl.constexpr):
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
        BLOCK_N: gl.constexpr,  # weight rows per program (16 * num_warps * repeats; num_warps a multiple of 4 with WGMMA)
        BLOCK_K: gl.constexpr,  # columns per step (a multiple of 32 * WORDS)
        SPLIT_K: gl.constexpr,  # programs sharing one output tile along K (fp32 partials when > 1)
        STEPS_PER_SPLIT: gl.constexpr,  # BLOCK_K steps per program
        HAS_BIAS: gl.constexpr,  # add bias (where this kernel writes out)
        FOLD: gl.constexpr,  # SPLIT_K > 1: the tile's last program to store adds the partials, not a second kernel
        USE_INT64: gl.constexpr,  # 64-bit offsets into the weight
        WORDS: gl.constexpr,  # words of a row each thread holds a chunk: 2 (64-column chunks) or 4 (128)
        STAGE_X: gl.constexpr,  # x's tile through shared memory, else each warp's fragments from global memory
        WGMMA: gl.constexpr,  # sm_90's warp-group MMA, x's tile its shared operand (STAGE_X unused)
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
        member_start, member_rows, weight = _member(
            pid_n, BLOCK_N, MEMBERS, N, rows0, rows1,
            (packed_ptr, absmax_ptr, code_ptr, absmax2_ptr, code2_ptr, offset_ptr, out_ptr),
            (m1_packed_ptr, m1_absmax_ptr, m1_code_ptr, m1_absmax2_ptr, m1_code2_ptr, m1_offset_ptr, m1_out_ptr),
            (m2_packed_ptr, m2_absmax_ptr, m2_code_ptr, m2_absmax2_ptr, m2_code2_ptr, m2_offset_ptr, m2_out_ptr))
        packed_ptr, absmax_ptr, code_ptr, absmax2_ptr, code2_ptr, offset_ptr, out_base = weight

        # The weight's indices, [BLOCK_N, CHUNKS, 4, WORDS, 8] once broadcast. Rows past the member's
        # read its last row (no masks in the loop); their sums are not stored.
        row = gl.minimum(pid_n * BLOCK_N - member_start + _along(BLOCK_N, 0, W_LAYOUT), member_rows - 1)
        if USE_INT64:
            row = row.to(gl.int64)
        chunk = _along(CHUNKS, 1, W_LAYOUT)
        quad = _along(4, 2, W_LAYOUT)
        # (K // (8 WORDS)) * WORDS: the compiler sees that a row's words start WORDS-aligned (16-byte loads)
        word_ptrs = (packed_ptr.to(gl.pointer_type(gl.int32)) + row * (K // (8 * WORDS)) * WORDS
                     + chunk * (4 * WORDS) + quad * WORDS + _along(WORDS, 3, W_LAYOUT))
        element = _along(8, 4, W_LAYOUT)
        shifts = 8 * (element // 2) + 4 * (1 - element % 2)  # element 2j is byte j's high nibble
        # a thread's 8 WORDS columns of a chunk lie in one block (BLOCKSIZE >= 32 where WORDS is 4)
        row_block = row * (K // BLOCKSIZE)
        block = row_block + (chunk * (32 * WORDS) + quad * (8 * WORDS)) // BLOCKSIZE

        entry = _codebook_lanes(code_ptr, gl.full([1, 1, 1, 1, 1], 0, gl.int32, W_LAYOUT), FP4)

        if WGMMA:  # x's tile in shared memory in the mma's K order, wgmma's operand: 16-byte loads, rows past M zero
            x_row, x_ptrs = _chunked_ptrs(x_ptr, pid_m * BLOCK_M, stride_xm, BLOCK_M, CHUNKS, WORDS, X_GLOBAL)
            x_tile = gl.allocate_shared_memory(X_DTYPE, [BLOCK_M, BLOCK_K], X_SHARED)
        elif STAGE_X:  # x's tile through shared memory: read once a program, coalesced
            x_row = gl.expand_dims(pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, X_GLOBAL)), 1)
            x_ptrs = (x_ptr + x_row * stride_xm
                      + gl.expand_dims(gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, X_GLOBAL)), 0))
            x_tile = gl.allocate_shared_memory(X_DTYPE, [BLOCK_M, BLOCK_K], X_SHARED)
        else:  # each warp reads its fragments itself, a thread's 8 WORDS columns of a chunk at once; rows past M unread
            x_row, x_ptrs = _chunked_ptrs(x_ptr, pid_m * BLOCK_M, stride_xm, BLOCK_M, CHUNKS, WORDS, X_LAYOUT)
        x_mask = x_row < M

        if NESTED:
            offset = gl.load(offset_ptr)
        else:
            offset = 0.0  # unread
        acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, MMA)
        if PREFETCH:  # a step's loads issued a step ahead, carried in registers
            words, absmax, absmax2 = _step_loads(word_ptrs, block, row_block, absmax_ptr, absmax2_ptr, first * BLOCK_K,
                                                 BLOCKSIZE, BLOCKSIZE2, NESTED, BLOCK_K, WORDS_POLICY)
            x = gl.load(x_ptrs + first * BLOCK_K, mask=x_mask, other=0.0)
        for outer in range(STEPS_PER_SPLIT // UNROLL):
            for inner in gl.static_range(UNROLL):  # UNROLL steps in one body: loads hoisted past the last step's math
                step = outer * UNROLL + inner
                k0 = (first + step) * BLOCK_K
                if not PREFETCH:
                    words, absmax, absmax2 = _step_loads(word_ptrs, block, row_block, absmax_ptr, absmax2_ptr, k0,
                                                         BLOCKSIZE, BLOCKSIZE2, NESTED, BLOCK_K, WORDS_POLICY)
                    if WGMMA:
                        x = gl.load(x_ptrs + k0, mask=x_mask, other=0.0)
                if WGMMA:  # x's tile stored before the next step's loads: the proxy fence waits for the thread's loads
                    _barrier()  # every warp group's wgmma of the last step has read the tile
                    x_tile.store(_mma_order(x, BLOCK_M, BLOCK_K, WORDS))
                    fence_async_shared()  # the stores visible to wgmma's reads
                    _barrier()
                if PREFETCH:  # the last step loads itself again: in bounds, unused
                    k_next = (first + gl.minimum(step + 1, STEPS_PER_SPLIT - 1)) * BLOCK_K
                    next_words, next_absmax, next_absmax2 = _step_loads(word_ptrs, block, row_block, absmax_ptr,
                                                                        absmax2_ptr, k_next, BLOCKSIZE, BLOCKSIZE2,
                                                                        NESTED, BLOCK_K, WORDS_POLICY)
                    next_x = gl.load(x_ptrs + k_next, mask=x_mask, other=0.0)
                weights = _decoded(words, shifts, entry, absmax, absmax2, code2_ptr, offset, NESTED, X_DTYPE)
                a = gl.convert_layout(_mma_order(weights, BLOCK_N, BLOCK_K, WORDS), gl.DotOperandLayout(0, MMA, 2),
                                      assert_trivial=True)
                if WGMMA:
                    acc = warpgroup_mma(a, x_tile.permute((1, 0)), acc)
                else:
                    if not PREFETCH:
                        x = gl.load(x_ptrs + k0, mask=x_mask, other=0.0)
                    if STAGE_X:
                        _barrier()  # every warp has read the last step's tile
                        x_tile.store(x)
                        _barrier()
                        x = gl.convert_layout(gl.reshape(x_tile.load(X_FRAGMENTS), [BLOCK_M, CHUNKS, 4, WORDS, 8]),
                                              X_LAYOUT, assert_trivial=True)
                    b = gl.convert_layout(gl.permute(_mma_order(x, BLOCK_M, BLOCK_K, WORDS), [1, 0]),
                                          gl.DotOperandLayout(1, MMA, 2), assert_trivial=True)
                    acc = mma_v2(a, b, acc)
                if PREFETCH:
                    words, absmax, absmax2, x = next_words, next_absmax, next_absmax2, next_x

        n = gl.expand_dims(pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, MMA)), 1)
        m = gl.expand_dims(pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, MMA)), 0)
        out_mask = (m < M) & (n < N)
        if SPLIT_K > 1:
            partial = partial_ptr + m * N + n
            gl.store(partial + pid_k.to(gl.int64) * M * N, acc, mask=out_mask)
            if FOLD:
                _barrier()  # every thread's partial sums stored before the count's release (a gpu-scope fence)
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
        member_start, member_rows, weight = _member(
            pid_n, BLOCK_N, MEMBERS, N, rows0, rows1,
            (packed_ptr, absmax_ptr, code_ptr, absmax2_ptr, code2_ptr, offset_ptr, out_ptr),
            (m1_packed_ptr, m1_absmax_ptr, m1_code_ptr, m1_absmax2_ptr, m1_code2_ptr, m1_offset_ptr, m1_out_ptr),
            (m2_packed_ptr, m2_absmax_ptr, m2_code_ptr, m2_absmax2_ptr, m2_code2_ptr, m2_offset_ptr, m2_out_ptr))
        packed_ptr, absmax_ptr, code_ptr, absmax2_ptr, code2_ptr, offset_ptr, out_base = weight

        # [KWARPS, BLOCK_N, CHUNKS, 4, WORDS, 8] once broadcast; warp w's columns start at w * K / KWARPS
        first = _along6(KWARPS, 0, W_LAYOUT) * (STEPS_PER_WARP * BLOCK_K)
        row = gl.minimum(pid_n * BLOCK_N - member_start + _along6(BLOCK_N, 1, W_LAYOUT), member_rows - 1)
        if USE_INT64:
            row = row.to(gl.int64)
        chunk = _along6(CHUNKS, 2, W_LAYOUT)
        quad = _along6(4, 3, W_LAYOUT)
        word_ptrs = (packed_ptr.to(gl.pointer_type(gl.int32)) + row * (K // (8 * WORDS)) * WORDS + first // 8
                     + chunk * (4 * WORDS) + quad * WORDS + _along6(WORDS, 4, W_LAYOUT))
        element = _along6(8, 5, W_LAYOUT)
        shifts = 8 * (element // 2) + 4 * (1 - element % 2)
        row_block = row * (K // BLOCKSIZE) + first // BLOCKSIZE  # the slice's first block of the row
        block = row_block + (chunk * (32 * WORDS) + quad * (8 * WORDS)) // BLOCKSIZE
        entry = _codebook_lanes(code_ptr, gl.full([1, 1, 1, 1, 1, 1], 0, gl.int32, W_LAYOUT), FP4)

        x_row = pid_m * BLOCK_M + _along6(BLOCK_M, 1, X_LAYOUT)
        x_ptrs = (x_ptr + x_row * stride_xm + _along6(KWARPS, 0, X_LAYOUT) * (STEPS_PER_WARP * BLOCK_K)
                  + _along6(CHUNKS, 2, X_LAYOUT) * (32 * WORDS) + _along6(4, 3, X_LAYOUT) * (8 * WORDS)
                  + _along6(WORDS, 4, X_LAYOUT) * 8 + _along6(8, 5, X_LAYOUT))
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
                words, absmax, absmax2 = _step_loads(word_ptrs, block, row_block, absmax_ptr, absmax2_ptr, k0,
                                                     BLOCKSIZE, BLOCKSIZE2, NESTED, BLOCK_K, WORDS_POLICY)
                weights = _decoded(words, shifts, entry, absmax, absmax2, code2_ptr, offset, NESTED, X_DTYPE)
                a = gl.convert_layout(_batched_mma_order(weights, KWARPS, BLOCK_N, BLOCK_K, WORDS),
                                      gl.DotOperandLayout(0, MMA, 2), assert_trivial=True)
                x = gl.load(x_ptrs + k0, mask=x_mask, other=0.0)
                b = gl.convert_layout(gl.permute(_batched_mma_order(x, KWARPS, BLOCK_M, BLOCK_K, WORDS), [0, 2, 1]),
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
