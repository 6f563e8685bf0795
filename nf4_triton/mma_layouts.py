"""The register layouts of the fused matmul's Gluon kernels (``mma_sync.py``, ``wgmma.py``): pure functions of a
tile, cached, with the constexprs each kernel takes.

Inside each chunk of K (32 W columns, W = 2 or 4 words a thread) the order of the sum is
permuted, the same way for the weight and for x, so that the codes a thread's A fragments hold
are W contiguous words of one weight row: one load of 4 W bytes and one scale a row and chunk, no
shared memory for the weight and no exchange between threads (the layouts' conversion is
asserted trivial at compile time). Thread ``t`` of a row quad holds physical columns
``8 W t .. 8 W t + 8 W - 1`` of a chunk; column ``8 W t + 4 s + 2 p + q`` sits in k-step ``s`` at logical column
``16 s + 8 p + 2 t + q``, which is where mma.sync expects A[g][2t + q] (p = 0) and A[g][2t + 8 + q] (p = 1), and B
likewise. On sm_90 the same fragments are the register operand of ``wgmma``.

``AVAILABLE``: this Triton has Gluon's linear layouts and ``mma_v2`` (3.6 on); the kernels' modules are imported
only then.
"""

import functools

try:
    from triton.experimental.gluon import language as gl

    AVAILABLE = hasattr(gl, "DistributedLinearLayout")
except ImportError:  # Triton before 3.6
    AVAILABLE = False

__all__ = ["AVAILABLE", "layouts", "x_staging", "mma_sync_constexprs", "wgmma_constexprs", "kwarps_layouts",
           "kwarps_constexprs"]


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


def mma_sync_constexprs(num_warps, block_n, block_k, block_m, words):
    """``mma_sync.nf4_mma_kernel``'s layout arguments for one tile by their names."""
    return dict(zip(("WORDS", "W_LAYOUT", "X_LAYOUT", "MMA", "X_GLOBAL", "X_SHARED", "X_FRAGMENTS"),
                    (words,) + layouts(num_warps, block_n, block_k, block_m, words)
                    + x_staging(num_warps, block_k, block_m, words)))


def wgmma_constexprs(num_warps, block_n, block_k, block_m, words):
    """``wgmma.nf4_wgmma_kernel``'s layout arguments for one tile by their names (x's tile staged, read by wgmma)."""
    weight, _, mma = layouts(num_warps, block_n, block_k, block_m, words, wgmma=True)
    load, shared, _ = x_staging(num_warps, block_k, block_m, words, wgmma=True)
    return dict(WORDS=words, W_LAYOUT=weight, MMA=mma, X_GLOBAL=load, X_SHARED=shared)


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
    """``mma_sync.nf4_mma_kwarps_kernel``'s layout arguments for one tile by their names."""
    return dict(zip(("KWARPS", "WORDS", "W_LAYOUT", "X_LAYOUT", "MMA"),
                    (kwarps, words) + kwarps_layouts(kwarps, block_n, block_k, block_m, words)))
