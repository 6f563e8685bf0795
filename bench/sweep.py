"""Section ``sweep``: launch configurations of our kernel on each weight through launch plans (no
validation in the timing), and the best all-on configuration for this GPU. Rows ``sweep`` (one
do_bench sample each) and ``sweep-gpu`` (the profiler's GPU time per call, 30 calls)."""

import functools
import math

import torch
from tqdm import tqdm  # text bars: a saved notebook shows their last state; a widget bar needs a live kernel

import bench.results
import bench.timing
import bench.weights
from nf4_triton import kernel

# Bytes per program x warps with everything on, with the codebooks in global memory and (from
# Triton 3.4, kernel.TRITON_COMPILES_SHARED_TABLES) in shared memory; then, at 4 warps, one thing
# changed at a time: the inline PTX off, the eviction hints off, the int32 word loads off
# (loads=auto takes words on these shapes).
SWEEP_CONFIGS = [dict(BYTES_PER_PROGRAM=b, num_warps=w, USE_ASM=True, EVICTION_HINTS=True, SHARED_TABLES=shared)
                 for shared in ((False, True) if kernel.TRITON_COMPILES_SHARED_TABLES else (False,))
                 for b in (256, 512, 1024, 2048, 4096) for w in (2, 4, 8)]
SWEEP_CONFIGS += [dict(BYTES_PER_PROGRAM=b, num_warps=4, SHARED_TABLES=False, **change)
                  for b in (256, 512, 1024, 2048, 4096)
                  for change in (dict(USE_ASM=False, EVICTION_HINTS=True),
                                 dict(USE_ASM=True, EVICTION_HINTS=False, STREAM_STORES=False),
                                 dict(USE_ASM=True, EVICTION_HINTS=True, WORD_LOADS=False))]


def config_label(config):
    loads = "bytes" if config.get("WORD_LOADS", True) is False else "auto"
    tables = "shared" if config["SHARED_TABLES"] else "global"
    return (f"bpp={config['BYTES_PER_PROGRAM']} warps={config['num_warps']} asm={config['USE_ASM']} "
            f"hints={config['EVICTION_HINTS']} tables={tables} loads={loads}")


def best_launch_config(sweep_rows):
    """The swept configuration with everything on (inline PTX, eviction hints, automatic loads)
    that is fastest over all swept weights by GPU time: (LaunchConfig, its label, its geometric-mean
    slowdown against each weight's fastest configuration)."""
    candidates = {config_label(config): config for config in SWEEP_CONFIGS
                  if config["USE_ASM"] and config["EVICTION_HINTS"] and config.get("WORD_LOADS", True)}
    rows = [row for row in sweep_rows if row["kind"] == "sweep-gpu"]
    fastest = {}
    for row in rows:
        weight = (row["shape"], row["dtype"])
        fastest[weight] = min(fastest.get(weight, math.inf), row["median_us"])
    slowdowns = {}
    for row in rows:
        if row["implementation"] in candidates:
            slowdowns.setdefault(row["implementation"], []).append(row["median_us"] / fastest[(row["shape"], row["dtype"])])
    scores = {label: math.prod(values) ** (1 / len(values)) for label, values in slowdowns.items()}
    label = min(scores, key=scores.get)
    config = candidates[label]
    return kernel.LaunchConfig(config["BYTES_PER_PROGRAM"], config["num_warps"], config["SHARED_TABLES"]), label, scores[label]


def run(shapes, dtypes, rooflines, meta, log):
    """Every SWEEP_CONFIGS entry on each weight (launch plans: no validation in the timing), one
    do_bench sample each, and each configuration's GPU time per call (profiler, 30 calls)."""
    rows = []
    for dtype_name, shape, packed, state in tqdm(bench.weights.weights(shapes, dtypes), desc="sweep",
                                                 total=len(shapes) * len(dtypes)):
        expected = kernel.dequantize_nf4(packed, state)
        launches = {config_label(config): functools.partial(kernel.build_plan(packed, state, **config).launch, packed)
                    for config in SWEEP_CONFIGS}
        for label, fn in launches.items():
            assert torch.equal(fn(), expected), label
            rows.append(bench.results.timing_row(meta, "sweep", shape, dtype_name, label, bench.timing.do_bench(fn),
                                                 rooflines["do_bench"]))
        gpu_rows = [bench.results.timing_row(meta, "sweep-gpu", shape, dtype_name, label, (ms,) * 3, rooflines["profiler"])
                    for label, ms in bench.timing.gpu_times(launches).items()]
        rows += gpu_rows
        best = min(gpu_rows, key=lambda r: r["median_us"])
        log(f"sweep {dtype_name} {shape}: best by GPU time {best['implementation']} {best['median_us']:.2f} us")
    return rows
