"""Compile every kernel variant the wrapper can launch for one GPU target, without a GPU.

Run as ``python tests/aot_compile.py CC``. Prints the number of variants, then one JSON line per
variant with the PTX facts the tests check. Runs in its own process with TRITON_INTERPRET=0 so that ``kernel.py`` defines
compiled (not interpreted) kernels even on a machine without CUDA.
"""

import itertools
import json
import os
import re
import sys

os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from nf4_triton import fastpath, kernel, quantstate  # noqa: E402

POINTERS = {
    "packed_ptr": "*u8",
    "code_ptr": "*fp32",
    "code2_ptr": "*fp32",
    "absmax2_ptr": "*fp32",
    "offset_ptr": "*fp32",
}
L2_BYTES = 50 * 2**20  # the H100's
OUT_POINTER = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32"}


def variants(capability):
    """Every combination the wrapper can launch on a GPU of this capability (word loads where the
    packed bytes allow them, byte loads elsewhere), one with the eviction hints off (the launch
    sweep's other family), the codebooks in shared memory (the H100's mid-size weights), and the H200's tiers
    from 17 and 33 MiB.
    Yields (out_dtype, nested, use_asm, use_int64, num_warps, constexprs),
    constexprs and warps chosen for the weight size as the wrapper chooses them."""
    def variant(out_dtype, nested, fp4=False, n_elements=0, use_asm=True, **changes):
        constexprs = kernel.kernel_variant(out_dtype, nested=nested, fp4=fp4, n_elements=n_elements, use_asm=use_asm,
                                           capability=capability, l2_bytes=L2_BYTES, **changes)
        num_warps = kernel.launch_config(capability, (n_elements + 1) // 2, changes.get("dram_gbps", 0))[1]
        return out_dtype, nested, use_asm, constexprs["USE_INT64"], num_warps, constexprs

    for out_dtype, nested, fp4, use_asm, use_int64 in itertools.product(
        quantstate.OUTPUT_DTYPES, (True, False), (False, True), (True, False), (False, True)
    ):
        # 2**31 elements: 64-bit offsets, and an output large enough for streaming stores
        yield variant(out_dtype, nested, fp4, n_elements=2**31 if use_int64 else 0, use_asm=use_asm)
    for out_dtype, nested, fp4 in itertools.product(quantstate.OUTPUT_DTYPES, (True, False), (False, True)):
        # 2 elements: one packed byte, not a whole word, so byte loads
        yield variant(out_dtype, nested, fp4, n_elements=2)
    yield variant(torch.float16, True, eviction_hints=False)
    if kernel.TRITON_COMPILES_SHARED_TABLES:
        for out_dtype, nested, fp4 in itertools.product(quantstate.OUTPUT_DTYPES, (True, False), (False, True)):
            yield variant(out_dtype, nested, fp4, n_elements=4096 * 2048, shared_tables=True)
    if kernel.TRITON_COMPILES_SHARED_TABLES and capability in kernel.FAST_DRAM_LAUNCH_CONFIGS:
        # the H200's tiers from 17 and 33 MiB: 1024 and 512 bytes over 2 warps
        for out_dtype, mib in itertools.product(quantstate.OUTPUT_DTYPES, (17, 33)):
            yield variant(out_dtype, True, n_elements=2 * mib * kernel.MiB, dram_gbps=fastpath.FAST_DRAM_GBPS)


def compile_variant(capability, out_dtype, nested, num_warps, constexprs):
    fn = kernel.dequantize_4bit_kernel
    signature = dict(POINTERS)
    signature["absmax_ptr"] = "*u8" if nested else "*fp32"
    signature["out_ptr"] = OUT_POINTER[out_dtype]
    signature["n_elements"] = signature["n_bytes"] = "i64" if constexprs["USE_INT64"] else "i32"
    for name in constexprs:
        signature[name] = "constexpr"
    signature = {name: signature[name] for name in fn.arg_names}
    source = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    target = GPUTarget("cuda", capability[0] * 10 + capability[1], 32)
    options = {"num_warps": num_warps, **kernel.compile_options(constexprs["USE_ASM"])}
    return triton.compile(source, target=target, options=options)


def main():
    cc = int(sys.argv[1])
    capability = (cc // 10, cc % 10)
    todo = list(variants(capability))
    print(json.dumps({"variants": len(todo)}), flush=True)
    for out_dtype, nested, use_asm, use_int64, num_warps, constexprs in todo:
        compiled = compile_variant(capability, out_dtype, nested, num_warps, constexprs)
        ptx = compiled.asm["ptx"]
        asm_blocks = re.findall(r"begin inline asm(.*?)end inline asm", ptx, re.S)
        print(json.dumps({
            "cc": cc,
            "out_dtype": str(out_dtype),
            "nested": nested,
            "use_asm": use_asm,
            "use_int64": use_int64,
            "bf16_via_int": constexprs["BF16_VIA_INT"],
            "eviction_hints": constexprs["EVICTION_HINTS"],
            "word_loads": constexprs["WORD_LOADS"],
            "shared_tables": constexprs["SHARED_TABLES"],
            "stream_stores": constexprs["STREAM_STORES"],
            "cubin_bytes": len(compiled.asm["cubin"]),
            "asm_mul_ftz": sum("mul.rn.ftz.f32" in block for block in asm_blocks),
            "asm_add_rn": sum("add.rn.f32" in block for block in asm_blocks),
            "fma": len(re.findall(r"\bfma\.rn(\.ftz)?\.f32", ptx)),
            "evict_first_loads": len(re.findall(r"ld\.global[.\w:]*evict_first", ptx)),
            "evict_last_loads": len(re.findall(r"ld\.global[.\w:]*evict_last", ptx)),
            "evict_first_stores": len(re.findall(r"st\.global[.\w:]*evict_first", ptx)),
            "shared_loads": len(re.findall(r"ld\.shared", ptx)),
        }), flush=True)


if __name__ == "__main__":
    main()
