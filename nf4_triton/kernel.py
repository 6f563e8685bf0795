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

The module reads top-down, each name defined before it is used: the format's arithmetic and the
kernel; the launch choice (named tiers per GPU, a pure function of the weight and the device's
facts); launching; the torch.library operator that torch.compile sees; the public API, whose
launch plans live in ``PLANS``. Below it, ``quantstate.py`` finds and validates a weight and
decides when a plan serves a call; ``fastpath.py`` launches and replays.
"""

import contextlib
import typing

import torch
import triton
import triton.language as tl

from nf4_triton import fastpath, quantstate
from nf4_triton.fastpath import INTERPRET, device_facts, jit
from nf4_triton.quantstate import require

__all__ = ["dequantize_nf4", "your_dequantize_nf4", "build_plan", "validate_and_dequantize", "set_launch_config", "PLANS",
           "dequantize_4bit_kernel"]

TL_DTYPE = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
_INT32_MAX = 2**31 - 1


# --------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------
@jit
def _flush_subnormal(x):
    """A subnormal fp32 becomes a zero of the same sign, as the hardware's ``.ftz`` does."""
    bits = x.to(tl.uint32, bitcast=True)
    return tl.where((bits & 0x7F800000) == 0, bits & 0x80000000, bits).to(tl.float32, bitcast=True)


@jit
def mul_ftz(a, b, USE_ASM: tl.constexpr):
    """fp32 product rounded once, subnormal inputs and result flushed to signed zero: the
    multiply of bitsandbytes' CUDA kernels (built with ``--use_fast_math``). The PTX form can
    never be contracted into an FMA."""
    if USE_ASM:
        return tl.inline_asm_elementwise(
            "mul.rn.ftz.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return _flush_subnormal(_flush_subnormal(a) * _flush_subnormal(b))


@jit
def add_rn(a, b, USE_ASM: tl.constexpr):
    """fp32 sum rounded once, subnormals kept: the offset is added by PyTorch, not by a fast-math
    kernel (see ``mul_ftz``)."""
    if USE_ASM:
        return tl.inline_asm_elementwise(
            "add.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return a + b


@jit
def lookup(table_ptr, indices, TABLE_SIZE: tl.constexpr, TABLE_HINT: tl.constexpr, SHARED_TABLES: tl.constexpr):
    """table[indices] for an fp32 table of TABLE_SIZE entries: gathered from global memory, or
    with SHARED_TABLES the table is loaded whole (independently of the indices) and looked up
    with tl.gather, which Triton lowers through shared memory."""
    if SHARED_TABLES:
        table = tl.load(table_ptr + tl.arange(0, TABLE_SIZE), eviction_policy=TABLE_HINT)
        return tl.reshape(tl.gather(table, tl.reshape(indices, (indices.numel,)), 0), indices.shape)
    else:
        return tl.load(table_ptr + indices, eviction_policy=TABLE_HINT)


@jit
def decode(codes, scale, code_ptr, TABLE_HINT: tl.constexpr, FP4: tl.constexpr, USE_ASM: tl.constexpr,
            SHARED_TABLES: tl.constexpr):
    """fp32 weights from int32 4-bit codes and their block scales (same shape)."""
    values = lookup(code_ptr, codes, 16, TABLE_HINT, SHARED_TABLES)
    if FP4:
        # bitsandbytes' CUDA kernel forms an FP4 value as sign * magnitude, so code 8 decodes to
        # -0.0 where the table holds +0.0: set the sign bit from the code's top bit.
        sign = (codes >> 3).to(tl.uint32) << 31
        values = (values.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    return mul_ftz(values, scale, USE_ASM)


@jit
def fp32_to_bf16_rne(x):
    """Round fp32 to bf16, nearest even, with integer operations only (NaN stays NaN)."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    quiet_nan = (bits >> 16) | 0x40
    rounded = tl.where(x != x, quiet_nan, rounded)
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@jit
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
        absmax_code = lookup(code2_ptr, absmax_q.to(tl.int32), 256, TABLE_HINT, SHARED_TABLES)
        absmax2 = tl.load(absmax2_ptr + block // BLOCKSIZE2, mask=row_mask, other=0, eviction_policy=TABLE_HINT)
        offset = tl.load(offset_ptr)
        scale = add_rn(mul_ftz(absmax_code, absmax2, USE_ASM), offset, USE_ASM)
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
        values = decode(codes, tl.broadcast_to(scale[:, None], (ROWS, 2 * COLS)), code_ptr, TABLE_HINT, FP4, USE_ASM,
                         SHARED_TABLES)
    else:
        # Bytes: decode the high and low nibbles apart, then interleave the fp32 values (joining
        # the codes before the lookup instead measured 13 to 30 % slower on the H100, NOTES.md item 14).
        byte_offsets = row_start[:, None] + tl.arange(0, COLS)[None, :]
        packed = tl.load(packed_ptr + byte_offsets, mask=byte_offsets < n_bytes, other=0).to(tl.int32)
        row_scale = tl.broadcast_to(scale[:, None], (ROWS, COLS))
        high = decode(packed >> 4, row_scale, code_ptr, TABLE_HINT, FP4, USE_ASM, SHARED_TABLES)
        low = decode(packed & 0xF, row_scale, code_ptr, TABLE_HINT, FP4, USE_ASM, SHARED_TABLES)
        values = tl.join(high, low).reshape(ROWS, 2 * COLS)  # element 2j is byte j's high nibble

    if OUT_DTYPE == tl.bfloat16 and BF16_VIA_INT:
        values = fp32_to_bf16_rne(values)
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
# GPUs whose DRAM peaks at fastpath.FAST_DRAM_GBPS or more take these tiers of their capability. The H200 wants fewer
# warps a program from 17 MiB, likely for the bytes in flight (32 programs an SM at 2 warps, 16 at 4). GPU time, 7 and
# 11 interleaved rounds (NOTES.md, items 104, 105):
FAST_DRAM_LAUNCH_CONFIGS = {
    (9, 0): tuple(tier for tier in LAUNCH_CONFIGS[(9, 0)] if tier.smallest_bytes < 17 * MiB) + (
        # 23.54 against 24.10 us (2048/4 global) at 8704x4096 bf16, ahead at all 8 weights from 17 to 22 MiB
        LaunchTier(17 * MiB, LaunchConfig(1024, 2, True), fallback=_MID_GLOBAL),
        # 45.52 against 46.02 at 13824x5120 fp16; 145.60 against 159.65 (512/4) at 28672x8192 bf16, 74.66 against
        # 79.78 at 14336x8192 fp16 (Unsloth's fused 150.61 and 76.38)
        LaunchTier(33 * MiB, LaunchConfig(512, 2, True), fallback=_MID_GLOBAL),
    ),
}
# Triton 3.3.1's compiler aborts on the shared-memory gathers (an assertion in
# OptimizeThreadLocality); from 3.4 they compile and run bit-exact on the GPU (README, Triton versions).
TRITON_COMPILES_SHARED_TABLES = tuple(int(part) for part in triton.__version__.split(".")[:2]) >= (3, 4)
_launch_override = None


def launch_tiers(capability, dram_gbps=0):
    """The launch tiers of a GPU of ``capability`` whose DRAM peaks at ``dram_gbps`` (``device_facts``)."""
    return fastpath.table_for(capability, dram_gbps, LAUNCH_CONFIGS, FAST_DRAM_LAUNCH_CONFIGS, DEFAULT_LAUNCH_TIERS)


def launch_config(capability, n_bytes=0, dram_gbps=0):
    """The LaunchConfig for a packed weight of ``n_bytes`` on a GPU of ``capability`` whose DRAM peaks
    at ``dram_gbps``: set_launch_config's choice, else the tier that size reaches."""
    if _launch_override is not None:
        return _launch_override
    tiers = launch_tiers(capability, dram_gbps)
    tier = next(tier for tier in reversed(tiers) if n_bytes >= tier.smallest_bytes)
    return tier.config if TRITON_COMPILES_SHARED_TABLES or not tier.config.shared_tables else tier.fallback


# evict_first on the output's stores pays only for outputs of several L2 sizes: on the H100
# (50 MB L2) -1.9 us at 940 MB, +1.1 / +0.7 us at 117 MB (NOTES.md, item 15). The same multiple of
# the L2 is a guess for the T4 (4 MB) and the L4 (48 MB).
STREAM_STORES_L2_MULTIPLE = 4


def arithmetic(capability):
    """(inline PTX for the arithmetic, bf16 rounded with integer operations) on a GPU of ``capability``: the PTX
    wherever Triton compiles for NVIDIA; integers where the hardware has no fp32-to-bf16 conversion (sm_75) or
    Triton's interpreter truncates."""
    return not INTERPRET and torch.version.hip is None, INTERPRET or tuple(capability) < (8, 0)


def kernel_variant(out_dtype, *, nested, capability, l2_bytes, dram_gbps=0, fp4=False, blocksize=64, blocksize2=256,
                   n_elements=0, word_aligned=True, use_asm=None, bf16_via_int=None, bytes_per_program=None,
                   eviction_hints=True, shared_tables=None):
    """The constexpr arguments of one kernel variant, from the weight and the device's facts
    (``device_facts``; the AOT compile test passes other GPUs'). ``word_aligned``: the packed bytes
    start on a 4-byte boundary. A pure function but for ``set_launch_config``'s override."""
    if bytes_per_program is None or shared_tables is None:
        tier_bytes_per_program, _, tier_shared_tables = launch_config(capability, (n_elements + 1) // 2,
                                                                          dram_gbps)
        bytes_per_program = tier_bytes_per_program if bytes_per_program is None else bytes_per_program
        shared_tables = tier_shared_tables if shared_tables is None else shared_tables
    asm_default, bf16_default = arithmetic(capability)
    use_asm = asm_default if use_asm is None else use_asm
    bf16_via_int = bf16_default if bf16_via_int is None else bf16_via_int
    return dict(
        BLOCKSIZE=blocksize,
        BLOCKSIZE2=blocksize2 if nested else 1,
        NESTED=nested,
        FP4=fp4,
        OUT_DTYPE=TL_DTYPE[out_dtype],
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


def word_aligned(packed):
    """Whether the packed bytes start on a 4-byte boundary. Inside torch.compile the tensors are
    fake and have no address: there the storage offset decides, and Inductor copies an input
    that arrives less aligned than the one it compiled for."""
    try:
        return packed.data_ptr() % 4 == 0
    except RuntimeError:
        return packed.storage_offset() * packed.element_size() % 4 == 0


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
    capability, l2_bytes, dram_gbps = device_facts(packed.device)
    n_bytes = (n_elements + 1) // 2
    config = launch_config(capability, n_bytes, dram_gbps)
    num_warps = overrides.pop("num_warps", config.num_warps)
    constexprs = kernel_variant(dtype, nested=nested, fp4=fp4, blocksize=blocksize, blocksize2=blocksize2,
                                n_elements=n_elements, word_aligned=word_aligned(packed), capability=capability,
                                l2_bytes=l2_bytes, dram_gbps=dram_gbps,
                                bytes_per_program=overrides.pop("BYTES_PER_PROGRAM", config.bytes_per_program),
                                shared_tables=overrides.pop("SHARED_TABLES", config.shared_tables))
    constexprs.update(overrides)
    return Launch(constexprs, num_warps, n_bytes, (triton.cdiv(n_bytes, constexprs["BYTES_PER_PROGRAM"]),))


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


def _launch(packed, tables, out, *, blocksize, blocksize2, nested, fp4, overrides=None, traced=False):
    """Launch the kernel into ``out`` for validated arguments. Returns f(stream, packed_ptr, out_ptr)
    that launches the same again for packed bytes at another address of the same 16-byte alignment
    (Triton specializes the kernel on it) and another output (a launch plan's); None when ``traced``
    (the body of the torch.compile operator)."""
    n_elements = out.numel()
    launch = choose_launch(packed, out.dtype, n_elements, blocksize=blocksize, blocksize2=blocksize2, nested=nested,
                           fp4=fp4, overrides=overrides)
    args = KernelArgs.of(packed, tables, out, n_elements, launch.n_bytes)
    options = dict(num_warps=launch.num_warps, **launch.constexprs)
    if traced and not INTERPRET:
        # Inside a graph the inline-PTX path is used whenever it exists, so no compile option is
        # needed to keep the scale free of FMAs (wrap_triton passes no compile options).
        torch.library.wrap_triton(dequantize_4bit_kernel)[launch.grid](*args, **options)
        return None
    if not INTERPRET:
        options.update(compile_options(launch.constexprs["USE_ASM"]))
    varying = None if traced else (0, KernelArgs._fields.index("out_ptr"))
    # Triton launches on the current device: switch only when the weight lives on another one.
    switch = not INTERPRET and out.device.index != torch.cuda.current_device()
    with torch.cuda.device(out.device) if switch else contextlib.nullcontext():
        return fastpath.run(dequantize_4bit_kernel, launch.grid, args, options, varying)


# --------------------------------------------------------------------------------------------
# torch.compile: the kernel as a torch.library operator
# --------------------------------------------------------------------------------------------
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
    if out.numel() > 0:
        _launch(packed, (absmax, code, absmax2, code2, offset), out, blocksize=blocksize, blocksize2=blocksize2,
                nested=nested, fp4=fp4, traced=True)
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


def _traced_call(packed, qs, tables, shape, transpose, blocksize, blocksize2, nested, out):
    """Inside torch.compile: the validated call becomes one operator call that Inductor can see."""
    absmax, code, absmax2, code2, offset = tables
    result = torch.ops.nf4_triton.dequantize(
        quantstate.packed_bytes(packed), absmax, code, absmax2, code2, offset, list(shape), qs.dtype,
        blocksize, blocksize2, nested, qs.quant_type == "fp4")
    if out is not None:
        out.copy_(result)
        result = out
    return result.t() if transpose else result


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------
PLANS = fastpath.PlanCache()  # this kernel's launch plans by id(quant_state); PLANS.stats() counts them


def _overlaps(a, b):
    """Whether two contiguous tensors share any byte."""
    a_start, b_start = a.data_ptr(), b.data_ptr()
    return (a.device == b.device and a_start < b_start + b.numel() * b.element_size()
            and b_start < a_start + a.numel() * a.element_size())


def _check_out(out, shape, dtype, inputs):
    """A caller's output buffer: its shape, dtype, device and layout, and no byte shared with an
    input (packed weight, absmax, code, state2.absmax, state2.code, offset)."""
    require(isinstance(out, torch.Tensor), "dequantize_nf4: out must be a tensor")
    require(out.shape == shape, f"dequantize_nf4: out has shape {tuple(out.shape)}, expected {tuple(shape)}")
    require(out.dtype == dtype, f"dequantize_nf4: out has dtype {out.dtype}, expected {dtype}")
    require(out.device == inputs[0].device,
            f"dequantize_nf4: out is on {out.device} but the packed weight is on {inputs[0].device}")
    require(out.is_contiguous(), "dequantize_nf4: out must be contiguous")
    require(not out.requires_grad, "dequantize_nf4: out must not require grad (it is written outside autograd)")
    for name, tensor in zip(("packed weight", "absmax", "code", "state2.absmax", "state2.code", "offset"), inputs):
        require(not _overlaps(out, tensor), f"dequantize_nf4: out overlaps the {name}")


def _validate_and_launch(weight, quant_state, out, overrides):
    """(the result, a plan for the launch or None): a plan only for an output allocated here."""
    packed, qs, checked = quantstate.check_weight(weight, quant_state)
    shape, blocksize, nested, blocksize2, tables = checked
    transpose = packed.dim() > 0 and packed.shape[0] == 1 and len(shape) == 2
    if torch.compiler.is_compiling():
        return _traced_call(packed, qs, tables, shape, transpose, blocksize, blocksize2, nested, out), None
    planned = out is None
    if planned:
        out = torch.empty(shape, dtype=qs.dtype, device=packed.device)
    else:
        _check_out(out, shape, qs.dtype, (packed,) + tables)
    result = out.t() if transpose else out
    if shape.numel() == 0:
        return result, None
    launch_kernel = _launch(quantstate.packed_bytes(packed), tables, out, blocksize=blocksize, blocksize2=blocksize2,
                            nested=nested, fp4=qs.quant_type == "fp4", overrides=overrides)
    if not planned and not out.is_inference():
        torch.autograd.graph.increment_version(out)  # written in place: autograd refuses a graph that saved it
    if not (planned and fastpath.can_watch(qs)):
        return result, None
    return result, quantstate.WeightPlan(PLANS, packed, qs, checked, out, transpose, launch_kernel)


def validate_and_dequantize(weight, quant_state=None, *, out=None, **overrides):
    """``dequantize_nf4`` through validation, whatever plan exists, with kernel constexprs (and
    ``num_warps``) overridden: tests force each variant. A call without overrides or ``out``
    keeps a launch plan for later calls."""
    result, plan = _validate_and_launch(weight, quant_state, out, overrides)
    if plan is not None and not overrides:
        PLANS.keep(plan)
    return result


def dequantize_nf4(weight, quant_state=None, *, out=None):
    """Dequantize a bitsandbytes 4-bit weight with one fused Triton launch.

    ``weight``: a ``bitsandbytes.nn.Linear4bit``, its ``Params4bit``, or the packed tensor with
    its ``QuantState``. Returns ``quant_state.shape`` in ``quant_state.dtype`` with exactly the
    values of ``bitsandbytes.functional.dequantize_4bit``, transposed like it when the packed
    weight has ``shape[0] == 1``. ``out`` is a contiguous buffer of that shape, dtype and device.
    """
    if out is None and not torch.compiler.is_compiling():
        if quant_state is not None and type(weight) is torch.Tensor:
            result = PLANS.serve(weight, quant_state)
        else:
            # A module or a parameter: Params4bit's Python __torch_function__ would run on every
            # tensor method the plan calls; with it disabled, the parameter is its plain tensor.
            with torch._C.DisableTorchFunctionSubclass():
                result = PLANS.serve(*quantstate.weight_and_state(weight, quant_state))
        if result is not None:
            return result
    return validate_and_dequantize(weight, quant_state, out=out)


def build_plan(weight, quant_state=None, **overrides):
    """A launch plan (``quantstate.WeightPlan``) for one weight, validated and launched once, not
    kept: its ``launch(packed)`` replays the launch with no validation (benchmarks, the launch
    sweep). ``overrides``: constexprs such as ``BYTES_PER_PROGRAM`` or ``SHARED_TABLES``, and
    ``num_warps``. None where no plan can be made (an empty weight, launch hooks set, a state
    without weakrefs)."""
    return _validate_and_launch(weight, quant_state, None, overrides)[1]


def your_dequantize_nf4(layer):
    """The challenge's entry point: the layer's module form, which reads the packed weight and
    its state with Params4bit's __torch_function__ disabled (``dequantize_nf4``)."""
    return dequantize_nf4(layer)


def set_launch_config(bytes_per_program=None, num_warps=None, shared_tables=False):
    """Use this configuration for every later call (no arguments: back to the table)."""
    global _launch_override
    if bytes_per_program is None and num_warps is None:
        _launch_override = None
    else:
        require(quantstate.is_power_of_two(bytes_per_program) and bytes_per_program >= 16,
                f"set_launch_config: bytes_per_program must be a power of two >= 16, got {bytes_per_program}")
        require(num_warps in (1, 2, 4, 8, 16, 32),
                f"set_launch_config: num_warps must be a power of two from 1 to 32, got {num_warps}")
        require(isinstance(shared_tables, bool), f"set_launch_config: shared_tables must be a bool, got {shared_tables!r}")
        require(TRITON_COMPILES_SHARED_TABLES or not shared_tables,
                f"set_launch_config: Triton {triton.__version__} cannot compile the shared-memory codebook lookup "
                "(3.4 or later can)")
        _launch_override = LaunchConfig(bytes_per_program, num_warps, shared_tables)
    PLANS.clear()  # plans hold kernels compiled for the old configuration

