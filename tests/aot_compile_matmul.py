"""Compile the fused matmul's route configurations for one GPU target, without a GPU.

Run as ``python tests/aot_compile_matmul.py CC``. Prints one JSON line per variant with the PTX
facts the tests check. ``python tests/aot_compile_matmul.py CC --sass`` prints instead each Gluon route's K loop in
SASS (``loop_facts``): its instructions a thread issues per weight it decodes, by class.
Compiled as the JIT specializes a call with 16-byte aligned tensors and sizes
of multiples of 16; without that every load is scalar (4096x14336's one-row route, bf16, Triton 3.6:
358 global loads a thread against 86, x's 16-bit elements one at a time). Run as a script, TRITON_INTERPRET=0 so
that matmul.py defines compiled kernels on any machine.
"""

import dataclasses
import hashlib
import json
import os
import re
import sys

if __name__ == "__main__":  # the script alone: imported (its SASS counter, by a test), it changes nothing
    os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

import bench.matmul  # noqa: E402
from nf4_triton import fused, kernel, matmul, routes, tl_matmul  # noqa: E402
from nf4_triton.routes import KSliceConfig, TlConfig  # noqa: E402

TL_NAME = {tl.float16: "fp16", tl.bfloat16: "bf16", tl.float32: "fp32"}


K = 4096  # the input features every variant is compiled for


def route_table(capability):
    """The table nf4_linear takes on this Triton: TL_ROUTES where Gluon's mma_v2 is missing (before 3.6)."""
    return routes.MATMUL_ROUTES if fused.gluon_runs_on(capability) else routes.TL_ROUTES


def variants(capability):
    """(x dtype, config) for each fused route of this GPU, in every activation dtype it serves there. Below sm_80,
    where no fused route is taken, the tl kernel's dot tile in fp16: what Triton makes of tl.dot there."""
    if capability < (8, 0):
        if matmul.SM75_COMPILES:  # Triton 3.3.1 aborts in its LLVM lowering there
            yield tl.float16, routes.TL_DEFAULT_ROUTES[0].config
        return
    table = route_table(capability)
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
    steps = K // config.block_k
    split_k = fused.largest_divisor(steps, config.split_k)  # as a call at K runs it
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
    # the JIT's specialization of a call with 16-byte aligned tensors and sizes of multiples of 16 (K)
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


# SASS opcodes by what they do, the first class whose prefix an opcode starts with; the rest count as "other"
SASS_CLASSES = (("mma", ("HMMA", "HGMMA", "WARPGROUP")), ("global load", ("LDG",)),
                ("shared memory", ("LDS", "STS", "LDSM")), ("shuffle", ("SHFL",)),
                ("fp32 math", ("FMUL", "FFMA", "FADD", "FSEL", "FSETP", "FMNMX")), ("16-bit math", ("HMUL2", "HFMA2", "HADD2")),
                ("convert", ("F2F", "I2F", "F2I", "PRMT")),
                ("integer", ("IMAD", "IADD3", "LOP3", "SHF", "LEA", "ISETP", "IABS", "IMNMX", "SEL", "MOV", "PLOP3",
                             "R2UR", "UIADD3", "UIMAD", "ULOP3", "USHF", "ULEA", "UMOV", "ULDC", "LDC", "S2R", "S2UR",
                             "CS2R", "P2R", "R2P", "VOTE", "POPC", "FLO", "BREV", "BMSK", "SGXT")),
                ("control", ("BRA", "BAR", "NOP", "DEPBAR", "WARPSYNC", "BSSY", "BSYNC", "YIELD", "EXIT", "MEMBAR",
                             "ERRBAR", "CCTL")))


def sass_class(opcode):
    return next((name for name, prefixes in SASS_CLASSES if opcode.startswith(prefixes)), "other")


def loop_facts(sass):
    """The innermost loop of ``sass`` (the text Triton's ``asm["sass"]`` gives) that holds a tensor-core instruction,
    or the whole kernel where none does (its K steps all unrolled): {"scope": "loop" or "kernel", "instructions": its
    count, "stall_cycles": the sum of their stall counts (the control code's last field: a warp's issue time through
    it alone), "by_class": {class: count}}."""
    lines = sass.splitlines()
    labels = {line[:-1]: index for index, line in enumerate(lines) if re.fullmatch(r"\w+:", line)}
    loops = []
    for index, line in enumerate(lines):
        branch = re.search(r"\bBRA (\w+);", line)
        if branch and labels.get(branch.group(1), index) < index:
            loops.append((labels[branch.group(1)], index))
    facts = []
    for start, end in loops + [(-1, len(lines) - 1)]:
        body = [re.match(r"([0-9a-fA-F-]{2}):[^:]+:[^:]+:[^:]+:([0-9a-fA-F])\t(?:@!?U?P\w+ )?([A-Z0-9_]+)", line)
                for line in lines[start + 1:end + 1]]
        body = [match for match in body if match]
        by_class = {}
        for match in body:
            name = sass_class(match.group(3))
            by_class[name] = by_class.get(name, 0) + 1
        if "mma" in by_class:
            facts.append({"scope": "kernel" if start < 0 else "loop", "instructions": len(body),
                          "stall_cycles": sum(int(match.group(2), 16) for match in body), "by_class": by_class})
    return min(facts, key=lambda fact: fact["instructions"])


def weights_per_thread(config, steps, split_k, scope):
    """The weights one thread of a program decodes in one pass of the K loop (``scope`` "loop"), or in all its steps
    ("kernel"), as ``compile_variant`` compiles it: a step's tile (a K-slice program's warps each take their slice)
    times the steps unrolled in the body, or times the program's steps."""
    constexprs = fused.gluon_kernel(config, steps, split_k, False, 1)[1]
    if isinstance(config, KSliceConfig):  # a warp's rows along its own slice
        return config.block_n * config.block_k * (constexprs["UNROLL"] if scope == "loop" else steps // config.warps) // 32
    steps_taken = constexprs["UNROLL"] if scope == "loop" else steps // split_k
    return config.block_n * config.block_k * steps_taken // (config.num_warps * 32)


def print_sass(capability):
    """Per Gluon route of ``capability`` and x dtype: the K loop's instructions per weight, in all and by class."""
    rows = {}
    for route in routes.routes_for(capability, route_table(capability)):
        if route.path == "fused":
            rows.setdefault(route.config, []).append(route.max_rows)
    for x_dtype, config in variants(capability):
        if isinstance(config, TlConfig) or config not in rows:
            continue
        steps = K // config.block_k  # as compile_variant compiles it
        facts = loop_facts(compile_variant(capability, x_dtype, config).asm["sass"])
        weights = weights_per_thread(config, steps, fused.largest_divisor(steps, config.split_k), facts["scope"])
        print(json.dumps({"x_dtype": TL_NAME[x_dtype], "max_rows": rows[config], "config": repr(config),
                          "scope": facts["scope"], "weights_per_thread": weights,
                          "per_weight": round(facts["instructions"] / weights, 3),
                          "stall_cycles_per_weight": round(facts["stall_cycles"] / weights, 3),
                          "by_class_per_weight": {name: round(count / weights, 3)
                                                  for name, count in sorted(facts["by_class"].items())}}), flush=True)


def main():
    cc = int(sys.argv[1])
    capability = (cc // 10, cc % 10)
    if sys.argv[2:] == ["--sass"]:
        print_sass(capability)
        return
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
