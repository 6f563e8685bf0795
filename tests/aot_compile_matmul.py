"""Compile the fused matmul's route configurations for one GPU target, without a GPU.

Run as ``python tests/aot_compile_matmul.py CC``. Prints one JSON line per variant with the PTX
facts the tests check. Compiled as the JIT specializes a call with 16-byte aligned tensors and sizes
of multiples of 16; without that every load is scalar (4096x14336's one-row route, bf16, Triton 3.6:
358 global loads a thread against 86, x's 16-bit elements one at a time). TRITON_INTERPRET=0 so that
matmul.py defines compiled kernels on any machine.
"""

import dataclasses
import hashlib
import json
import os
import re
import sys

os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

import bench.matmul  # noqa: E402
from nf4_triton import fused, kernel, matmul, routes, tl_matmul  # noqa: E402
from nf4_triton.routes import KSliceConfig, TlConfig  # noqa: E402

TL_NAME = {tl.float16: "fp16", tl.bfloat16: "bf16", tl.float32: "fp32"}


def variants(capability):
    """(x dtype, config) for each fused route of this GPU, in every activation dtype it serves there. Below sm_80,
    where no fused route is taken, the tl kernel's dot tile in fp16: what Triton makes of tl.dot there."""
    if capability < (8, 0):
        if matmul.SM75_COMPILES:  # Triton 3.3.1 aborts in its LLVM lowering there
            yield tl.float16, routes.TL_DEFAULT_ROUTES[0].config
        return
    # the table nf4_linear takes on this Triton: TL_ROUTES where Gluon's mma_v2 is missing (before 3.6)
    table = routes.MATMUL_ROUTES if fused.gluon_runs_on(capability) else routes.TL_ROUTES
    for route in routes.routes_for(capability, table):
        if route.path != "fused":
            continue
        for x_dtype in (tl.float16, tl.bfloat16):
            if x_dtype == tl.bfloat16 and capability < (8, 0):
                continue  # no bf16 tensor-core product on sm_75: nf4_linear dequantizes there
            yield x_dtype, route.config
    if table is routes.MATMUL_ROUTES:  # the K-slice tiles the one-row sweep times (bench.matmul), routes or not
        for config in bench.matmul.kwarps_configs(8):
            for x_dtype in (tl.float16, tl.bfloat16):
                yield x_dtype, config


def compile_variant(capability, x_dtype, config):
    """The route's kernel for this target: the tl kernel, or a Gluon kernel through Gluon's AST source (its layouts
    as constexprs)."""
    name = TL_NAME[x_dtype]
    steps = 4096 // config.block_k
    split_k = fused.largest_divisor(steps, config.split_k)  # as a call at K = 4096 runs it
    signature = {"x_ptr": f"*{name}", "packed_ptr": "*u8", "absmax_ptr": "*u8", "code_ptr": "*fp32",
                 "absmax2_ptr": "*fp32", "code2_ptr": "*fp32", "offset_ptr": "*fp32", "bias_ptr": f"*{name}",
                 "out_ptr": f"*{name}" if split_k == 1 else "*fp32", "M": "i32", "N": "i32", "K": "i32",
                 "stride_xm": "i32"}
    constexprs = dict(BLOCKSIZE=64, BLOCKSIZE2=256, NESTED=True, FP4=False, X_DTYPE=x_dtype, BLOCK_M=config.block_m,
                      BLOCK_N=config.block_n, BLOCK_K=config.block_k, HAS_BIAS=False, USE_INT64=False)
    options = {"num_warps": config.num_warps}
    if not isinstance(config, TlConfig):
        from triton.experimental.gluon._runtime import GluonASTSource

        make_source = GluonASTSource
        signature.update(out_ptr=f"*{name}", partial_ptr="*fp32", counter_ptr="*i32", rows0="i32", rows1="i32")
        for member in ("m1", "m2"):  # the members of a group launch (MEMBERS 1 here: unread)
            signature.update({f"{member}_packed_ptr": "*u8", f"{member}_absmax_ptr": "*u8", f"{member}_code_ptr": "*fp32",
                              f"{member}_absmax2_ptr": "*fp32", f"{member}_code2_ptr": "*fp32",
                              f"{member}_offset_ptr": "*fp32", f"{member}_out_ptr": f"*{name}"})
        fold = not isinstance(config, KSliceConfig) and config.fold and split_k > 1
        fn, mma_constexprs = fused.gluon_kernel(config, steps, split_k, fold, 1)  # as launched
        constexprs.update(mma_constexprs)
    else:
        fn, make_source = tl_matmul.nf4_matmul_kernel, triton.compiler.ASTSource
        constexprs.update(SPLIT_K=split_k, STEPS_PER_SPLIT=steps // split_k, DOT=config.dot, USE_ASM=True,
                          BF16_VIA_INT=capability < (8, 0), EVEN=True,
                          LOOKUP=config.lookup if kernel.TRITON_COMPILES_SHARED_TABLES else 0)
        options["num_stages"] = config.num_stages
    signature.update({key: "constexpr" for key in constexprs})
    # the JIT's specialization of a call with 16-byte aligned tensors and sizes of multiples of 16 (K = 4096)
    aligned = [name for name in fn.arg_names if signature[name].startswith("*")] + ["N", "K", "stride_xm"]
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    source = make_source(fn, {key: signature[key] for key in fn.arg_names}, constexprs, attrs=attrs)
    target = GPUTarget("cuda", capability[0] * 10 + capability[1], 32)
    return triton.compile(source, target=target, options=options)


def ptx_digest(ptx, name):
    """A digest of the PTX with its line information (and debug sections), the kernel's name and the compiler's
    header left out: two kernels that compile to the same instructions give the same digest."""
    ptx = ptx.split("\t.section\t.debug", 1)[0]
    lines = [line for line in ptx.splitlines() if not re.match(r"\s*(\.loc|\.file|//|\$L__(func|debug|info|tmp))", line)]
    body = "\n".join(lines[lines.index(next(line for line in lines if ".entry" in line)):]).replace(name, "KERNEL")
    return hashlib.sha256(body.encode()).hexdigest()[:16]


def main():
    cc = int(sys.argv[1])
    capability = (cc // 10, cc % 10)
    for x_dtype, config in variants(capability):
        compiled = compile_variant(capability, x_dtype, config)
        ptx = compiled.asm["ptx"]
        described = dict(family=type(config).__name__, **dataclasses.asdict(config))
        print(json.dumps({"cc": cc, "x_dtype": TL_NAME[x_dtype], "config": described,
                          "shared_bytes": compiled.metadata.shared, "shfl": len(re.findall(r"shfl\.sync", ptx)),
                          "asm_mul_ftz": len(re.findall(r"mul\.rn\.ftz\.f32", ptx)),
                          "wgmma": len(re.findall(r"wgmma\.mma_async", ptx)),
                          "mma": len(re.findall(r"\bmma\.sync", ptx)),
                          "ld_v4": len(re.findall(r"ld\.global(\.[\w:]+)*\.v4", ptx)),
                          "ld_v2": len(re.findall(r"ld\.global(\.[\w:]+)*\.v2", ptx)),
                          "ld_evict_first": len(re.findall(r"ld\.global\.L1::evict_first\.L2::cache_hint", ptx)),
                          "ptx_digest": ptx_digest(ptx, compiled.metadata.name)}),
              flush=True)


if __name__ == "__main__":
    main()
