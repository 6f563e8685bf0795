"""Benchmark: this kernel against bitsandbytes and Unsloth, the copy roofline, a launch sweep.

    python -m bench [--quick] [--dtype fp16|bf16|all] [--out results/] [--rounds N]
                    [--sections kernels,harness,compile,sweep,forms,model] [--plot FOLDER]

Kernel times are ``triton.testing.do_bench`` medians (L2 flushed between runs), taken in rounds
that interleave the contenders; the reported median is the median over rounds, p20/p80 the
spread over rounds. Beside each ``do_bench`` sample, a round records each contender's GPU time per
call from the profiler (CUPTI), after the same flush: it leaves out the GPU front end's time
around the kernel, which ``do_bench``'s CUDA events include. Bandwidth counts n/2 packed + n/64
absmax + the output bytes, against the device-to-device copy measured in the same run. Two
measuring instruments run beside the contenders: ``floor (no decode)``, a kernel that reads the
packed bytes and writes the output with no decoding, and ``copy (same bytes)``, a device-to-device
copy of as many bytes as the weight's dequantization moves. The harness carries a third: an fx
that only allocates and launches an empty kernel; the compile section compiles the floor kernel over
our six input tensors, a graph with no validation and no decode.
Without a GPU it says so and runs a small correctness demo through the interpreter.

One module per concern: bench.timing (how a call is timed), bench.results (rows, versions, CSVs),
bench.weights and bench.contenders (what is timed, the instruments), one module per section
(bench.kernels, bench.harness, bench.compile, bench.sweep, bench.forms, bench.model) and
bench.plots (the charts). This file reads the command line and runs the sections.
"""

import argparse

import torch
from tqdm import tqdm  # text bars: a saved notebook shows their last state; a widget bar needs a live kernel

import bench.compile
import bench.forms
import bench.harness
import bench.kernels
import bench.matmul
import bench.model
import bench.plots
import bench.results
import bench.sweep
import bench.timing
import bench.weights
from nf4_triton import kernel

SECTIONS = ("kernels", "harness", "compile", "sweep", "forms", "model", "matmul")
DEFAULT_SECTIONS = ("kernels", "harness", "compile", "sweep", "forms")  # "model" and "matmul" take minutes more


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help=f"{len(bench.weights.QUICK_SHAPES)} shapes, fewer rounds, the first model size")
    parser.add_argument("--dtype", choices=["fp16", "bf16", "all"], default="all")
    parser.add_argument("--out", default="results", help="folder for CSVs (a per-GPU subfolder is made)")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--sections", default=",".join(DEFAULT_SECTIONS),
                        help=f"comma-separated subset of {','.join(SECTIONS)} (default: all but model and matmul)")
    parser.add_argument("--plot", metavar="FOLDER", help="only draw the charts of a results folder")
    args = parser.parse_args(argv)
    args.sections = args.sections.split(",")
    unknown = set(args.sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {','.join(SECTIONS)}")
    return args


def cpu_demo():
    """Without a GPU: one small weight through the interpreter, checked against bitsandbytes' CPU path."""
    import bitsandbytes.functional as F

    print("No CUDA GPU: nothing to time. Running a small correctness demo through Triton's interpreter.")
    bench.weights.quiet_bitsandbytes_cpu_notice()
    weight = torch.randn(24, 320, generator=torch.Generator().manual_seed(0))
    packed, state = F.quantize_4bit(weight, blocksize=64, compress_statistics=True, quant_type="nf4")
    state.dtype = torch.bfloat16
    ours, theirs = kernel.dequantize_nf4(packed, state), F.dequantize_4bit(packed, state)
    print("Checked: a 24x320 weight quantized by bitsandbytes (NF4, double-quantized absmax), dequantized "
          "to bf16 by the kernel on the CPU against bitsandbytes' own CPU dequantization.")
    print("bit-exact with bitsandbytes:", torch.equal(ours.view(torch.int16), theirs.view(torch.int16)))
    print("Next: `python -m pytest -q tests` runs the CPU test suite (GPU-only tests show as skipped, `s`); "
          "on a CUDA GPU, `python -m bench` times its default sections and writes results/<gpu>/.")


def main(argv=None):
    args = parse_args(argv)
    if args.plot:
        print("\n".join(bench.plots.plot(args.plot)))
        return
    if not torch.cuda.is_available():
        cpu_demo()
        return

    sections = args.sections
    dtypes = bench.weights.DTYPES if args.dtype == "all" else {args.dtype: bench.weights.DTYPES[args.dtype]}
    shapes = bench.weights.QUICK_SHAPES if args.quick else bench.weights.SHAPES
    rounds = args.rounds or (3 if args.quick else 5)
    meta = bench.results.run_metadata()
    print(meta)
    rooflines = bench.timing.copy_roofline()
    print("device-to-device copy: " + ", ".join(f"{gbps:.0f} GB/s ({timer})" for timer, gbps in rooflines.items()))
    rows = bench.results.roofline_rows(meta, rooflines)
    if "kernels" in sections:
        rows += bench.kernels.run(shapes, dtypes, rounds, rooflines, meta, tqdm.write)
    if "harness" in sections:
        # A harness round takes about 2 s on the H100 host, and its per-round ratio against Unsloth
        # fused spanned 1.20 to 1.66 over 7 rounds of one run (NOTES.md, item 50): three times the rounds.
        rows += bench.harness.run(bench.harness.HARNESS_ROUNDS_PER_ROUND * rounds, meta, tqdm.write)
    if "compile" in sections:
        rows += bench.compile.run(bench.compile.COMPILE_SHAPES, dtypes, rounds, rooflines, meta, tqdm.write)
    if "sweep" in sections:
        rows += bench.sweep.run(bench.weights.QUICK_SHAPES, dtypes, rooflines, meta, tqdm.write)
    if "forms" in sections:
        rows += bench.forms.run(rounds, meta, tqdm.write)
    if "model" in sections:
        sizes = list(bench.model.SIZES)[:1] if args.quick else list(bench.model.SIZES)
        rows += bench.model.run(sizes, dtypes, rounds, meta, tqdm.write)
    if "matmul" in sections:
        rows += bench.matmul.run(dtypes, rounds, rooflines, meta, tqdm.write,
                                rows=bench.matmul.QUICK_ROWS if args.quick else bench.matmul.ROWS)

    folder = bench.results.write_results(rows, bench.results.results_folder(args.out))
    print("wrote", ", ".join(bench.plots.plot(folder)), "and the CSVs in", folder)


if __name__ == "__main__":
    main()
