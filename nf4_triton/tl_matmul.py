"""The fused matmul's ``tl`` kernel, for the calls the Gluon kernels cannot run (Triton before 3.6, fp32 x, sm_75):
each program decodes a ``BLOCK_N x BLOCK_K`` tile of the weight in registers with ``kernel.py``'s exact arithmetic
and multiplies it with the matching tile of x, in one of two shapes over bitsandbytes' layout as it is:
- ``DOT``: the weight tile is the left operand of ``tl.dot`` (tensor cores) against x's tile transposed, so a few
  rows of x only pad the narrow side of the product;
- FMA: one row of x per program, each decoded weight multiplied into fp32 accumulators reduced along K at the end.
``SPLIT_K`` programs sharing a row of outputs each write fp32 partial sums, which ``split_k_reduce_kernel`` adds in
a fixed order (deterministic), with the bias, and casts.
"""

import triton.language as tl

from nf4_triton.fastpath import jit, sum_combine
from nf4_triton.kernel import add_rn, decode, fp32_to_bf16_rne, lookup, mul_ftz

__all__ = ["nf4_matmul_kernel", "split_k_reduce_kernel"]


@jit
def _block_scales(absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, block, mask, BLOCKSIZE2: tl.constexpr,
                  NESTED: tl.constexpr, TABLE_HINT: tl.constexpr, USE_ASM: tl.constexpr, SHARED_TABLES: tl.constexpr):
    """fp32 scale of each quantization block index in ``block`` (the absmax decode of kernel.py);
    ``mask`` None: every index is inside the weight."""
    if NESTED:
        if mask is None:
            absmax_q = tl.load(absmax_ptr + block, eviction_policy=TABLE_HINT)
            absmax2 = tl.load(absmax2_ptr + block // BLOCKSIZE2, eviction_policy=TABLE_HINT)
        else:
            absmax_q = tl.load(absmax_ptr + block, mask=mask, other=0, eviction_policy=TABLE_HINT)
            absmax2 = tl.load(absmax2_ptr + block // BLOCKSIZE2, mask=mask, other=0, eviction_policy=TABLE_HINT)
        absmax_code = lookup(code2_ptr, absmax_q.to(tl.int32), 256, TABLE_HINT, SHARED_TABLES)
        return add_rn(mul_ftz(absmax_code, absmax2, USE_ASM), tl.load(offset_ptr), USE_ASM)
    elif mask is None:
        return tl.load(absmax_ptr + block, eviction_policy=TABLE_HINT)
    else:
        return tl.load(absmax_ptr + block, mask=mask, other=0.0, eviction_policy=TABLE_HINT)


@jit
def _codebook(code_ptr, FP4: tl.constexpr):
    """The 16 code values in fp32; FP4's codes 8 to 15 carry the sign bit as bitsandbytes forms
    them (sign * magnitude, so code 8 is -0.0)."""
    index = tl.arange(0, 16)
    values = tl.load(code_ptr + index)
    if FP4:
        values = (values.to(tl.uint32, bitcast=True) | ((index >> 3).to(tl.uint32) << 31)).to(tl.float32, bitcast=True)
    return values


@jit
def _pair_codebook(codebook):
    """256 entries, one per packed byte: the two code values it holds as one uint64, the high
    nibble's value (the even element) in the low half. One 8-byte lookup decodes two elements."""
    byte = tl.arange(0, 256)
    first = tl.gather(codebook, byte >> 4, 0).to(tl.uint32, bitcast=True).to(tl.uint64)
    second = tl.gather(codebook, byte & 0xF, 0).to(tl.uint32, bitcast=True).to(tl.uint64)
    return first | (second << 32)


@jit
def _weight_tile(packed_ptr, absmax_ptr, code_ptr, absmax2_ptr, code2_ptr, offset_ptr, codebook, pairs, n, k0, N, K,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCKSIZE: tl.constexpr, BLOCKSIZE2: tl.constexpr,
                 NESTED: tl.constexpr, FP4: tl.constexpr, W_DTYPE: tl.constexpr, USE_ASM: tl.constexpr,
                 BF16_VIA_INT: tl.constexpr, LOOKUP: tl.constexpr, EVEN: tl.constexpr, USE_INT64: tl.constexpr):
    """Rows ``n`` (BLOCK_N), columns ``k0 .. k0 + BLOCK_K`` of the weight as W_DTYPE, shaped
    [BLOCK_N, SCALES, WORDS_PER_SCALE, 8]: SCALES quantization blocks per row, each read as int32
    words of 8 codes in column order (K and BLOCKSIZE are multiples of 8).

    The values are those of kernel.py's decode, ``W_DTYPE(fp32(code * scale))``, the code value
    found by one of three lookups (LOOKUP): 0, per element in the global codebook (kernel.py's
    ``decode``); 1, per block a table of the 16 possible products (16 multiplies and casts per
    block, then one shared-memory load per element); 2, per byte in a shared table of code pairs
    (one 8-byte load per two elements). EVEN: the tile lies inside the weight (no masks)."""
    TABLE_HINT: tl.constexpr = "evict_last"
    SCALE_SPAN: tl.constexpr = BLOCKSIZE if BLOCKSIZE < BLOCK_K else BLOCK_K  # columns of a block in the tile
    SCALES: tl.constexpr = BLOCK_K // SCALE_SPAN
    WORDS_PER_SCALE: tl.constexpr = SCALE_SPAN // 8
    row = n.to(tl.int64) if USE_INT64 else n
    row_mask = n < N
    block_in_tile = tl.arange(0, SCALES)

    block = row[:, None] * (K // BLOCKSIZE) + (k0 // BLOCKSIZE + block_in_tile)[None, :]  # [BLOCK_N, SCALES]
    block_mask = row_mask[:, None] & ((k0 + block_in_tile * SCALE_SPAN)[None, :] < K)
    if EVEN:
        block_mask = None
    scales = _block_scales(absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, block, block_mask, BLOCKSIZE2, NESTED,
                           TABLE_HINT, USE_ASM, LOOKUP == 1)

    word = (k0 // 8 + block_in_tile[:, None] * WORDS_PER_SCALE + tl.arange(0, WORDS_PER_SCALE)[None, :])  # [SCALES, W]
    word_ptrs = packed_ptr.to(tl.pointer_type(tl.int32)) + row[:, None, None] * (K // 8) + word[None, :, :]
    if EVEN:
        words = tl.load(word_ptrs)
    else:
        words = tl.load(word_ptrs, mask=row_mask[:, None, None] & (word < K // 8)[None, :, :], other=0)
    if LOOKUP == 2:
        byte = (words[:, :, :, None] >> (8 * tl.arange(0, 4))[None, None, None, :]) & 0xFF  # [BLOCK_N, SCALES, W, 4]
        pair = tl.reshape(tl.gather(pairs, tl.reshape(byte, (byte.numel,)), 0), byte.shape)
        scale = scales[:, :, None, None]
        first = mul_ftz(pair.to(tl.uint32).to(tl.float32, bitcast=True), scale, USE_ASM)
        second = mul_ftz((pair >> 32).to(tl.uint32).to(tl.float32, bitcast=True), scale, USE_ASM)
        weights = _round(tl.reshape(tl.join(first, second), (BLOCK_N, SCALES, WORDS_PER_SCALE, 8)), W_DTYPE,
                         BF16_VIA_INT)
    else:
        element = tl.arange(0, 8)
        shifts = 8 * (element // 2) + 4 * (1 - element % 2)  # element 2j is byte j's high nibble
        codes = (words[:, :, :, None] >> shifts[None, None, None, :]) & 0xF  # [BLOCK_N, SCALES, W, 8]
        if LOOKUP == 1:
            products = _round(mul_ftz(codebook[None, None, :], scales[:, :, None], USE_ASM), W_DTYPE, BF16_VIA_INT)
            table_row = (tl.arange(0, BLOCK_N)[:, None] * SCALES + block_in_tile[None, :]) * 16  # [BLOCK_N, SCALES, 16]
            index = table_row[:, :, None, None] + codes
            weights = tl.reshape(tl.gather(tl.reshape(products, (BLOCK_N * SCALES * 16,)),
                                           tl.reshape(index, (index.numel,)), 0),
                                 (BLOCK_N, SCALES, WORDS_PER_SCALE, 8))
        else:
            weights = _round(decode(codes, tl.broadcast_to(scales[:, :, None, None], codes.shape), code_ptr,
                                     TABLE_HINT, FP4, USE_ASM, False), W_DTYPE, BF16_VIA_INT)
    return weights


@jit
def _round(values, W_DTYPE: tl.constexpr, BF16_VIA_INT: tl.constexpr):
    """fp32 to W_DTYPE, nearest even (bf16 through integers where the hardware or the interpreter
    cannot)."""
    if W_DTYPE == tl.bfloat16 and BF16_VIA_INT:
        return fp32_to_bf16_rne(values)
    else:
        return values.to(W_DTYPE)


@jit
def nf4_matmul_kernel(
    # inputs
    x_ptr,  # [M, K] activations (row stride stride_xm, unit column stride)
    packed_ptr,  # uint8 [N * K / 2], the weight [N, K] row-major, two codes per byte, high nibble first
    absmax_ptr,  # uint8 [N * K / BLOCKSIZE] when NESTED, else fp32
    code_ptr,  # fp32 [16], the 4-bit codebook (NF4 or FP4)
    absmax2_ptr,  # fp32 [ceil(n_blocks / BLOCKSIZE2)] (NESTED only)
    code2_ptr,  # fp32 [256] (NESTED only)
    offset_ptr,  # fp32 [1] (NESTED only)
    bias_ptr,  # [N] in x's dtype (HAS_BIAS only)
    # output
    out_ptr,  # [M, N] in x's dtype; with SPLIT_K > 1, fp32 partial sums [SPLIT_K, M, N]
    # sizes
    M,  # rows of x
    N,  # output features (rows of the weight)
    K,  # input features, a multiple of BLOCKSIZE and of 8
    stride_xm,  # elements between rows of x
    # format
    BLOCKSIZE: tl.constexpr,  # elements per absmax (power of two >= 8)
    BLOCKSIZE2: tl.constexpr,  # absmax values per absmax2 (NESTED only)
    NESTED: tl.constexpr,  # double-quantized absmax
    FP4: tl.constexpr,  # quant_type="fp4"
    X_DTYPE: tl.constexpr,  # tl.float16, tl.bfloat16 or tl.float32: activations, decoded weight and output
    # implementation
    BLOCK_M: tl.constexpr,  # rows of x per program (>= 16 with DOT)
    BLOCK_N: tl.constexpr,  # weight rows per program
    BLOCK_K: tl.constexpr,  # columns per step (a multiple of 8)
    SPLIT_K: tl.constexpr,  # programs sharing one output tile along K (fp32 partials when > 1)
    STEPS_PER_SPLIT: tl.constexpr,  # BLOCK_K steps per program: ceil(K / BLOCK_K) / SPLIT_K (a constant: Triton
    #                                  3.3's interpreter cannot loop to a run-time bound)
    DOT: tl.constexpr,  # tensor-core tl.dot, else fp32 FMA
    HAS_BIAS: tl.constexpr,  # add bias (SPLIT_K == 1 only; the reduction adds it otherwise)
    USE_ASM: tl.constexpr,  # inline-PTX arithmetic (NVIDIA only)
    BF16_VIA_INT: tl.constexpr,  # round to bf16 with integer ops (sm_75, interpreter)
    LOOKUP: tl.constexpr,  # how a code's value is found: 0 global codebook, 1 per-block product tables, 2 byte pairs
    EVEN: tl.constexpr,  # N % BLOCK_N == 0 and K % BLOCK_K == 0: no masks on the weight
    USE_INT64: tl.constexpr,  # 64-bit offsets (the weight has more than 2**31 - 1 elements)
):
    SCALE_SPAN: tl.constexpr = BLOCKSIZE if BLOCKSIZE < BLOCK_K else BLOCK_K
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = m < M
    first = pid_k * STEPS_PER_SPLIT  # this program's share of K: whole BLOCK_K steps

    codebook = _codebook(code_ptr, FP4)
    pairs = _pair_codebook(codebook) if LOOKUP == 2 else codebook
    if DOT:
        acc = tl.full((BLOCK_N, BLOCK_M), 0.0, tl.float32)
    else:
        acc = tl.full((BLOCK_N, BLOCK_K // SCALE_SPAN, SCALE_SPAN // 8), 0.0, tl.float32)
    for step_in_split in range(0, STEPS_PER_SPLIT):
        k0 = (first + step_in_split) * BLOCK_K
        w = _weight_tile(packed_ptr, absmax_ptr, code_ptr, absmax2_ptr, code2_ptr, offset_ptr, codebook, pairs, n, k0,
                         N, K, BLOCK_N, BLOCK_K, BLOCKSIZE, BLOCKSIZE2, NESTED, FP4, X_DTYPE, USE_ASM, BF16_VIA_INT,
                         LOOKUP, EVEN, USE_INT64)
        if DOT:
            k = k0 + tl.arange(0, BLOCK_K)
            x_t = tl.load(x_ptr + m[None, :] * stride_xm + k[:, None], mask=m_mask[None, :] & (k[:, None] < K),
                          other=0.0)  # [BLOCK_K, BLOCK_M]
            w = tl.reshape(w, (BLOCK_N, BLOCK_K))
            if X_DTYPE == tl.float32:
                acc = tl.dot(w, x_t, acc, input_precision="ieee")
            else:
                acc = tl.dot(w, x_t, acc)
        else:  # one row of x (BLOCK_M == 1), shaped like the weight tile's row
            k = k0 + tl.reshape(tl.arange(0, BLOCK_K), (BLOCK_K // SCALE_SPAN, SCALE_SPAN // 8, 8))
            if EVEN:
                x = tl.load(x_ptr + pid_m * stride_xm + k)
            else:
                x = tl.load(x_ptr + pid_m * stride_xm + k, mask=k < K, other=0.0)
            # each thread holds a word's 8 codes: their sum needs no exchange between threads
            acc += tl.reduce(w.to(tl.float32) * x.to(tl.float32)[None, :, :, :], 3, sum_combine)
    if DOT:
        result = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    else:
        result = tl.reshape(tl.reduce(tl.reshape(acc, (BLOCK_N, BLOCK_K // 8)), 1, sum_combine), (1, BLOCK_N))

    out_mask = m_mask[:, None] & (n[None, :] < N)
    if SPLIT_K > 1:
        partial = out_ptr + pid_k.to(tl.int64) * M * N
        tl.store(partial + m[:, None] * N + n[None, :], result, mask=out_mask)
    else:
        if HAS_BIAS:
            result += tl.load(bias_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + m[:, None] * N + n[None, :], _round(result, X_DTYPE, BF16_VIA_INT), mask=out_mask)


@jit
def split_k_reduce_kernel(
    partial_ptr,  # fp32 [SPLIT_K, n_elements]
    bias_ptr,  # [N] (HAS_BIAS only)
    out_ptr,  # [n_elements] = [M, N] in OUT_DTYPE
    n_elements,  # M * N
    N,  # output features (the bias' length)
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    BF16_VIA_INT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    total = tl.full((BLOCK,), 0.0, tl.float32)
    for split in tl.static_range(SPLIT_K):  # a fixed order: the same sums on every call
        total += tl.load(partial_ptr + split * n_elements + offsets, mask=mask, other=0.0)
    if HAS_BIAS:
        total += tl.load(bias_ptr + offsets % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offsets, _round(total, OUT_DTYPE, BF16_VIA_INT), mask=mask)
