"""Section ``kernels``: every contender and instrument on every weight, in interleaved rounds, each
round a ``do_bench`` sample and the profiler's GPU time per call after the same L2 flush; checked
bit-exact with bitsandbytes first. Rows ``kernel`` (do_bench) and ``kernel-gpu`` (profiler)."""

import torch
from tqdm import tqdm  # text bars: a saved notebook shows their last state; a widget bar needs a live kernel

import bench.contenders
import bench.results
import bench.timing
import bench.weights


def run(shapes, dtypes, rounds, rooflines, meta, log):
    """Rows of every contender on every weight; ``log`` gets a line per weight and timer."""
    rows = []
    funcs = bench.contenders.contenders(log)
    cases = bench.weights.weights(shapes, dtypes)
    for dtype_name, shape, packed, state in tqdm(cases, desc="kernels", total=len(shapes) * len(dtypes)):
        expected = funcs["bitsandbytes"](packed, state)
        for name, fn in funcs.items():
            if name not in bench.contenders.INSTRUMENTS:
                assert torch.equal(fn(packed, state), expected), f"{name} is not bit-exact with bitsandbytes"
        callables = {name: (lambda fn=fn: fn(packed, state)) for name, fn in funcs.items()}
        samples = {name: [] for name in funcs}
        gpu_samples = {name: [] for name in funcs}
        for _ in range(rounds):
            for name, call in callables.items():
                samples[name].append(bench.timing.do_bench(call)[0])
            for name, ms in bench.timing.gpu_times(callables).items():
                gpu_samples[name].append(ms)
        event_rows = [bench.results.timing_row(meta, "kernel", shape, dtype_name, name,
                                               bench.timing.summarize(samples[name]), rooflines["do_bench"],
                                               bench.timing.extra_peak_bytes(call))
                      for name, call in callables.items()]
        gpu_rows = [bench.results.timing_row(meta, "kernel-gpu", shape, dtype_name, name,
                                             bench.timing.summarize(gpu_samples[name]), rooflines["profiler"])
                    for name in callables]
        for label, new_rows, digits in (("", event_rows, 1), (", GPU time (profiler)", gpu_rows, 2)):
            log(f"{dtype_name} {shape}{label}: " + ", ".join(
                f"{r['implementation']} {r['median_us']:.{digits}f} us ({r['pct_roofline']:.0f} %)" for r in new_rows))
        rows += event_rows + gpu_rows
    return rows
