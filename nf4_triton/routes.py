"""Which kernel computes which call of the fused matmul: a configuration type per kernel family, validated when it is
built, and the routes per GPU as data. ``choose_route`` is a pure function of a call's rows, the layer's size and the
GPU's facts; each route names the NOTES.md item that measured it (the numbers are there).

    TlConfig      matmul's ``tl`` kernel (``tl_matmul.py``): tensor-core ``tl.dot`` tiles, or one row by FMA
    MmaConfig     ``mma_sync.nf4_mma_kernel``: the weight decoded into ``mma.sync``'s fragments (sm_80 on)
    WgmmaConfig   ``wgmma.nf4_wgmma_kernel``: the same fragments as ``wgmma``'s register operand (sm_90)
    KSliceConfig  ``mma_sync.nf4_mma_kwarps_kernel``: a program's warps each sum one K slice of the same rows

A table is a tuple of ``Route``s, the first that a call fits wins; past them, dequantize + cuBLAS.
"""

import dataclasses
import typing

from nf4_triton import fastpath

__all__ = ["TlConfig", "MmaConfig", "WgmmaConfig", "KSliceConfig", "GLUON_CONFIGS", "CONFIGS", "Route", "MEBI",
           "TL_ROUTES", "TL_DEFAULT_ROUTES", "SM75_ROUTES", "MATMUL_ROUTES", "DEFAULT_ROUTES", "FAST_DRAM_ROUTES", "DEQUANTIZE",
           "routes_for", "choose_route", "columns_per_step"]


def _power_of_two(value):
    return isinstance(value, int) and value >= 1 and value & (value - 1) == 0


def _check(config, *conditions):
    """ValueError naming the configuration and the first condition it fails, from (holds, what it needs) pairs."""
    for holds, needs in conditions:
        if not holds:
            raise ValueError(f"{config}: {needs}")


class _Config:
    """What every family shares: built frozen and validated (``_validate``), hashed once (a replayed launch's key
    holds it), equal only to a configuration of its own family, and, where the family folds split-K, built with its
    folded twin (``folded``)."""

    def __post_init__(self):
        self._validate()
        object.__setattr__(self, "_hash", hash((type(self).__name__, dataclasses.astuple(self))))
        fold = getattr(self, "fold", None)
        object.__setattr__(self, "_folded", self if fold else dataclasses.replace(self, fold=True) if fold is False
                           else None)

    def __hash__(self):
        return self._hash

    def folded(self):
        """This configuration with ``fold=True`` (the tile's last program adds the split-K partial sums), built with it:
        a traced forward reads it and builds no configuration (torch 2.11's Dynamo cannot trace the hash above)."""
        if self._folded is None:
            raise TypeError(f"{type(self).__name__} has no split-K fold")
        return self._folded

    def replace(self, **changes):
        """This configuration with ``changes``, validated."""
        return dataclasses.replace(self, **changes)


def _family(cls):
    """A configuration type: a frozen dataclass, hashed as ``_Config`` hashes (the dataclass would hash every field at
    every lookup)."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    cls.__hash__ = _Config.__hash__
    return cls


@_family
class TlConfig(_Config):
    """matmul's ``tl`` kernel: ``dot`` tiles of ``block_m`` rows by ``tl.dot`` (Triton before 3.6, fp32 x, sm_75), else
    one row of x a program by fp32 FMA."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1  # programs along K, their fp32 partial sums added by split_k_reduce_kernel
    dot: bool = True
    num_warps: int = 4
    num_stages: int = 2
    lookup: int = 2  # a code's value: 0 the global codebook, 1 per-block product tables, 2 byte pairs (shared memory)

    def _validate(self):
        _check(self, (_power_of_two(self.block_m), "block_m must be a power of two"),
               (self.block_m >= 16 if self.dot else self.block_m == 1, "tl.dot tiles take 16 rows or more, FMA one"),
               (_power_of_two(self.block_n) and self.block_n >= 16, "block_n must be a power of two >= 16"),
               (_power_of_two(self.block_k) and self.block_k >= 8, "block_k must be a power of two >= 8"),
               (isinstance(self.split_k, int) and self.split_k >= 1, "split_k must be >= 1"),
               (_power_of_two(self.num_warps) and self.num_warps <= 16, "num_warps must be 1 to 16, a power of two"),
               (self.num_stages >= 1, "num_stages must be >= 1"), (self.lookup in (0, 1, 2), "lookup must be 0, 1 or 2"))


def _check_gluon_tile(config, warps):
    """The layouts' conditions on a Gluon tile of ``warps`` warps along its weight rows (``mma_layouts``)."""
    _check(config, (_power_of_two(config.block_m) and config.block_m >= 8, "block_m must be a power of two >= 8"),
           (_power_of_two(warps), "its warps must be a power of two"),
           (config.words in (2, 4), "words must be 2 or 4"),
           (config.block_n % (16 * warps) == 0 and _power_of_two(config.block_n // (16 * warps)),
            f"block_n must be 16 x {warps} warps x a power of two"),
           (config.block_k % (32 * config.words) == 0 and _power_of_two(config.block_k // (32 * config.words)),
            f"block_k must be 32 x {config.words} words x a power of two"),
           (isinstance(config.unroll, int) and config.unroll >= 1, "unroll must be >= 1"))


@_family
class MmaConfig(_Config):
    """``mma_sync.nf4_mma_kernel``: ``block_n`` weight rows over ``num_warps`` warps, 16 a warp at a time."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    words: int = 2  # words of a weight row a thread loads at once: 2 or 4 (16-byte loads)
    stage_x: bool = True  # x's tile through shared memory, else each warp reads its fragments (rows past M unread)
    fold: bool = False  # with split_k > 1, the tile's last program adds the partial sums (no second kernel)
    prefetch: bool = False  # each step's loads issued during the step before
    unroll: int = 1  # K steps in one unrolled loop body (the largest divisor of a program's steps up to this)
    stream: bool = False  # the weight's words loaded evict-first in L1 and L2

    def _validate(self):
        _check_gluon_tile(self, self.num_warps)
        _check(self, (isinstance(self.split_k, int) and self.split_k >= 1, "split_k must be >= 1"))


@_family
class WgmmaConfig(_Config):
    """``wgmma.nf4_wgmma_kernel`` (sm_90): warp groups of 4 warps, each multiplying its 64 weight rows by x's tile."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    words: int = 2
    fold: bool = False
    prefetch: bool = False
    unroll: int = 1
    stream: bool = False

    def _validate(self):
        _check_gluon_tile(self, self.num_warps)
        _check(self, (self.num_warps % 4 == 0, "num_warps must be whole warp groups (a multiple of 4)"),
               (self.block_m <= 256, "block_m must be at most 256 (one wgmma)"),
               (self.block_m >= (8 // self.words) * self.num_warps,
                f"block_m must be at least a row per {8 // self.words} lanes of {self.num_warps} warps"),
               (isinstance(self.split_k, int) and self.split_k >= 1, "split_k must be >= 1"))


@_family
class KSliceConfig(_Config):
    """``mma_sync.nf4_mma_kwarps_kernel``: ``warps`` warps each summing one K slice of the same ``block_n`` rows, x
    unstaged, the slices' sums added through shared memory; no split between programs."""

    block_m: int
    block_n: int
    block_k: int
    warps: int = 4  # K slices, a warp each: K must be a multiple of block_k x warps
    words: int = 4
    unroll: int = 1
    stream: bool = False
    accumulators: int = 1  # 2: each unrolled body's odd steps summed apart from its even ones, added at the end

    split_k = 1  # no split between programs
    num_warps = property(lambda self: self.warps)

    def _validate(self):
        _check_gluon_tile(self, 1)
        _check(self, (self.warps >= 2 and _power_of_two(self.warps), "warps must be a power of two >= 2"),
               (self.accumulators in (1, 2), "accumulators must be 1 or 2"))


GLUON_CONFIGS = (MmaConfig, WgmmaConfig, KSliceConfig)
CONFIGS = {config.__name__: config for config in (TlConfig,) + GLUON_CONFIGS}  # by name (torch.library operators)


def columns_per_step(config):
    """The K columns one step of ``config`` covers across a program: K must be a multiple of them."""
    return config.block_k * config.warps if isinstance(config, KSliceConfig) else config.block_k


class Route(typing.NamedTuple):
    """How ``nf4_linear`` computes up to ``max_rows`` rows of x against a weight of at least ``min_weight`` elements,
    ``min_in`` to ``max_in`` input and at least ``min_out`` output features: "fused" (with ``config``), "dequantize"
    (dequantize_nf4 + cuBLAS) or "bitsandbytes" (its own 4-bit matmul, which its own rule dispatches)."""

    max_rows: int
    path: str
    config: typing.Optional[_Config] = None
    min_weight: int = 0
    min_in: int = 0
    min_out: int = 0
    max_in: int = 2**62


def _fused(max_rows, config, **sizes):
    return Route(max_rows, "fused", config, **sizes)


MEBI = 1 << 20  # min_weight in units of 2**20 weights
DEQUANTIZE = Route(2**62, "dequantize")

# Where mma.py's Gluon kernels cannot run (Triton before 3.6, fp32 x, sm_75): the tl kernel's tables.
TL_ROUTES = {
    (9, 0): (  # the H100's sweep in bf16 (item 70)
        Route(2, "bitsandbytes"),
        _fused(16, TlConfig(block_m=16, block_n=64, block_k=256, split_k=4), min_weight=16 * MEBI),
        _fused(16, TlConfig(block_m=16, block_n=32, block_k=256, split_k=4, lookup=1)),
        _fused(64, TlConfig(block_m=64, block_n=128, block_k=128, split_k=2, num_stages=3), min_weight=56 * MEBI,
               min_out=14336),
        _fused(64, TlConfig(block_m=64, block_n=64, block_k=128, split_k=2, num_stages=3), min_weight=56 * MEBI),
        _fused(128, TlConfig(block_m=128, block_n=64, block_k=128, num_stages=3), min_weight=56 * MEBI, min_out=14336),
        _fused(128, TlConfig(block_m=128, block_n=64, block_k=128, split_k=2, num_stages=3), min_weight=56 * MEBI),
    ),
}
# Reasoned, not measured: the fused kernel up to 16 rows, where it reads the least memory per result.
TL_DEFAULT_ROUTES = (_fused(16, TlConfig(block_m=16, block_n=32, block_k=256, split_k=4, lookup=1)),)
TL_ROUTES.update({capability: TL_DEFAULT_ROUTES for capability in ((8, 0), (8, 6), (8, 9))})
# sm_75 (the T4): Triton lowers tl.dot to FMA below sm_80 (no mma in the tl tile's sm_75 PTX, tests/test_matmul.py's
# ahead-of-time check), and sm_75 has no mma.sync.m16n8k16 for the Gluon kernels: bitsandbytes' own 4-bit matmul to
# its most fused rows, whose rule picks its GEMV, its sm_75 fp16 mma kernel or its dequantization; beyond, ours.
# Reasoned, not measured (item 112).
SM75_ROUTES = (Route(1536, "bitsandbytes"),)
TL_ROUTES[(7, 5)] = SM75_ROUTES

_ONE_ROW_SLICES = KSliceConfig(block_m=8, block_n=16, block_k=512, warps=4, unroll=4)
_EIGHT_ROWS = MmaConfig(block_m=8, block_n=64, block_k=256, split_k=8, words=4)
# The Gluon kernels' tables. sm_90: the fastest path at each point of the H100's sweeps in bf16, CUDA-graph GPU time.
MATMUL_ROUTES = {
    (9, 0): (
        # 1 to 8 rows of the widest layers (8B's gate, up and merged; 70B's)
        _fused(4, MmaConfig(block_m=8, block_n=64, block_k=256, split_k=4, words=4, stage_x=False),
               min_weight=128 * MEBI, min_out=14336),  # item 81
        _fused(1, _ONE_ROW_SLICES.replace(stream=True, accumulators=2), min_weight=112 * MEBI, min_in=4096,
               min_out=28672),  # items 99, 101, 103
        _fused(1, _ONE_ROW_SLICES.replace(stream=True), min_weight=56 * MEBI, min_in=4096, min_out=14336),  # 99, 101
        _fused(2, _ONE_ROW_SLICES.replace(block_k=256, stream=True), min_weight=112 * MEBI, min_in=4096,
               min_out=28672),  # items 99, 101
        _fused(2, _ONE_ROW_SLICES, min_weight=56 * MEBI, min_in=4096, min_out=14336),  # item 99
        _fused(2, MmaConfig(block_m=8, block_n=64, block_k=512, split_k=4, words=4, stage_x=False, unroll=4),
               min_weight=56 * MEBI, min_in=4096, min_out=14336),  # item 87
        _fused(4, MmaConfig(block_m=8, block_n=64, block_k=256, split_k=4, words=4, stage_x=False, stream=True),
               min_weight=56 * MEBI, min_out=14336),  # items 81, 101
        _fused(8, MmaConfig(block_m=8, block_n=64, block_k=256, split_k=4, words=4, stream=True),
               min_weight=56 * MEBI, min_out=14336),  # items 80, 101
        # 28672x8192 (70B's down)
        _fused(2, MmaConfig(block_m=8, block_n=64, block_k=512, split_k=32, words=4, stage_x=False, unroll=4),
               min_weight=128 * MEBI),  # items 85, 87
        _fused(2, MmaConfig(block_m=8, block_n=64, block_k=256, split_k=32, words=4, stage_x=False),
               min_weight=128 * MEBI),  # item 85
        _fused(8, MmaConfig(block_m=8, block_n=64, block_k=256, split_k=16, words=4, fold=True),
               min_weight=128 * MEBI),  # items 81, 85
        # 14336x4096 (8B's down)
        _fused(2, MmaConfig(block_m=8, block_n=64, block_k=512, split_k=16, words=4, stage_x=False, fold=True, unroll=4,
                            stream=True), min_weight=56 * MEBI, min_in=14336, max_in=14336),  # item 103
        _fused(4, MmaConfig(block_m=8, block_n=64, block_k=256, split_k=16, words=4, stage_x=False, fold=True, unroll=4,
                            stream=True), min_weight=56 * MEBI, min_in=14336),  # items 85, 87, 101
        _fused(8, MmaConfig(block_m=8, block_n=64, block_k=256, split_k=16, words=4, fold=True, stream=True),
               min_weight=56 * MEBI, min_in=14336),  # items 85, 101
        _fused(4, MmaConfig(block_m=8, block_n=64, block_k=256, split_k=8, words=4, stage_x=False, fold=True),
               min_weight=56 * MEBI),  # item 81
        # q|k|v merged and the layers of 24M to 56M weights
        _fused(1, _ONE_ROW_SLICES, min_weight=24 * MEBI, min_in=4096, min_out=6144),  # item 99
        _fused(2, _ONE_ROW_SLICES.replace(block_k=256, stream=True), min_weight=24 * MEBI, min_in=4096,
               min_out=6144),  # items 99, 101
        _fused(1, MmaConfig(block_m=8, block_n=64, block_k=512, split_k=8, words=4, stage_x=False, fold=True, unroll=4),
               min_weight=24 * MEBI, min_in=4096, min_out=6144),  # items 88, 90
        # 4096x4096 and the layers of 16M to 24M weights
        _fused(2, _ONE_ROW_SLICES.replace(block_k=128, warps=8), min_weight=16 * MEBI, min_out=4096),  # item 99
        _fused(1, MmaConfig(block_m=8, block_n=64, block_k=128, split_k=16, words=4, stage_x=False, fold=True),
               min_weight=16 * MEBI),  # item 83
        _fused(8, _EIGHT_ROWS.replace(fold=True, stream=True), min_weight=16 * MEBI),  # items 81, 101
        # below 16M weights (k, v; 4096x1024)
        _fused(2, MmaConfig(block_m=8, block_n=128, block_k=256, split_k=16, num_warps=8, words=4, fold=True,
                            stream=True)),  # items 83, 87, 101
        _fused(8, _EIGHT_ROWS.replace(split_k=16, fold=True, stream=True)),  # items 83, 101
        # 16 rows
        _fused(16, MmaConfig(block_m=16, block_n=64, block_k=256, split_k=4, words=4, stream=True),
               min_weight=56 * MEBI, min_out=14336),  # items 80, 101
        _fused(16, MmaConfig(block_m=16, block_n=64, block_k=256, split_k=8, fold=True, stream=True),
               min_weight=56 * MEBI),  # items 81, 101
        _fused(16, _EIGHT_ROWS.replace(block_m=16)),  # item 80
        # 32 rows
        _fused(32, WgmmaConfig(block_m=32, block_n=64, block_k=64, split_k=4, prefetch=True), min_weight=56 * MEBI,
               min_out=14336),  # item 82
        _fused(32, MmaConfig(block_m=32, block_n=128, block_k=64, split_k=16), min_weight=56 * MEBI),  # item 78
        _fused(32, MmaConfig(block_m=32, block_n=64, block_k=256, split_k=4), min_weight=16 * MEBI),  # item 78
        _fused(32, MmaConfig(block_m=32, block_n=128, block_k=64, split_k=16, prefetch=True)),  # item 82
        # 64 to 256 rows: warp-group MMA (item 82)
        _fused(64, WgmmaConfig(block_m=64, block_n=128, block_k=128, split_k=2, num_warps=8), min_weight=56 * MEBI,
               min_out=14336),
        _fused(64, WgmmaConfig(block_m=64, block_n=64, block_k=128, split_k=4, prefetch=True), min_weight=128 * MEBI),
        _fused(64, WgmmaConfig(block_m=64, block_n=64, block_k=64, split_k=8, prefetch=True), min_weight=56 * MEBI),
        _fused(64, WgmmaConfig(block_m=64, block_n=64, block_k=128, split_k=4, prefetch=True), min_weight=16 * MEBI),
        _fused(64, MmaConfig(block_m=64, block_n=64, block_k=64, split_k=8, prefetch=True)),
        _fused(128, WgmmaConfig(block_m=128, block_n=128, block_k=64, split_k=2, num_warps=8, prefetch=True),
               min_weight=56 * MEBI, min_out=14336),
        _fused(128, WgmmaConfig(block_m=128, block_n=64, block_k=128, split_k=2, prefetch=True), min_weight=128 * MEBI),
        _fused(128, WgmmaConfig(block_m=128, block_n=64, block_k=128, split_k=4, prefetch=True), min_weight=16 * MEBI),
        _fused(128, WgmmaConfig(block_m=128, block_n=64, block_k=128, split_k=8, prefetch=True)),
        _fused(256, WgmmaConfig(block_m=128, block_n=128, block_k=64, num_warps=8, prefetch=True), min_weight=56 * MEBI,
               min_out=14336),
        _fused(256, WgmmaConfig(block_m=128, block_n=128, block_k=64, split_k=2, num_warps=8, prefetch=True),
               min_weight=128 * MEBI),
        _fused(256, WgmmaConfig(block_m=128, block_n=64, block_k=128, split_k=2, prefetch=True), min_weight=56 * MEBI),
    ),
}
# Reasoned, not measured (no A100 or L4 has run it): the 16-row tile up to 16 rows, where it reads the least memory
# per result; dequantize + cuBLAS beyond.
DEFAULT_ROUTES = (_fused(16, _EIGHT_ROWS.replace(block_m=16, words=2)),)
MATMUL_ROUTES.update({capability: DEFAULT_ROUTES for capability in ((8, 0), (8, 6), (8, 9))})
MATMUL_ROUTES[(7, 5)] = SM75_ROUTES
# A GPU whose DRAM is fast (fastpath.fast_dram: the H200) dequantizes from 129 rows (item 109).
FAST_DRAM_ROUTES = {(9, 0): tuple(route for route in MATMUL_ROUTES[(9, 0)] if route.max_rows <= 128)}


def routes_for(capability, routes=None, dram_gbps=0):
    """The routes of a table (``MATMUL_ROUTES``, or ``TL_ROUTES`` where the Gluon kernels cannot run) for a GPU of
    ``capability`` whose DRAM peaks at ``dram_gbps``; a GPU the table does not name takes its default."""
    if routes is None or routes is MATMUL_ROUTES:
        return fastpath.table_for(capability, dram_gbps, MATMUL_ROUTES, FAST_DRAM_ROUTES, DEFAULT_ROUTES)
    return fastpath.table_for(capability, dram_gbps, routes, {}, TL_DEFAULT_ROUTES)


def choose_route(capability, rows, in_features, out_features, routes=None, dram_gbps=0):
    """The Route for ``rows`` rows of x against an (out_features, in_features) weight on a GPU of ``capability``
    whose DRAM peaks at ``dram_gbps``, from ``routes`` (``routes_for``): a pure function of the six. A route of more
    than 256 columns a step, or of K slices, is passed over where its columns do not divide K."""
    for route in routes_for(capability, routes, dram_gbps):
        config = route.config
        if (rows <= route.max_rows and in_features * out_features >= route.min_weight
                and route.min_in <= in_features <= route.max_in and out_features >= route.min_out
                and (config is None or (config.block_k <= 256 and not isinstance(config, KSliceConfig))
                     or in_features % columns_per_step(config) == 0)):
            return route
    return DEQUANTIZE
