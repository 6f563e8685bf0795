"""One fused Triton kernel that dequantizes a bitsandbytes 4-bit weight (NF4 or FP4).

The format (bitsandbytes, ``compress_statistics=True``)::

    scale(b)  = fp32(code2[absmax_u8[b]] * absmax2[b // BLOCKSIZE2]) + offset     # two roundings
    out[i]    = T(fp32(code[q(i)] * scale(i // BLOCKSIZE)))                        # one more, then the cast

``q(i)`` is byte ``i // 2`` of the packed weight, high nibble for even ``i``. Without double
quantization ``scale(b)`` is the fp32 ``absmax[b]``. One launch decodes the absmax and forms the
weight; the output is the only allocation.

Bit-exactness rests on four facts, each tested on the GPU against bitsandbytes:
- no fused multiply-add may form in the scale: the inline-PTX path uses ``mul.rn.ftz.f32`` and
  ``add.rn.f32`` (PTX never contracts instructions with an explicit rounding mode); the pure-Triton
  path is compiled with ``enable_fp_fusion=False``;
- bitsandbytes' CUDA kernels are built with ``--use_fast_math``, so both multiplies flush
  subnormal inputs and results to zero of the same sign; the offset is added by PyTorch and keeps
  them (zero and near-zero blocks decode to +0.0 or -0.0 by these rules);
- the casts to fp16 and bf16 round to nearest even; where the hardware has no fp32-to-bf16
  conversion (sm_75) or Triton's interpreter truncates, bf16 is rounded with integer operations;
- 64-bit offsets are used once the element count passes 2**31 - 1.

Without CUDA (CI, laptops) the same kernel runs on CPU tensors through Triton's interpreter.

The module reads top-down: the kernel and its helpers; the launch choice (named tiers per GPU, a
pure function of the weight and the device's facts); validation; launching; the public API; the
torch.library operator that torch.compile sees. The per-call fast path lives in ``fastpath.py``.
"""

import contextlib
import ctypes
import numbers
import operator
import os
import struct
import threading
import typing
import weakref

import torch
import triton
import triton.language as tl

import fastpath

__all__ = ["dequantize_nf4", "your_dequantize_nf4", "build_plan", "set_launch_config", "launch_config",
           "kernel_variant", "choose_launch", "device_facts", "LaunchConfig", "LaunchTier", "Launch", "KernelArgs",
           "dequantize_4bit_kernel"]

# Without CUDA, CPU tensors through Triton's interpreter. The interpreter is chosen here for this
# module's kernels alone: TRITON_INTERPRET is read, never set, so other Triton code in the process
# is left as the user configured it (TRITON_INTERPRET=1 or 0 still forces either).
_INTERPRET_ENV = os.environ.get("TRITON_INTERPRET")
INTERPRET = (_INTERPRET_ENV not in ("", "0")) if _INTERPRET_ENV is not None else not torch.cuda.is_available()


def _jit(fn):
    """``triton.jit``, or Triton's interpreter for ``fn`` when INTERPRET."""
    if INTERPRET:
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(fn)
    return triton.jit(fn)


OUTPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_TL_DTYPE = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
_INT32_MAX = 2**31 - 1


# --------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------
@_jit
def _flush_subnormal(x):
    """A subnormal fp32 becomes a zero of the same sign, as the hardware's ``.ftz`` does."""
    bits = x.to(tl.uint32, bitcast=True)
    return tl.where((bits & 0x7F800000) == 0, bits & 0x80000000, bits).to(tl.float32, bitcast=True)


@_jit
def _mul_ftz(a, b, USE_ASM: tl.constexpr):
    """fp32 product rounded once, subnormal inputs and result flushed to signed zero: the
    multiply of bitsandbytes' CUDA kernels (built with ``--use_fast_math``). The PTX form can
    never be contracted into an FMA."""
    if USE_ASM:
        return tl.inline_asm_elementwise(
            "mul.rn.ftz.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return _flush_subnormal(_flush_subnormal(a) * _flush_subnormal(b))


@_jit
def _add_rn(a, b, USE_ASM: tl.constexpr):
    """fp32 sum rounded once, subnormals kept: the offset is added by PyTorch, not by a fast-math
    kernel (see ``_mul_ftz``)."""
    if USE_ASM:
        return tl.inline_asm_elementwise(
            "add.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return a + b


@_jit
def _lookup(table_ptr, indices, TABLE_SIZE: tl.constexpr, TABLE_HINT: tl.constexpr, SHARED_TABLES: tl.constexpr):
    """table[indices] for an fp32 table of TABLE_SIZE entries: gathered from global memory, or
    with SHARED_TABLES the table is loaded whole (independently of the indices) and looked up
    with tl.gather, which Triton lowers through shared memory."""
    if SHARED_TABLES:
        table = tl.load(table_ptr + tl.arange(0, TABLE_SIZE), eviction_policy=TABLE_HINT)
        return tl.reshape(tl.gather(table, tl.reshape(indices, (indices.numel,)), 0), indices.shape)
    else:
        return tl.load(table_ptr + indices, eviction_policy=TABLE_HINT)


@_jit
def _decode(codes, scale, code_ptr, TABLE_HINT: tl.constexpr, FP4: tl.constexpr, USE_ASM: tl.constexpr,
            SHARED_TABLES: tl.constexpr):
    """fp32 weights from int32 4-bit codes and their block scales (same shape)."""
    values = _lookup(code_ptr, codes, 16, TABLE_HINT, SHARED_TABLES)
    if FP4:
        # bitsandbytes' CUDA kernel forms an FP4 value as sign * magnitude, so code 8 decodes to
        # -0.0 where the table holds +0.0: set the sign bit from the code's top bit.
        sign = (codes >> 3).to(tl.uint32) << 31
        values = (values.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    return _mul_ftz(values, scale, USE_ASM)


@_jit
def _fp32_to_bf16_rne(x):
    """Round fp32 to bf16, nearest even, with integer operations only (NaN stays NaN)."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    quiet_nan = (bits >> 16) | 0x40
    rounded = tl.where(x != x, quiet_nan, rounded)
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@_jit
def dequantize_4bit_kernel(
    # inputs
    packed_ptr,  # uint8 [ceil(n_elements / 2)], two 4-bit codes per byte, high nibble first
    absmax_ptr,  # uint8 [n_blocks] when NESTED, else fp32 [n_blocks]
    code_ptr,  # fp32 [16], the 4-bit codebook (NF4 or FP4)
    absmax2_ptr,  # fp32 [ceil(n_blocks / BLOCKSIZE2)] (NESTED only)
    code2_ptr,  # fp32 [256], the 8-bit codebook of the absmax (NESTED only)
    offset_ptr,  # fp32 [1], added to every decoded absmax (NESTED only)
    # output
    out_ptr,  # OUT_DTYPE [n_elements]
    # sizes
    n_elements,  # number of output elements
    n_bytes,  # packed bytes holding them, ceil(n_elements / 2); a separate argument so that
    #           Triton can see its divisibility by 16 and vectorize the masked loads
    # format
    BLOCKSIZE: tl.constexpr,  # elements per absmax (power of two >= 2)
    BLOCKSIZE2: tl.constexpr,  # absmax values per absmax2 (NESTED only)
    NESTED: tl.constexpr,  # absmax itself is 8-bit quantized (compress_statistics=True)
    FP4: tl.constexpr,  # codes >= 8 carry the sign bit (quant_type="fp4")
    OUT_DTYPE: tl.constexpr,  # tl.float16, tl.bfloat16 or tl.float32
    # implementation
    BYTES_PER_PROGRAM: tl.constexpr,  # packed bytes per program (power of two)
    USE_INT64: tl.constexpr,  # 64-bit offsets (n_elements > 2**31 - 1)
    WORD_LOADS: tl.constexpr,  # read the packed bytes as int32 words (4-byte aligned, n_bytes % 4 == 0,
    #                            BLOCKSIZE % 8 == 0); else byte loads
    USE_ASM: tl.constexpr,  # inline-PTX arithmetic (NVIDIA only)
    BF16_VIA_INT: tl.constexpr,  # round to bf16 with integer ops (sm_75, interpreter)
    EVICTION_HINTS: tl.constexpr,  # evict_last on the tables
    SHARED_TABLES: tl.constexpr,  # look the codebooks up in shared memory (tl.gather), not global memory
    STREAM_STORES: tl.constexpr,  # evict_first on the output stores (outputs of several L2 sizes)
):
    # A tile is ROWS x COLS packed bytes; every row lies inside one quantization block, so the
    # scale is decoded once per row and broadcast along it.
    BYTES_PER_BLOCK: tl.constexpr = BLOCKSIZE // 2
    COLS: tl.constexpr = BYTES_PER_BLOCK if BYTES_PER_BLOCK < BYTES_PER_PROGRAM else BYTES_PER_PROGRAM
    ROWS: tl.constexpr = BYTES_PER_PROGRAM // COLS
    # Tables (absmax, codebooks) are re-read by neighbouring programs: keep them (evict_last).
    TABLE_HINT: tl.constexpr = "evict_last" if EVICTION_HINTS else ""
    OUT_HINT: tl.constexpr = "evict_first" if STREAM_STORES else ""

    pid = tl.program_id(0)
    if USE_INT64:
        pid = pid.to(tl.int64)
    row_start = pid * BYTES_PER_PROGRAM + tl.arange(0, ROWS) * COLS  # [ROWS] first byte of row
    row_mask = row_start < n_bytes
    block = row_start // BYTES_PER_BLOCK  # [ROWS]
    if NESTED:
        absmax_q = tl.load(absmax_ptr + block, mask=row_mask, other=0, eviction_policy=TABLE_HINT)
        absmax_code = _lookup(code2_ptr, absmax_q.to(tl.int32), 256, TABLE_HINT, SHARED_TABLES)
        absmax2 = tl.load(absmax2_ptr + block // BLOCKSIZE2, mask=row_mask, other=0, eviction_policy=TABLE_HINT)
        offset = tl.load(offset_ptr)
        scale = _add_rn(_mul_ftz(absmax_code, absmax2, USE_ASM), offset, USE_ASM)
    else:
        scale = tl.load(absmax_ptr + block, mask=row_mask, other=0.0, eviction_policy=TABLE_HINT)

    # No eviction hint on the packed load: evict_first there cost 3.5 us at 28672x8192 on the H100
    # (NOTES.md, item 9).
    if WORD_LOADS:
        # int32 words, little-endian: byte k holds bits 8k..8k+7, so the word's element e sits at
        # bit 8 * (e // 2), plus 4 for the high nibble (even e). The codes come out in output
        # order and need no interleaving.
        WORDS_PER_ROW: tl.constexpr = COLS // 4
        word_offsets = row_start[:, None] // 4 + tl.arange(0, WORDS_PER_ROW)[None, :]
        words = tl.load(packed_ptr.to(tl.pointer_type(tl.int32)) + word_offsets, mask=word_offsets < n_bytes // 4,
                        other=0)
        element = tl.arange(0, 8)
        shifts = 8 * (element // 2) + 4 * (1 - element % 2)
        codes = tl.reshape((words[:, :, None] >> shifts[None, None, :]) & 0xF, (ROWS, 2 * COLS))
        values = _decode(codes, tl.broadcast_to(scale[:, None], (ROWS, 2 * COLS)), code_ptr, TABLE_HINT, FP4, USE_ASM,
                         SHARED_TABLES)
    else:
        # Bytes: decode the high and low nibbles apart, then interleave the fp32 values (joining
        # the codes before the lookup instead measured 13 to 30 % slower on the H100, NOTES.md item 14).
        byte_offsets = row_start[:, None] + tl.arange(0, COLS)[None, :]
        packed = tl.load(packed_ptr + byte_offsets, mask=byte_offsets < n_bytes, other=0).to(tl.int32)
        row_scale = tl.broadcast_to(scale[:, None], (ROWS, COLS))
        high = _decode(packed >> 4, row_scale, code_ptr, TABLE_HINT, FP4, USE_ASM, SHARED_TABLES)
        low = _decode(packed & 0xF, row_scale, code_ptr, TABLE_HINT, FP4, USE_ASM, SHARED_TABLES)
        values = tl.join(high, low).reshape(ROWS, 2 * COLS)  # element 2j is byte j's high nibble

    if OUT_DTYPE == tl.bfloat16 and BF16_VIA_INT:
        values = _fp32_to_bf16_rne(values)
    else:
        values = values.to(OUT_DTYPE)
    out_offsets = 2 * row_start[:, None] + tl.arange(0, 2 * COLS)[None, :]
    tl.store(out_ptr + out_offsets, values, mask=out_offsets < n_elements, eviction_policy=OUT_HINT)


# --------------------------------------------------------------------------------------------
# Launch choice
# --------------------------------------------------------------------------------------------
MiB = 1 << 20


class LaunchConfig(typing.NamedTuple):
    """How the kernel is launched."""

    bytes_per_program: int  # packed bytes one program decodes
    num_warps: int
    shared_tables: bool  # codebooks looked up in shared memory (tl.gather), else in global memory


class LaunchTier(typing.NamedTuple):
    """``config`` for packed weights of at least ``smallest_bytes``; ``fallback`` where this Triton
    cannot compile a shared-memory lookup."""

    smallest_bytes: int
    config: LaunchConfig
    fallback: typing.Optional[LaunchConfig] = None

    def __repr__(self):
        config, fallback = self.config, self.fallback
        text = (f"from {self.smallest_bytes / MiB:g} MiB: {config.bytes_per_program} bytes over "
                f"{config.num_warps} warps, {'shared' if config.shared_tables else 'global'} codebooks")
        return text + (f" (else {fallback.bytes_per_program} over {fallback.num_warps}, global)" if fallback else "")


# Compute capability -> launch tiers; a weight takes the last tier it reaches. Shared-memory
# codebooks cost a barrier and a shared load per code, but ptxas gives the program fewer registers
# (32 instead of 40 at 2048/4, 32 instead of 64 at 2048/2), so more programs stay resident.
# sm_90, measured on the H100 by GPU time in paired rounds (NOTES.md, items 19, 41, 43):
_SMALL = LaunchConfig(1024, 4, False)  # 4.48 against 4.68 us or more at 2048x2048 fp16
_MID_GLOBAL = LaunchConfig(2048, 4, False)
LAUNCH_CONFIGS = {
    (9, 0): (
        LaunchTier(0, _SMALL),
        # 5.18 against 6.37 us (1024/4) at 5120x1024 bf16
        LaunchTier(9 * MiB // 4, LaunchConfig(2048, 4, True), fallback=_MID_GLOBAL),
        # 2 warps: 32 programs per SM, one wave up to 8.25 MiB; 14.50 against 15.22 us at 8192x2048 fp16
        LaunchTier(17 * MiB // 4, LaunchConfig(2048, 2, True), fallback=_MID_GLOBAL),
        # level with 1024/2 and 512/4 shared from 20 to 40 MiB; 33.38 against 34.04 us at 9216x4096 fp16
        LaunchTier(17 * MiB, _MID_GLOBAL),
        # 200.69 against 201.84 us at 28672x8192 bf16; 512/4 with global codebooks takes 217 us there
        LaunchTier(48 * MiB, LaunchConfig(512, 4, True), fallback=_MID_GLOBAL),
    ),
    # Reasoned, not measured: at 300 to 320 GB/s about 320 KB in flight chip-wide saturate the T4 and
    # the L4, and 1024-byte programs put 40 to 60 KB per SM in flight. The notebooks sweep there.
    (8, 9): (LaunchTier(0, _SMALL),),
    (7, 5): (LaunchTier(0, _SMALL),),
}
DEFAULT_LAUNCH_TIERS = (LaunchTier(0, _SMALL),)
# Triton 3.3.1's compiler aborts on the shared-memory gathers (an assertion in
# OptimizeThreadLocality); from 3.4 they compile and run bit-exact on the GPU (README, Triton versions).
TRITON_COMPILES_SHARED_TABLES = tuple(int(part) for part in triton.__version__.split(".")[:2]) >= (3, 4)
_launch_override = None


def launch_config(capability, n_bytes=0):
    """The LaunchConfig for a packed weight of ``n_bytes`` on a GPU of ``capability``:
    set_launch_config's choice, else the tier that size reaches."""
    if _launch_override is not None:
        return _launch_override
    tiers = LAUNCH_CONFIGS.get(tuple(capability), DEFAULT_LAUNCH_TIERS)
    tier = next(tier for tier in reversed(tiers) if n_bytes >= tier.smallest_bytes)
    return tier.config if TRITON_COMPILES_SHARED_TABLES or not tier.config.shared_tables else tier.fallback


def set_launch_config(bytes_per_program=None, num_warps=None, shared_tables=False):
    """Use this configuration for every later call (no arguments: back to the table)."""
    global _launch_override
    if bytes_per_program is None and num_warps is None:
        _launch_override = None
    else:
        _require(_is_power_of_two(bytes_per_program) and bytes_per_program >= 16,
                 f"set_launch_config: bytes_per_program must be a power of two >= 16, got {bytes_per_program}")
        _require(num_warps in (1, 2, 4, 8, 16, 32),
                 f"set_launch_config: num_warps must be a power of two from 1 to 32, got {num_warps}")
        _require(isinstance(shared_tables, bool), f"set_launch_config: shared_tables must be a bool, got {shared_tables!r}")
        _require(TRITON_COMPILES_SHARED_TABLES or not shared_tables,
                 f"set_launch_config: Triton {triton.__version__} cannot compile the shared-memory codebook lookup "
                 "(3.4 or later can)")
        _launch_override = LaunchConfig(bytes_per_program, num_warps, shared_tables)
    fastpath.PLANS.clear()  # plans hold kernels compiled for the old configuration


# evict_first on the output's stores pays only for outputs of several L2 sizes: on the H100
# (50 MB L2) -1.9 us at 940 MB, +1.1 / +0.7 us at 117 MB (NOTES.md, item 15). The same multiple of
# the L2 is a guess for the T4 (4 MB) and the L4 (48 MB).
STREAM_STORES_L2_MULTIPLE = 4


def kernel_variant(out_dtype, *, nested, capability, l2_bytes, fp4=False, blocksize=64, blocksize2=256, n_elements=0,
                   word_aligned=True, use_asm=None, bf16_via_int=None, bytes_per_program=None, eviction_hints=True,
                   shared_tables=None):
    """The constexpr arguments of one kernel variant, from the weight and the device's facts
    (``device_facts``; the AOT compile test passes other GPUs'). ``word_aligned``: the packed bytes
    start on a 4-byte boundary. A pure function but for ``set_launch_config``'s override."""
    if bytes_per_program is None or shared_tables is None:
        tier_bytes_per_program, _, tier_shared_tables = launch_config(capability, (n_elements + 1) // 2)
        bytes_per_program = tier_bytes_per_program if bytes_per_program is None else bytes_per_program
        shared_tables = tier_shared_tables if shared_tables is None else shared_tables
    if use_asm is None:
        use_asm = not INTERPRET and torch.version.hip is None
    if bf16_via_int is None:
        bf16_via_int = INTERPRET or capability < (8, 0)
    return dict(
        BLOCKSIZE=blocksize,
        BLOCKSIZE2=blocksize2 if nested else 1,
        NESTED=nested,
        FP4=fp4,
        OUT_DTYPE=_TL_DTYPE[out_dtype],
        BYTES_PER_PROGRAM=bytes_per_program,
        # Offsets reach 2 * (n_bytes + bytes_per_program): past int32, compute them in int64.
        USE_INT64=n_elements + 2 * bytes_per_program > _INT32_MAX,
        WORD_LOADS=word_aligned and blocksize % 8 == 0 and (n_elements + 1) // 2 % 4 == 0,
        USE_ASM=use_asm,
        BF16_VIA_INT=bf16_via_int,
        EVICTION_HINTS=eviction_hints,
        SHARED_TABLES=shared_tables,
        STREAM_STORES=eviction_hints and 0 < STREAM_STORES_L2_MULTIPLE * l2_bytes <= n_elements * out_dtype.itemsize,
    )


def compile_options(use_asm):
    """Without the inline PTX, the compiler must not contract the scale into an FMA."""
    return {"enable_fp_fusion": bool(use_asm)}



_DEVICE_FACTS = {}


def device_facts(device=None):
    """(compute capability, L2 bytes) of a CUDA device (default: the current one); ((0, 0), 0)
    without one."""
    if INTERPRET or not torch.cuda.is_available():
        return (0, 0), 0
    index = torch.cuda.current_device() if device is None or device.index is None else device.index
    if index not in _DEVICE_FACTS:
        properties = torch.cuda.get_device_properties(index)
        _DEVICE_FACTS[index] = (properties.major, properties.minor), properties.L2_cache_size
    return _DEVICE_FACTS[index]


class Launch(typing.NamedTuple):
    """How one call launches the kernel."""

    constexprs: dict  # the kernel's constexpr arguments (kernel_variant)
    num_warps: int
    n_bytes: int  # packed bytes read
    grid: tuple


def choose_launch(packed, dtype, n_elements, *, blocksize, blocksize2, nested, fp4, overrides=None):
    """The Launch for a packed weight on its device (``overrides``: constexprs and ``num_warps``
    forced by tests and sweeps)."""
    overrides = dict(overrides or {})
    capability, l2_bytes = device_facts(packed.device)
    n_bytes = (n_elements + 1) // 2
    config = launch_config(capability, n_bytes)
    num_warps = overrides.pop("num_warps", config.num_warps)
    constexprs = kernel_variant(dtype, nested=nested, fp4=fp4, blocksize=blocksize, blocksize2=blocksize2,
                                n_elements=n_elements, word_aligned=_word_aligned(packed), capability=capability,
                                l2_bytes=l2_bytes,
                                bytes_per_program=overrides.pop("BYTES_PER_PROGRAM", config.bytes_per_program),
                                shared_tables=overrides.pop("SHARED_TABLES", config.shared_tables))
    constexprs.update(overrides)
    return Launch(constexprs, num_warps, n_bytes, (triton.cdiv(n_bytes, constexprs["BYTES_PER_PROGRAM"]),))


def _word_aligned(packed):
    """Whether the packed bytes start on a 4-byte boundary. Inside torch.compile the tensors are
    fake and have no address: there the storage offset decides, and Inductor copies an input
    that arrives less aligned than the one it compiled for."""
    try:
        return packed.data_ptr() % 4 == 0
    except RuntimeError:
        return packed.storage_offset() * packed.element_size() % 4 == 0


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------
def _is_power_of_two(value):
    return isinstance(value, int) and value >= 1 and value & (value - 1) == 0


def _require(condition, message):
    if not condition:
        raise ValueError(message)


def _as_int(value, name):
    """An integer-like value (int, numpy integer, 0-dim integer tensor) as an int."""
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"dequantize_nf4: {name} must be an integer, got {value!r}") from None


def _dense(tensor):
    """Whether a tensor has strided storage. Inside torch.compile every tensor is (and a
    backward traced there may not read `layout`)."""
    return torch.compiler.is_compiling() or tensor.layout == torch.strided


def _weight_and_state(weight, quant_state):
    """(weight tensor, quant state) from a Linear4bit module, its Params4bit, or a packed tensor
    and its QuantState. Never raises: what does not fit comes back as it is, for the validating
    path to name."""
    if not isinstance(weight, torch.Tensor):
        # A module's registered parameter straight from its dict: nn.Module's __getattr__ is a
        # Python call on every access.
        parameters = getattr(weight, "_parameters", None)
        module_weight = parameters.get("weight") if isinstance(parameters, dict) else None
        if module_weight is None:
            module_weight = getattr(weight, "weight", None)
        if isinstance(module_weight, torch.Tensor):
            weight = module_weight
    if quant_state is None:
        quant_state = getattr(weight, "quant_state", None)
    return weight, quant_state


def _resolve(weight, quant_state):
    """``_weight_and_state`` with a parameter's plain tensor (``.data``) as the packed weight."""
    weight, quant_state = _weight_and_state(weight, quant_state)
    if isinstance(weight, torch.nn.Parameter):
        # Params4bit defines a Python __torch_function__: a plain `.data` costs 3.3 to 4.8 us on
        # the H100 host, 1.0 us with subclass torch functions disabled (NOTES.md, item 21).
        with torch._C.DisableTorchFunctionSubclass():
            weight = weight.data
    return weight, quant_state


def _check_state(packed, qs):
    """Validate the quant state against the packed weight; return the launch arguments."""
    for field in ("absmax", "shape", "dtype", "blocksize", "quant_type", "code"):
        _require(hasattr(qs, field), f"dequantize_nf4: quant_state has no '{field}' (not a bitsandbytes 4-bit QuantState?)")
    _require(qs.quant_type in ("nf4", "fp4"), f"dequantize_nf4: quant_type must be 'nf4' or 'fp4', got {qs.quant_type!r}")
    _require(qs.dtype in OUTPUT_DTYPES, f"dequantize_nf4: output dtype must be float16, bfloat16 or float32, got {qs.dtype}")
    blocksize = _as_int(qs.blocksize, "blocksize")
    _require(_is_power_of_two(blocksize) and blocksize >= 2,
             f"dequantize_nf4: blocksize must be a power of two >= 2, got {blocksize}")
    _require(packed.is_contiguous(), "dequantize_nf4: packed weight must be contiguous (call .contiguous() first)")
    if not isinstance(qs.shape, (tuple, list, torch.Size)):
        raise ValueError(f"dequantize_nf4: quant_state shape must be a tuple of sizes, got {qs.shape!r}")
    # int(): inside torch.compile a graph specializes on the weight's shape (one graph per shape).
    shape = torch.Size([int(_as_int(dim, "every shape entry")) for dim in qs.shape])
    if not all(dim >= 0 for dim in shape):
        raise ValueError(f"dequantize_nf4: shape entries must be >= 0, got {tuple(shape)}")

    device = packed.device
    n_elements = shape.numel()
    n_blocks = -(-n_elements // blocksize)
    n_bytes = packed.numel() * packed.element_size()
    _require(n_bytes >= (n_elements + 1) // 2,
             f"dequantize_nf4: packed weight has {n_bytes} bytes, shape {tuple(shape)} needs {(n_elements + 1) // 2}")
    if not torch.compiler.is_compiling():  # a traced tensor has no storage of its own to measure
        stored = packed.untyped_storage().nbytes() - packed.storage_offset() * packed.element_size()
        _require(stored >= n_bytes, f"dequantize_nf4: packed weight spans {n_bytes} bytes but its storage holds "
                                    f"{max(stored, 0)} from where it starts (the storage was resized under it)")

    def tensor(name, value, dtype, min_numel):
        _require(isinstance(value, torch.Tensor), f"dequantize_nf4: {name} must be a tensor")
        if not _dense(value):
            raise ValueError(f"dequantize_nf4: {name} must be a dense tensor, got {value.layout}")
        _require(value.device == device,
                 f"dequantize_nf4: {name} is on {value.device} but the packed weight is on {device}")
        _require(value.dtype == dtype, f"dequantize_nf4: {name} must be {dtype}, got {value.dtype}")
        _require(value.is_contiguous(), f"dequantize_nf4: {name} must be contiguous")
        _require(value.numel() >= min_numel,
                 f"dequantize_nf4: {name} has {value.numel()} elements, needs at least {min_numel}")
        return value

    code = tensor("code", qs.code, torch.float32, 16)
    nested = bool(getattr(qs, "nested", False))
    if nested:
        state2 = getattr(qs, "state2", None)
        _require(state2 is not None and hasattr(state2, "absmax") and hasattr(state2, "code"),
                 "dequantize_nf4: nested quant_state has no state2 with absmax and code")
        blocksize2 = _as_int(state2.blocksize, "state2 blocksize")
        _require(_is_power_of_two(blocksize2), f"dequantize_nf4: state2 blocksize must be a power of two, got {blocksize2}")
        absmax = tensor("absmax", qs.absmax, torch.uint8, n_blocks)
        absmax2 = tensor("state2.absmax", state2.absmax, torch.float32, -(-n_blocks // blocksize2))
        code2 = tensor("state2.code", state2.code, torch.float32, 256)
        offset = qs.offset
        if not isinstance(offset, torch.Tensor):
            _require(isinstance(offset, numbers.Real) and not isinstance(offset, bool),
                     f"dequantize_nf4: offset must be a float or a one-element tensor, got {offset!r}")
            offset = _offset_tensor(qs, float(offset), device)
        # Kept as it is (one element, usually 0-dim): a reshape here would be one more view per
        # call inside a compiled graph.
        offset = tensor("offset", offset, torch.float32, 1)
        _require(offset.numel() == 1, f"dequantize_nf4: offset must hold one value, got {offset.numel()}")
    else:
        absmax = tensor("absmax", qs.absmax, torch.float32, n_blocks)
        absmax2 = code2 = offset = absmax  # unused by the kernel when NESTED is False
        blocksize2 = 1
    return shape, blocksize, nested, blocksize2, (absmax, code, absmax2, code2, offset)


_OFFSETS = {}  # id(quant_state) -> (weakref to the state, (value as fp32 bytes, device), its tensor)
# Two first calls on one state in two threads get one tensor: the plan kept last records its address.
_OFFSETS_LOCK = threading.Lock()


def _offset_tensor(qs, value, device):
    """The tensor for an offset ``qs`` gives as a Python float: one per state, held while the state
    lives and keeps that value, as the state holds its tables (a plan or a captured CUDA graph reads
    its address). A state without weakrefs gets a tensor for the call: it gets no plan either."""
    if torch.compiler.is_compiling():  # the traced graph makes it and holds it (Dynamo cannot enter a lock)
        return torch.tensor([value], dtype=torch.float32, device=device)
    state_id, value_key = id(qs), (struct.pack("<f", value), device)
    with _OFFSETS_LOCK:
        held = _OFFSETS.get(state_id)
        if held is not None and held[0]() is qs and held[1] == value_key:
            return held[2]
        tensor = torch.tensor([value], dtype=torch.float32, device=device)
        try:
            # The callback's globals are bound now: at interpreter exit a state may die after them.
            state_ref = weakref.ref(qs, lambda ref, state_id=state_id, offsets=_OFFSETS, forget=_forget_offset:
                                    forget(offsets, state_id, ref))
        except TypeError:
            return tensor
        _OFFSETS[state_id] = (state_ref, value_key, tensor)
        return tensor


def _forget_offset(offsets, state_id, state_ref):
    """A state died: free its offset's tensor, unless a newer state already took its id. Without the
    lock: a collection inside ``_offset_tensor`` may run this on the thread that holds it."""
    held = offsets.get(state_id)
    if held is not None and held[0] is state_ref:
        del offsets[state_id]


def _overlaps(a, b):
    """Whether two contiguous tensors share any byte."""
    a_start, b_start = a.data_ptr(), b.data_ptr()
    return (a.device == b.device and a_start < b_start + b.numel() * b.element_size()
            and b_start < a_start + a.numel() * a.element_size())


# --------------------------------------------------------------------------------------------
# Launching
# --------------------------------------------------------------------------------------------
class KernelArgs(typing.NamedTuple):
    """The kernel's runtime arguments, named as the kernel names them and in its order (the
    constexprs follow them): tensors, which Triton passes as pointers, and two sizes."""

    packed_ptr: torch.Tensor  # the packed bytes, viewed as uint8
    absmax_ptr: torch.Tensor
    code_ptr: torch.Tensor
    absmax2_ptr: torch.Tensor
    code2_ptr: torch.Tensor
    offset_ptr: torch.Tensor
    out_ptr: torch.Tensor
    n_elements: int
    n_bytes: int

    @classmethod
    def of(cls, packed, tables, out, n_elements, n_bytes):
        """From a validated weight: its packed tensor, its (absmax, code, absmax2, code2, offset)."""
        return cls(packed, *tables, out, n_elements, n_bytes)

    def around_out(self):
        """(the arguments between packed_ptr and out_ptr, those after out_ptr): what a launch plan
        passes unchanged, tensors as addresses."""
        values = tuple(value.data_ptr() if isinstance(value, torch.Tensor) else value for value in self)
        out_at = self._fields.index("out_ptr")
        return values[1:out_at], values[out_at + 1:]


# Triton's interpreter keeps the grid and the program index process-wide: one launch at a time.
_INTERPRETER_LOCK = threading.Lock()


def _interpret(launch, args):
    """The kernel through Triton's interpreter (CPU tensors), one launch at a time."""
    with _INTERPRETER_LOCK:
        dequantize_4bit_kernel[launch.grid](*args, num_warps=launch.num_warps, **launch.constexprs)


def _launch(packed, tables, out, n_elements, blocksize, blocksize2, nested, fp4, **overrides):
    """Launch through Triton's JIT; return f(stream, packed_ptr, out_ptr) that launches the same
    again for packed bytes at another address of the same 16-byte alignment (Triton specializes
    the kernel on it) and another output (a launch plan's)."""
    launch = choose_launch(packed, out.dtype, n_elements, blocksize=blocksize, blocksize2=blocksize2, nested=nested,
                           fp4=fp4, overrides=overrides)
    args = KernelArgs.of(packed, tables, out, n_elements, launch.n_bytes)
    if INTERPRET:
        _interpret(launch, args)
        return _interpreter_launcher(launch, args)
    head, tail = args.around_out()
    # Triton launches on the current device: switch only when the weight lives on another one.
    switch = out.device.index != torch.cuda.current_device()
    with torch.cuda.device(out.device) if switch else contextlib.nullcontext():
        compiled = dequantize_4bit_kernel[launch.grid](*args, num_warps=launch.num_warps, **launch.constexprs,
                                                       **compile_options(launch.constexprs["USE_ASM"]))
        stream = torch._C._cuda_getCurrentRawStream(out.device.index)
        constexprs = tuple(launch.constexprs[name] for name in dequantize_4bit_kernel.arg_names[len(args):])
        return fastpath.kernel_launcher(compiled, launch.grid[0], head, tail + constexprs, stream, packed.data_ptr(),
                                        out.data_ptr())


def _interpreter_launcher(launch, args):
    """f(stream, packed_ptr, out_ptr) for CPU tensors: the interpreter's kernel over the recorded
    addresses (wrapped as tensors again, as the GPU's launch passes them), like the GPU's plans."""
    recorded = KernelArgs(*((arg.data_ptr(), arg.dtype, arg.numel()) if isinstance(arg, torch.Tensor) else arg
                            for arg in args))

    def at_address(address, dtype, numel):
        memory = (ctypes.c_char * (numel * dtype.itemsize)).from_address(address)
        return torch.frombuffer(memory, dtype=dtype, count=numel)

    def launch_kernel(stream, packed_ptr, out_ptr):
        views = KernelArgs(*(at_address(*arg) if isinstance(arg, tuple) else arg for arg in recorded))
        views = views._replace(packed_ptr=at_address(packed_ptr, *recorded.packed_ptr[1:]),
                               out_ptr=at_address(out_ptr, *recorded.out_ptr[1:]))
        _interpret(launch, views)

    return launch_kernel


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------
# The per-call fast path (fastpath.py): the plans by id(quant_state), and its on/off switch.
_PLANS = fastpath.PLANS
PLANS_ENABLED = fastpath.ENABLED


def dequantize_nf4(weight, quant_state=None, *, out=None):
    """Dequantize a bitsandbytes 4-bit weight with one fused Triton launch.

    ``weight``: a ``bitsandbytes.nn.Linear4bit``, its ``Params4bit``, or the packed tensor with
    its ``QuantState``. Returns ``quant_state.shape`` in ``quant_state.dtype`` with exactly the
    values of ``bitsandbytes.functional.dequantize_4bit``, transposed like it when the packed
    weight has ``shape[0] == 1``. ``out`` is a contiguous buffer of that shape, dtype and device.
    """
    if out is None and PLANS_ENABLED and not torch.compiler.is_compiling():
        if quant_state is not None and type(weight) is torch.Tensor:
            plan = _PLANS.get(id(quant_state))
            if plan is not None and plan.matches(weight, quant_state):
                return plan.launch(weight)
        else:
            # A module or a parameter: Params4bit's Python __torch_function__ would run on every
            # tensor method the plan calls; with it disabled, the parameter is its plain tensor.
            with torch._C.DisableTorchFunctionSubclass():
                packed, qs = _weight_and_state(weight, quant_state)
                plan = _PLANS.get(id(qs))
                if plan is not None and plan.matches(packed, qs):
                    return plan.launch(packed)
    return _dequantize(weight, quant_state, out)


def _dequantize(weight, quant_state, out, **overrides):
    """The validating path: ``dequantize_nf4`` with kernel constexprs overridden (tests force each
    variant). A call without overrides or ``out`` leaves a launch plan for the weight behind."""
    result, plan = _validate_and_launch(weight, quant_state, out, overrides)
    if plan is not None and not overrides and PLANS_ENABLED:
        plan.keep()
    return result


def build_plan(weight, quant_state=None, **overrides):
    """A ``fastpath.LaunchPlan`` for one weight, validated and launched once, not kept: its
    ``launch(packed)`` replays the launch with no validation (benchmarks, the launch sweep).
    ``overrides``: constexprs such as ``BYTES_PER_PROGRAM`` or ``SHARED_TABLES``, and ``num_warps``.
    None where no plan can be made (an empty weight, launch hooks set, a state without weakrefs)."""
    return _validate_and_launch(weight, quant_state, None, overrides)[1]


def _validate_and_launch(weight, quant_state, out, overrides):
    packed, qs = _resolve(weight, quant_state)
    if not isinstance(packed, torch.Tensor):
        raise TypeError(f"dequantize_nf4: weight must be a tensor, Params4bit or Linear4bit, got {type(weight).__name__}")
    if qs is None:
        raise ValueError("dequantize_nf4: no quant_state given and the weight carries none")
    # Named first: its absmax (bf16, transposed) and packed bytes (reordered) are another format. Read
    # from the state's dict: QuantState's __getattr__ makes a missing attribute cost 0.6 us.
    _require(not getattr(qs, "__dict__", {}).get("packing_format_for_cpu"),
             "dequantize_nf4: the weight is in bitsandbytes' CPU layout (quant_state.packing_format_for_cpu: "
             "Linear4bit repacks it in place on its first inference forward on a CPU with AVX512-BF16), which only "
             "bitsandbytes' own forward reads; Params4bit.cuda() or saving a state_dict converts it back")
    if not _dense(packed):
        raise ValueError(f"dequantize_nf4: packed weight must be a dense tensor, got {packed.layout}")
    if INTERPRET:
        _require(packed.device.type == "cpu",
                 f"dequantize_nf4: the Triton interpreter runs on CPU tensors, got {packed.device}")
    else:
        _require(packed.device.type != "cpu", "dequantize_nf4: CPU tensors need Triton's interpreter "
                                              "(set TRITON_INTERPRET=1 before kernel is imported)")
        _require(packed.device.type == "cuda", f"dequantize_nf4: the packed weight must be on a CUDA device, got {packed.device}")
    shape, blocksize, nested, blocksize2, tables = _check_state(packed, qs)
    n_elements = shape.numel()
    transpose = packed.dim() > 0 and packed.shape[0] == 1 and len(shape) == 2

    if torch.compiler.is_compiling():
        return _traced_call(packed, qs, tables, shape, transpose, blocksize, blocksize2, nested, out), None

    plan_wanted = out is None and hasattr(type(qs), "__weakref__")  # a plan watches its state by weakref
    if out is None:
        out = torch.empty(shape, dtype=qs.dtype, device=packed.device)
    else:
        _require(isinstance(out, torch.Tensor), "dequantize_nf4: out must be a tensor")
        _require(out.shape == shape, f"dequantize_nf4: out has shape {tuple(out.shape)}, expected {tuple(shape)}")
        _require(out.dtype == qs.dtype, f"dequantize_nf4: out has dtype {out.dtype}, expected {qs.dtype}")
        _require(out.device == packed.device,
                 f"dequantize_nf4: out is on {out.device} but the packed weight is on {packed.device}")
        _require(out.is_contiguous(), "dequantize_nf4: out must be contiguous")
        for name, table in zip(("packed weight", "absmax", "code", "state2.absmax", "state2.code", "offset"),
                               (packed,) + tables):
            _require(not _overlaps(out, table), f"dequantize_nf4: out overlaps the {name}")

    plan = None
    if n_elements > 0:
        launch = _launch(packed.view(torch.uint8), tables, out, n_elements, blocksize, blocksize2, nested,
                         qs.quant_type == "fp4", **overrides)
        if plan_wanted and not fastpath.launch_hooks_active():
            plan = fastpath.LaunchPlan(packed, qs, shape, blocksize, blocksize2, nested, transpose, tables, launch)
    return (out.t() if transpose else out), plan


_your_dequantize_nf4 = dequantize_nf4  # an alias: one Python call less per harness call


def your_dequantize_nf4(layer):
    """The challenge's entry point: the layer's module form, which reads the packed weight and
    its state with Params4bit's __torch_function__ disabled (``dequantize_nf4``)."""
    return _your_dequantize_nf4(layer)


# --------------------------------------------------------------------------------------------
# torch.compile: the kernel as a torch.library operator
# --------------------------------------------------------------------------------------------
def _traced_call(packed, qs, tables, shape, transpose, blocksize, blocksize2, nested, out):
    """Inside torch.compile: the validated call becomes one operator call that Inductor can see."""
    absmax, code, absmax2, code2, offset = tables
    result = torch.ops.nf4_triton.dequantize(
        packed.view(torch.uint8), absmax, code, absmax2, code2, offset, list(shape), qs.dtype,
        blocksize, blocksize2, nested, qs.quant_type == "fp4")
    if out is not None:
        out.copy_(result)
        result = out
    return result.t() if transpose else result


def _dequantize_op(
    packed: torch.Tensor,
    absmax: torch.Tensor,
    code: torch.Tensor,
    absmax2: torch.Tensor,
    code2: torch.Tensor,
    offset: torch.Tensor,
    shape: list[int],
    dtype: torch.dtype,
    blocksize: int,
    blocksize2: int,
    nested: bool,
    fp4: bool,
) -> torch.Tensor:
    """The operator's body: allocate and launch (inputs already validated by the wrapper)."""
    out = torch.empty(shape, dtype=dtype, device=packed.device)
    n_elements = out.numel()
    if n_elements == 0:
        return out
    launch = choose_launch(packed, dtype, n_elements, blocksize=blocksize, blocksize2=blocksize2, nested=nested,
                           fp4=fp4)
    args = KernelArgs.of(packed, (absmax, code, absmax2, code2, offset), out, n_elements, launch.n_bytes)
    if INTERPRET:  # the interpreter's kernel is launched as it is (older torch refuses to wrap it)
        _interpret(launch, args)
    else:
        # Inside a graph the inline-PTX path is used whenever it exists, so no compile option is
        # needed to keep the scale free of FMAs (wrap_triton passes no compile options).
        torch.library.wrap_triton(dequantize_4bit_kernel)[launch.grid](*args, num_warps=launch.num_warps,
                                                                       **launch.constexprs)
    return out


def _dequantize_op_fake(packed, absmax, code, absmax2, code2, offset, shape, dtype, blocksize, blocksize2,
                        nested, fp4):
    return packed.new_empty(shape, dtype=dtype)


if INTERPRET:
    # The interpreter cannot run on fake tensors, so the body is opaque and the shape comes from
    # an explicit fake implementation.
    _op = torch.library.custom_op("nf4_triton::dequantize", _dequantize_op, mutates_args=())
    _op.register_fake(_dequantize_op_fake)
else:
    # triton_op: Inductor traces the body and sees (and launches) the Triton kernel itself.
    torch.library.triton_op("nf4_triton::dequantize", _dequantize_op, mutates_args=())
