"""Launching the fused matmul for validated arguments: the kernel of a configuration's family, its split-K scratch,
its arguments, and the replay of a repeated call's launches.

Where N alone does not fill the GPU, ``split_k`` programs share a row of outputs: each writes its fp32 partial sums
and ``tl_matmul.split_k_reduce_kernel`` adds them in a fixed order (deterministic), adds the bias and casts; or
(``fold``, the Gluon kernels) the last program of a tile to store, counted by an atomic, adds them itself in the same
order. The partial sums are a call's own, from the caching allocator; the fold counters are a stream's, since a fold
is one kernel that leaves them at zero.
"""

import threading

import torch
import triton

from nf4_triton import fastpath, kernel, mma_layouts
from nf4_triton.fastpath import INTERPRET
from nf4_triton.kernel import TL_DTYPE
from nf4_triton.routes import KSliceConfig, TlConfig, WgmmaConfig, columns_per_step
from nf4_triton.tl_matmul import nf4_matmul_kernel, split_k_reduce_kernel

if mma_layouts.AVAILABLE:  # Gluon's kernels (Triton 3.6 on)
    from nf4_triton import mma_sync, wgmma

__all__ = ["launch_fused", "gluon_kernel", "gluon_runs_on", "gluon_supported", "largest_divisor", "fold_counters",
           "LAUNCHES", "MOST_LAUNCHES", "FOLD_COUNTERS", "STREAM_COUNTERS"]


def gluon_runs_on(capability):
    """Whether the Gluon kernels can run on a GPU of this capability: Gluon's mma_v2 (Triton 3.6 on), compiled (not
    the interpreter), NVIDIA from sm_80."""
    return mma_layouts.AVAILABLE and not INTERPRET and torch.version.hip is None and tuple(capability) >= (8, 0)


def gluon_supported(x2d, k, blocksize, config, capability):
    """Whether the Gluon kernel of ``config`` runs this call on a GPU of ``capability`` (wgmma on sm_90 alone): fp16 or
    bf16 x, K whole steps, each thread's columns of a chunk within one block."""
    return (x2d.dtype is not torch.float32 and k % columns_per_step(config) == 0 and blocksize >= 8 * config.words
            and gluon_runs_on(capability) and (not isinstance(config, WgmmaConfig) or tuple(capability)[0] == 9))


def largest_divisor(count, most):
    """The largest divisor of ``count`` up to ``most`` (at least 1): a call's split, so that every program takes whole
    steps (56 steps of 14336 at split 16 run as 14 splits of 4), and a loop body's unrolled steps."""
    for divisor in range(max(most, 1), 1, -1):  # from the most down: most calls stop at the first
        if count % divisor == 0:
            return divisor
    return 1


# --------------------------------------------------------------------------------------------
# Split-K scratch
# --------------------------------------------------------------------------------------------
FOLD_COUNTERS = 1 << 22  # int32 zeros a device keeps for folds (16 MiB), made at its first fold outside a capture
STREAM_COUNTERS = 4096  # output tiles a stream's eager launches fold at most
_COUNTERS = {}  # device index -> _FoldCounters


class _FoldCounters:
    """One device's fold counters, handed out in slices: one slice a stream, one a captured launch. A fold is one
    kernel, which leaves its counters at zero, and one stream runs one kernel after another, so a stream's eager
    launches share its slice; a launch captured into a CUDA graph takes counters never handed out again."""

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


def fold_counters(device, tiles, capturing):
    """int32 zero counters for a folded split-K launch of ``tiles`` output tiles on the current stream of
    ``device`` (``capturing``: that stream is being captured into a CUDA graph), or None where none are left."""
    counters = _COUNTERS.get(device.index)
    if counters is None:
        counters = _COUNTERS.setdefault(device.index, _FoldCounters())
    return counters.for_launch(device, tiles, capturing)


def _empty_fp32(elements, device):
    """A new fp32 tensor of ``elements`` on ``device`` (on the GPU through the allocation entry launch plans use)."""
    if device.type == "cuda" and torch._C._cuda_getDevice() == device.index:
        return fastpath.empty_cuda((elements,), (1,), torch.float32)
    return torch.empty(elements, dtype=torch.float32, device=device)


# --------------------------------------------------------------------------------------------
# Each family's kernel and arguments
# --------------------------------------------------------------------------------------------
def gluon_kernel(config, steps, split_k, fold, members):
    """The Gluon kernel for ``config`` and its constexprs beyond the shared ones (block sizes, formats, bias), for a
    call of ``steps`` BLOCK_K steps at ``split_k`` (``largest_divisor``), ``fold`` (its split-K sum in the kernel) and
    ``members`` weights: the K-slice kernel, the warp-group kernel (sm_90) or the mma.sync kernel."""
    policy = "evict_first" if config.stream else ""
    if isinstance(config, KSliceConfig):  # no split between programs
        per_warp = steps // config.warps
        return mma_sync.nf4_mma_kwarps_kernel, dict(
            STEPS_PER_WARP=per_warp, UNROLL=largest_divisor(per_warp, config.unroll), MEMBERS=members,
            WORDS_POLICY=policy, ACCUMULATORS=config.accumulators,
            **mma_layouts.kwarps_constexprs(config.warps, config.block_n, config.block_k, config.block_m, config.words))
    shared = dict(SPLIT_K=split_k, STEPS_PER_SPLIT=steps // split_k, FOLD=fold, PREFETCH=config.prefetch,
                  UNROLL=largest_divisor(steps // split_k, config.unroll), MEMBERS=members, WORDS_POLICY=policy)
    tile = (config.num_warps, config.block_n, config.block_k, config.block_m, config.words)
    if isinstance(config, WgmmaConfig):
        return wgmma.nf4_wgmma_kernel, dict(shared, **mma_layouts.wgmma_constexprs(*tile))
    return mma_sync.nf4_mma_kernel, dict(shared, STAGE_X=config.stage_x, **mma_layouts.mma_sync_constexprs(*tile))


def _gluon_arguments(head, x2d, out, partials, counters, members, m, n, k, config, steps, split_k, fold):
    """(kernel, arguments, constexprs) of a Gluon launch: the shared head, the split-K scratch (K slices: none), the
    sizes and up to two members' weights (absent ones padded with the first weight's, never read)."""
    weights = ((head[1], head[2:7], out),) + tuple(members)
    padded = weights + (weights[0],) * (3 - len(weights))
    scratch = () if isinstance(config, KSliceConfig) else (
        out if partials is None else partials, out if counters is None else counters)
    args = head + scratch + (m, n, k, x2d.stride(0), out.shape[1], padded[1][2].shape[1] if members else 0)
    for packed_j, tables_j, out_j in padded[1:]:
        args += (packed_j if packed_j.data_ptr() % 4 == 0 else packed_j.clone(), *tables_j, out_j)
    if isinstance(config, KSliceConfig) and steps % config.warps:
        raise ValueError(f"{config}: K slices need {config.warps} slices of whole {config.block_k}-column steps "
                         f"(K = {k})")
    kernel_fn, constexprs = gluon_kernel(config, steps, split_k, fold, len(weights))
    return kernel_fn, args, constexprs


def _tl_arguments(head, m, n, k, x2d, config, steps, split_k, use_asm, bf16_via_int):
    """(kernel, arguments, constexprs) of a ``tl`` launch."""
    lookup = config.lookup if kernel.TRITON_COMPILES_SHARED_TABLES else 0  # gathers compile from Triton 3.4
    return nf4_matmul_kernel, head + (m, n, k, x2d.stride(0)), dict(
        SPLIT_K=split_k, STEPS_PER_SPLIT=steps // split_k, DOT=config.dot, USE_ASM=use_asm, BF16_VIA_INT=bf16_via_int,
        LOOKUP=lookup, EVEN=n % config.block_n == 0 and k % config.block_k == 0, num_stages=config.num_stages)


# --------------------------------------------------------------------------------------------
# Launching, and launching again
# --------------------------------------------------------------------------------------------
# The fused matmul's launches, by everything they read but x, the output and the split-K partial sums (the weight's and
# the bias' addresses, the sizes, x's row stride, the alignments Triton specializes on, the config, the fold counters):
# a repeated call replays them without Triton's argument binding (NOTES.md item 76). Under NF4_TRITON_PLANS=0 none is
# kept.
LAUNCHES = {}
MOST_LAUNCHES = 4096


def _replay_key(x2d, out, packed, tables, bias, counters, m, n, k, blocksize, blocksize2, nested, fp4, config,
                use_asm, bf16_via_int):
    absmax, code, absmax2, code2, offset = tables
    return (x2d.device.index, x2d.dtype, m, n, k, x2d.stride(0), x2d.data_ptr() % 16, out.data_ptr() % 16,
            packed.data_ptr(), absmax.data_ptr(), code.data_ptr(), absmax2.data_ptr(), code2.data_ptr(),
            offset.data_ptr(), None if bias is None else bias.data_ptr(), blocksize, blocksize2, nested, fp4, config,
            use_asm, bf16_via_int, None if counters is None else counters.data_ptr())


def _replay(launches, x2d, out, partials, gluon):
    """A recorded call's launches again with this call's x, output and partial sums."""
    stream = torch._C._cuda_getCurrentRawStream(x2d.device.index)
    fused, reduce = launches
    if partials is None:
        fused(stream, x2d.data_ptr(), out.data_ptr())
    elif gluon:  # the Gluon kernels write out (or fold) and take the partial sums apart
        fused(stream, x2d.data_ptr(), out.data_ptr(), partials.data_ptr())
    else:
        fused(stream, x2d.data_ptr(), partials.data_ptr())
    if reduce is not None:
        reduce(stream, partials.data_ptr(), out.data_ptr())


def launch_fused(x2d, packed, tables, bias, out, *, n, k, blocksize, blocksize2, nested, fp4, config, capability,
                 members=()):
    """Launch the fused matmul (and the split-K reduction, where not folded) for validated arguments on a GPU of
    ``capability``. ``members``: (packed, tables, out) of up to two more weights of the same format read by the same x
    (Gluon kernels, no bias, their rows after this weight's, ``n`` the rows of all): one launch where its split-K sum
    folds, else one launch each."""
    if packed.data_ptr() % 4:
        packed = packed.clone()  # int32 word loads need 4-byte alignment; a fresh allocation has it
    gluon = not isinstance(config, TlConfig)
    m = x2d.shape[0]
    use_asm, bf16_via_int = kernel.arithmetic(capability)
    steps = -(-k // config.block_k)  # not triton.cdiv: a constexpr function, 1.5 us a host call
    split_k = largest_divisor(steps, config.split_k)
    grid = (-(-n // config.block_n), -(-m // config.block_m), split_k)
    capturing = not INTERPRET and torch.cuda.is_current_stream_capturing()
    partials = counters = None
    if split_k > 1:  # this call's own (the caching allocator's, stream-ordered): no other call touches them
        partials = _empty_fp32(split_k * m * n, x2d.device)
        if gluon and config.fold and not INTERPRET:
            counters = fold_counters(x2d.device, grid[0] * grid[1], capturing)
    fold = counters is not None
    if members and split_k > 1 and not fold:  # no counters left for the group's tiles: one launch a weight
        for packed_j, tables_j, out_j in ((packed, tables, out),) + tuple(members):
            launch_fused(x2d, packed_j, tables_j, None, out_j, n=out_j.shape[1], k=k, blocksize=blocksize,
                         blocksize2=blocksize2, nested=nested, fp4=fp4, config=config, capability=capability)
        return out
    key = None
    if (not INTERPRET and fastpath.ENABLED and not fastpath.launch_hooks_active() and not members
            and torch._C._cuda_getDevice() == x2d.device.index and not capturing):
        key = _replay_key(x2d, out, packed, tables, bias, counters, m, n, k, blocksize, blocksize2, nested, fp4, config,
                          use_asm, bf16_via_int)
        launches = LAUNCHES.get(key)
        if launches is not None:
            _replay(launches, x2d, out, partials, gluon)
            return out
    # mma.py's output, the tl kernel's output or partial sums: what a replay passes anew at 8, beside x at 0
    target = out if gluon or split_k == 1 else partials
    head = (x2d, packed, *tables, bias if bias is not None else out, target)
    if gluon:
        kernel_fn, args, constexprs = _gluon_arguments(head, x2d, out, partials, counters, members, m, n, k, config,
                                                        steps, split_k, fold)
    else:
        kernel_fn, args, constexprs = _tl_arguments(head, m, n, k, x2d, config, steps, split_k, use_asm, bf16_via_int)
    options = dict(BLOCKSIZE=blocksize, BLOCKSIZE2=blocksize2, NESTED=nested, FP4=fp4, X_DTYPE=TL_DTYPE[x2d.dtype],
                   BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                   HAS_BIAS=bias is not None and (split_k == 1 or fold), USE_INT64=n * k > 2**31 - 1,
                   num_warps=config.num_warps, **constexprs)
    varying = (0, 8, 9) if gluon and partials is not None else (0, 8)  # x, the output or partials, Gluon's partials
    fused = fastpath.run(kernel_fn, grid, args, options, None if key is None else varying)
    reduce = None
    if split_k > 1 and not fold:
        block = 1024
        reduce = fastpath.run(split_k_reduce_kernel, (triton.cdiv(m * n, block), 1, 1), (
            partials, bias if bias is not None else out, out, m * n, n), dict(
            SPLIT_K=split_k, HAS_BIAS=bias is not None, OUT_DTYPE=TL_DTYPE[x2d.dtype], BF16_VIA_INT=bf16_via_int,
            BLOCK=block, num_warps=4), None if key is None else (0, 2))
    if key is not None:
        if len(LAUNCHES) >= MOST_LAUNCHES:
            LAUNCHES.clear()
        LAUNCHES[key] = (fused, reduce)
    return out
