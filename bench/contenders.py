"""Who is timed: the dequantizers by contender name (ours, bitsandbytes, Unsloth's two paths, PEFT),
and two measuring instruments beside them that move the same bytes without decoding:
``floor (no decode)``, a kernel that reads the packed bytes and the absmax and writes the output,
and ``copy (same bytes)``, a device-to-device copy of as many bytes. For the matmul, ``floor (bytes
once)``: a kernel that reads a weight's packed codes and absmax once and writes a zero output, one
launch that does nothing but read what a 4-bit matmul must read."""

import math

import torch
import triton
import triton.language as tl

import bench.weights
from nf4_triton import kernel
from nf4_triton.fastpath import jit, sum_combine

# Measuring instruments among the contenders: they move the same bytes but do not dequantize.
INSTRUMENTS = ("floor (no decode)", "copy (same bytes)")
MATMUL_FLOOR = "floor (bytes once)"


def contenders(log=print):
    """name -> fn(packed, state); a missing package drops its contenders with one line."""
    import bitsandbytes.functional as F

    found = {"nf4-triton": kernel.dequantize_nf4, "bitsandbytes": F.dequantize_4bit, **unsloth_functions(log)}
    try:
        from peft.utils.integrations import dequantize_module_weight

        found["peft"] = lambda packed, state: dequantize_module_weight(bench.weights.params4bit_module(packed, state))
    except Exception as error:
        log(f"peft: skipped ({type(error).__name__}: {error})")
    found["floor (no decode)"] = expand_floor
    found["copy (same bytes)"] = same_bytes_copy
    return found


def unsloth_functions(log=print):
    """Unsloth's fused fast_dequantize and its 2025 two-launch path, by contender name; a missing
    one is left out with one line saying why."""
    try:
        from unsloth.kernels import utils as unsloth_utils
    except Exception as error:  # not installed, or no GPU for it
        log(f"unsloth: skipped ({type(error).__name__}: {error})")
        return {}
    found = {"unsloth-fused": unsloth_utils.fast_dequantize}
    if hasattr(unsloth_utils, "_fast_dequantize_ctypes"):
        found["unsloth-2025"] = unsloth_utils._fast_dequantize_ctypes
    else:
        log("unsloth: no _fast_dequantize_ctypes, the 2025 path is skipped")
    return found


def unsloth_fast_dequantize(log=print):
    """Unsloth's fast_dequantize, or None (with one line saying why)."""
    return unsloth_functions(log).get("unsloth-fused")


@triton.jit
def _expand_floor_kernel(
    packed_ptr,  # uint8 [n_bytes]
    absmax_ptr,  # uint8 [n_bytes / BYTES_PER_ABSMAX]
    code_ptr,  # unused, like the three below: the launch carries our kernel's pointer arguments
    absmax2_ptr,
    code2_ptr,
    offset_ptr,
    out_ptr,  # fp16/bf16/fp32 [2 * n_bytes]
    n_bytes,  # packed bytes
    BYTES_PER_ABSMAX: tl.constexpr,  # packed bytes per absmax byte (blocksize / 2)
    BYTES_PER_PROGRAM: tl.constexpr,  # packed bytes per program
    OUT_HINT: tl.constexpr,  # eviction policy of the output stores
):
    """The dequantization's memory traffic with no decoding: each byte becomes two outputs (its
    nibbles as numbers, plus its block's absmax byte so that the absmax is read as ours reads it),
    with the kernel's tile size and output eviction hint."""
    ROWS: tl.constexpr = BYTES_PER_PROGRAM // BYTES_PER_ABSMAX
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    absmax = tl.load(absmax_ptr + rows, mask=rows * BYTES_PER_ABSMAX < n_bytes, other=0)
    offsets = rows[:, None] * BYTES_PER_ABSMAX + tl.arange(0, BYTES_PER_ABSMAX)[None, :]
    packed = tl.load(packed_ptr + offsets, mask=offsets < n_bytes, other=0) + absmax[:, None]
    values = tl.join((packed >> 4).to(tl.float32), (packed & 0xF).to(tl.float32)).reshape(ROWS, 2 * BYTES_PER_ABSMAX)
    out_offsets = 2 * rows[:, None] * BYTES_PER_ABSMAX + tl.arange(0, 2 * BYTES_PER_ABSMAX)[None, :]
    tl.store(out_ptr + out_offsets, values.to(out_ptr.dtype.element_ty), mask=out_offsets < 2 * n_bytes,
             eviction_policy=OUT_HINT)


def _floor_launch(packed, state):
    """(packed bytes per program, warps, output eviction hint): the tile, warps and store hint
    ``kernel.py`` picks for this weight."""
    launch = kernel.choose_launch(packed, state.dtype, math.prod(state.shape), blocksize=state.blocksize,
                                  blocksize2=state.state2.blocksize, nested=True, fp4=False)
    per_program = max(launch.constexprs["BYTES_PER_PROGRAM"], state.blocksize // 2)
    return per_program, launch.num_warps, "evict_first" if launch.constexprs["STREAM_STORES"] else ""


def expand_floor(packed, state, launch=None):
    """The floor kernel on a weight: the bytes ours reads and writes (absmax included), passed all
    of our kernel's pointer arguments. ``launch``: ``_floor_launch``'s result, if already known."""
    out = torch.empty(tuple(state.shape), dtype=state.dtype, device=packed.device)
    n_bytes = out.numel() // 2
    per_program, num_warps, out_hint = _floor_launch(packed, state) if launch is None else launch
    _expand_floor_kernel[(triton.cdiv(n_bytes, per_program),)](
        packed, state.absmax, state.code, state.state2.absmax, state.state2.code, state.offset, out, n_bytes,
        state.blocksize // 2, per_program, out_hint, num_warps=num_warps)
    return out


def compiled_floor(packed, state):
    """The floor kernel compiled whole in the default mode, the launch configuration worked out
    beforehand: a graph with our six input tensors, our kernel's pointer arguments and our bytes,
    but no validation and no decode."""
    launch = _floor_launch(packed, state)
    compiled = torch.compile(lambda weight: expand_floor(weight, state, launch), fullgraph=True)
    return lambda: compiled(packed)


def same_bytes_copy(packed, state):
    """A device-to-device copy moving as many bytes as the dequantization (half read, half
    written): what the copy roofline reaches at this size, launch and ramp included."""
    half = bench.weights.bytes_moved(tuple(state.shape), state.dtype) // 2
    return torch.empty(half, dtype=torch.uint8, device=packed.device).copy_(_copy_source(half, packed.device))


def _copy_source(n_bytes, device):
    if _COPY_SOURCE.get(device) is None or _COPY_SOURCE[device].numel() < n_bytes:
        _COPY_SOURCE[device] = torch.zeros(n_bytes, dtype=torch.uint8, device=device)
    return _COPY_SOURCE[device][:n_bytes]


_COPY_SOURCE = {}


@jit
def _bytes_once_kernel(
    words_ptr,  # int32 [n_words]: the packed codes, eight a word
    absmax_ptr,  # uint8 [ceil(n_words / WORDS_PER_ABSMAX)]
    out_ptr,  # [n_out] in x's dtype, written with zeros
    checksum_ptr,  # int32 [programs]: each program's sum of its words and absmax bytes
    n_words,  # words of packed codes
    n_out,  # output elements
    WORDS_PER_PROGRAM: tl.constexpr,  # packed words each program reads
    WORDS_PER_ABSMAX: tl.constexpr,  # blocksize / 8
    OUT_PER_PROGRAM: tl.constexpr,  # output elements each program zeroes (a power of two)
):
    """Reads every word and absmax byte once, sums them (so that no load is dead) and writes zeros
    (``tl.reduce`` with ``fastpath.sum_combine`` and ``tl.full``: the interpreter cannot call the jitted
    ``tl.sum`` and ``tl.zeros`` from a kernel it runs alone)."""
    pid = tl.program_id(0)
    words = pid * WORDS_PER_PROGRAM + tl.arange(0, WORDS_PER_PROGRAM)
    total = tl.reduce(tl.load(words_ptr + words, mask=words < n_words, other=0), 0, sum_combine)
    BLOCKS: tl.constexpr = WORDS_PER_PROGRAM // WORDS_PER_ABSMAX
    blocks = pid * BLOCKS + tl.arange(0, BLOCKS)
    total += tl.reduce(tl.load(absmax_ptr + blocks, mask=blocks * WORDS_PER_ABSMAX < n_words, other=0).to(tl.int32),
                       0, sum_combine)
    tl.store(checksum_ptr + pid, total)
    outs = pid * OUT_PER_PROGRAM + tl.arange(0, OUT_PER_PROGRAM)
    tl.store(out_ptr + outs, tl.full([OUT_PER_PROGRAM], 0, out_ptr.dtype.element_ty), mask=outs < n_out)


BYTES_ONCE_WORDS = 2048  # packed words a program (8 KiB)
BYTES_ONCE_WARPS = 4


def bytes_once(x, packed, state, checksums=None, out=None):
    """The matmul's floor for ``x @ W.T``: W's packed codes and absmax bytes read once, an output of
    ``x @ W.T``'s shape and dtype written with zeros, one launch. ``checksums``: a list that receives
    the programs' int32 sums (the tests check that every byte was read); ``out``: where to write."""
    if not (state.nested and state.absmax.dtype == torch.uint8):
        raise ValueError("bytes_once reads double-quantized (uint8) absmax; this state's absmax is "
                         f"{state.absmax.dtype}")
    n_out_features, n_in_features = state.shape
    if out is None:
        out = torch.empty(*x.shape[:-1], n_out_features, dtype=x.dtype, device=x.device)
    n_words = n_out_features * n_in_features // 8
    if n_words == 0:
        return out.zero_()
    programs = triton.cdiv(n_words, BYTES_ONCE_WORDS)
    sums = torch.empty(programs, dtype=torch.int32, device=x.device)
    _bytes_once_kernel[(programs,)](
        packed.view(torch.uint8).reshape(-1).view(torch.int32), state.absmax, out, sums, n_words, out.numel(),
        BYTES_ONCE_WORDS, state.blocksize // 8, triton.next_power_of_2(triton.cdiv(max(out.numel(), 1), programs)),
        num_warps=BYTES_ONCE_WARPS)
    if checksums is not None:
        checksums.append(sums)
    return out
