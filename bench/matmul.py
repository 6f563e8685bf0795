"""Benchmark section ``matmul``: the fused NF4 matmul against bitsandbytes, dequantize + cuBLAS and a
16-bit weight already in memory, over row counts M, with the roofline measured in the same run and
``floor (bytes once)`` beside them, a kernel that only reads the weight's bytes (launch and ramp included).

    python -m bench --sections matmul            # the section: results/<gpu>/matmul.csv, matmul.png
    python -m bench.matmul --sweep [--dtype ...] [--layers 4096x14336,...] [--rows 1,16,...]
                                                 # the candidates behind routes.MATMUL_ROUTES
    notebook_points(...)                         # the notebooks' section 7: one layer, the same timing

GPU time per call comes from CUDA graphs: one graph calls the layer once for each of several
copies of its weight (more bytes than three L2 sizes, as a model's layers are read from memory,
not cache), and a replay's time over the calls is one sample. Contenders are interleaved within
each round; the median over rounds is reported with p20 and p80. The roofline of a point is
max(NF4 bytes / copy bandwidth, 2 M K N / dense matmul rate), both measured here.
"""

import argparse
import copy
import statistics
import time

import torch

import bench.contenders
import bench.timing
import bench.weights
from nf4_triton import fastpath, fused, kernel, matmul, quantstate, routes
from nf4_triton.routes import KSliceConfig, MmaConfig, TlConfig, WgmmaConfig

# (in, out): Llama-3-8B's attention (q/o, k/v), MLP up/gate and down, and a 70B model's MLP
LAYERS = [(4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096), (8192, 28672), (28672, 8192)]
ROWS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096]
QUICK_ROWS = [1, 4, 16, 64, 256, 1024]


def make_layer(in_features, out_features, dtype, seed=0, device="cuda"):
    """A bitsandbytes NF4 Linear4bit (double-quantized absmax) on ``device``, computing in dtype."""
    import bitsandbytes as bnb

    torch.manual_seed(seed)
    layer = bnb.nn.Linear4bit(in_features, out_features, bias=False, compute_dtype=dtype, compress_statistics=True,
                              quant_type="nf4", device="cpu")
    layer = layer.to(device)  # quantized on the device it moves to
    layer.weight.quant_state.dtype = dtype
    return layer


def nf4_bytes(in_features, out_features):
    """Bytes a layer's NF4 weight occupies: packed codes, uint8 absmax, absmax2 (fp32 per 256 blocks)."""
    n = in_features * out_features
    return n // 2 + n // 64 + 4 * -(-n // (64 * 256))


def copies_for(in_features, out_features, l2_bytes, most=64):
    """How many copies of a weight make the graph read more than three L2 sizes."""
    return max(2, min(most, -(-3 * l2_bytes // nf4_bytes(in_features, out_features))))


def graph_us(calls, replays=20):
    """GPU microseconds per call of a CUDA graph that runs every callable in ``calls`` once."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * len(calls))


def dense_tflops(dtype):
    """A large dense matmul in dtype through cuBLAS, TFLOP/s."""
    a = torch.randn(8192, 8192, device="cuda", dtype=dtype)
    b = torch.randn(8192, 8192, device="cuda", dtype=dtype)
    us = statistics.median(graph_us([lambda: a @ b], replays=10) for _ in range(3))
    return 2 * 8192**3 / us / 1e6


def fused_call(layer, x, config, out):
    """f() computing x @ W.T through the fused kernel with this config, into out (no validation)."""
    packed, state = layer.weight.data, layer.weight.quant_state
    _, blocksize, nested, blocksize2, tables = quantstate.check_state(packed, state)
    n, k = state.shape
    capability = fastpath.device_facts(x.device)[0]
    return lambda: fused.launch_fused(x, packed.view(torch.uint8), tables, None, out, n=n, k=k, blocksize=blocksize,
                                      blocksize2=blocksize2, nested=nested, fp4=False, config=config,
                                      capability=capability)


# Candidates per row count, from wider sweeps at 4096x14336 and 14336x4096 (NOTES.md, items 70, 77 and 80); the
# mma.sync tiles as (num_warps, block_n, block_k, split_k[, words]) per block_m.
MMA_TILES = {
    8: [(4, 64, 256, 4), (4, 64, 64, 4), (4, 64, 256, 8), (8, 128, 64, 16), (4, 128, 256, 8), (4, 64, 128, 8),
        (4, 128, 64, 16), (8, 128, 256, 4), (4, 64, 256, 4, 4), (4, 64, 256, 8, 4), (4, 128, 256, 8, 4),
        (4, 64, 128, 8, 4), (4, 128, 128, 8, 4), (8, 128, 256, 4, 4)],
    32: [(4, 64, 128, 4), (4, 128, 128, 4), (4, 64, 256, 4), (4, 128, 128, 8), (8, 128, 64, 8), (4, 64, 64, 8),
         (4, 128, 256, 2), (4, 128, 64, 16)],
    64: [(4, 128, 128, 2), (4, 128, 64, 2), (4, 64, 128, 4), (4, 128, 128, 4), (8, 128, 64, 4), (4, 128, 64, 8),
         (4, 64, 64, 8), (8, 256, 64, 4)],
    128: [(4, 64, 64, 4), (4, 128, 64, 2), (4, 128, 64, 1), (8, 128, 64, 2), (4, 64, 64, 2), (4, 64, 128, 4),
          (4, 64, 128, 4, 4), (4, 128, 128, 2, 4), (8, 128, 128, 2, 4)],
}


# The wgmma tiles (sm_90, each step's loads a step ahead; NOTES.md item 82): (num_warps, block_n, block_k,
# split_k) per block_m
WGMMA_TILES = {
    32: [(4, 64, 64, 4), (8, 128, 64, 2), (4, 64, 128, 4), (4, 64, 64, 8)],
    64: [(8, 128, 128, 2), (8, 128, 64, 2), (4, 64, 128, 4), (4, 64, 64, 4), (4, 64, 64, 8)],
    128: [(4, 64, 128, 4), (8, 128, 64, 2), (4, 64, 128, 2), (8, 128, 128, 2), (4, 64, 64, 4), (4, 64, 128, 8),
          (8, 128, 64, 1), (4, 64, 128, 1)],
}


def _mma(block_m, tiles):
    return [MmaConfig(block_m, bn, bk, split_k=sk, num_warps=warps, words=words) for warps, bn, bk, sk, words in
            (tile + (2,) * (5 - len(tile)) for tile in tiles)]


# K slices across a program's warps (nf4_mma_kwarps_kernel, one warp's 16 weight rows; NOTES.md item 98):
# (kwarps, block_n, block_k, unroll)
KWARPS_TILES = [(4, 16, 512, 4), (4, 16, 256, 4), (8, 16, 128, 4), (8, 16, 256, 1)]


def kwarps_configs(block_m):
    return [KSliceConfig(block_m, bn, bk, warps=warps, unroll=unroll) for warps, bn, bk, unroll in KWARPS_TILES]


def streamed(configs):
    """``configs`` and each Gluon one again with the weight's words evict-first (``stream``, NOTES.md item 101)."""
    return configs + [config.replace(stream=True) for config in configs if not isinstance(config, TlConfig)]


def _wgmma(block_m):
    return [WgmmaConfig(block_m, bn, bk, split_k=sk, num_warps=warps, prefetch=True)
            for warps, bn, bk, sk in WGMMA_TILES[block_m]]


def _tl(block_m, tiles, num_warps=4):
    """The tl kernel's tiles as (block_n, block_k, split_k, num_stages or num_warps, lookup)."""
    return [TlConfig(block_m, bn, bk, split_k=sk, num_stages=st, lookup=lookup, num_warps=num_warps)
            for bn, bk, sk, st, lookup in tiles]


CANDIDATES = {
    8: streamed([TlConfig(1, 32, 256, split_k=4, dot=False, num_stages=3, lookup=0)] + _mma(8, MMA_TILES[8])
                + kwarps_configs(8)),
    16: streamed(_tl(16, ((64, 256, 4, 2, 2), (64, 512, 4, 2, 2), (64, 128, 4, 2, 2), (32, 256, 4, 2, 2),
                          (32, 256, 4, 2, 1), (64, 256, 1, 3, 2), (64, 128, 4, 2, 1))) + _mma(16, MMA_TILES[8])),
    32: _mma(32, MMA_TILES[32]) + _wgmma(32),
    64: [TlConfig(64, bn, bk, split_k=sk, num_warps=w, num_stages=3, lookup=lookup) for bn, bk, sk, w, lookup in (
        (64, 128, 1, 4, 2), (128, 128, 2, 4, 2), (64, 128, 2, 4, 2), (64, 64, 2, 8, 2), (64, 128, 1, 4, 1),
        (64, 128, 2, 4, 1))] + _mma(64, MMA_TILES[64]) + _wgmma(64),
    256: [TlConfig(bm, bn, bk, split_k=sk, num_warps=w, num_stages=3) for bm, bn, bk, sk, w in (
        (128, 64, 128, 1, 4), (128, 64, 128, 2, 4), (128, 128, 128, 1, 8), (128, 128, 64, 2, 4), (64, 128, 128, 2, 4))]
    + _mma(128, MMA_TILES[128]) + _mma(64, MMA_TILES[64][:2]) + _wgmma(128),
}


def candidates(m):
    """The candidate configs for M rows: those of the smallest bucket at or above M."""
    return CANDIDATES[next(bucket for bucket in sorted(CANDIDATES) if m <= bucket or bucket == max(CANDIDATES))]


def baselines(layers, x):
    """name -> calls (one per weight copy): bitsandbytes' forward, dequantize + F.linear, and
    F.linear on a 16-bit weight already in memory."""
    resident = [kernel.dequantize_nf4(layer) for layer in layers]
    return {
        "bitsandbytes": [lambda layer=layer: layer(x) for layer in layers],
        "dequantize + F.linear": [lambda layer=layer: torch.nn.functional.linear(x, kernel.dequantize_nf4(layer))
                                  for layer in layers],
        "resident 16-bit": [lambda w=w: torch.nn.functional.linear(x, w) for w in resident],
    }


def sweep(dtype, layers, rows, configs, log=print):
    """Time every config at every (layer, M); check each against dequantize + F.linear."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    results = []
    for in_features, out_features in layers:
        base = make_layer(in_features, out_features, dtype)
        layers_ = [base] + [copy.deepcopy(base) for _ in range(copies_for(in_features, out_features, l2) - 1)]
        w = kernel.dequantize_nf4(base)
        for m in rows:
            x = torch.randn(m, in_features, device="cuda", dtype=dtype)
            ref = x.float() @ w.float().T
            scale = ref.abs().max().item()
            out = torch.empty(m, out_features, device="cuda", dtype=dtype)
            with torch.no_grad():
                for name, calls in baselines(layers_, x).items():
                    log(f"row,{dtype},{in_features}x{out_features},{m},{graph_us(calls):.2f},0,{name}")
            for config in configs(m):
                try:
                    calls = [fused_call(layer, x, config, out) for layer in layers_]
                    calls[0]()
                    torch.cuda.synchronize()
                    error = (out.float() - ref).abs().max().item() / scale
                    us = graph_us(calls)
                except Exception as exc:  # a config the compiler refuses (shared memory, registers)
                    log(f"{in_features}x{out_features} M={m} {config}: {type(exc).__name__} {str(exc)[:80]}")
                    continue
                results.append(dict(layer=f"{in_features}x{out_features}", m=m, config=config, us=us, error=error))
                log(f"row,{dtype},{in_features}x{out_features},{m},{us:.2f},{error:.2e},{config!r}")
            best = sorted((r for r in results if r["layer"] == f"{in_features}x{out_features}" and r["m"] == m),
                          key=lambda r: r["us"])[:5]
            for r in best:
                log(f"{r['layer']} M={m}: {r['us']:.2f} us err {r['error']:.1e} {r['config']}")
        del layers_, base
        torch.cuda.empty_cache()
    return results


def fused_config(rows, in_features, out_features):
    """The fused kernel's configuration for a point: the route's where it is fused, else that of the
    first fused route for as many rows (the benchmark times the kernel at every point); from
    ``TL_ROUTES`` where mma.py's kernel cannot run (Triton before 3.6, the interpreter, sm_75). The
    capability's table whatever the DRAM (``routes.FAST_DRAM_ROUTES``): the tiles an H200 passes over
    are timed there too."""
    capability = fastpath.device_facts()[0]
    table = routes.MATMUL_ROUTES if fused.gluon_runs_on(capability) else routes.TL_ROUTES
    route = routes.choose_route(capability, rows, in_features, out_features, table)
    if route.path == "fused":
        return route.config
    fused_routes = [r for r in routes.routes_for(capability, table) if r.path == "fused"]
    return next((r.config for r in fused_routes if rows <= r.max_rows), fused_routes[-1].config)


def contenders(layers, x, out_features):
    """name -> calls (one per weight copy): the baselines, the fused kernel, nf4_linear's route and
    the floor (``bench.contenders.bytes_once``: the bytes read once, no product)."""
    rows, in_features = x.shape
    config = fused_config(rows, in_features, out_features)
    out = torch.empty(rows, out_features, device=x.device, dtype=x.dtype)
    weights = [quantstate.resolve(layer.weight, layer.weight.quant_state) for layer in layers]
    return {
        **baselines(layers, x),
        "fused kernel": [fused_call(layer, x, config, out) for layer in layers],
        "nf4_linear (routed)": [lambda layer=layer: matmul.nf4_linear(x, layer) for layer in layers],
        bench.contenders.MATMUL_FLOOR: [lambda weight=weight: bench.contenders.bytes_once(x, *weight)
                                        for weight in weights],
    }


def run(dtypes, rounds, rooflines, meta, log=print, layers=LAYERS, rows=ROWS):
    """The section: every contender at every (layer, M, dtype), interleaved, ``rounds`` rounds;
    returns CSV rows (kind "matmul") with the point's roofline and the route nf4_linear took.
    The copy bandwidth is the profiler's (``bench.timing.copy_roofline``): a copy captured in a
    CUDA graph runs on the copy engines, 2434 against 3014 GB/s on the H100."""
    bandwidth = rooflines["profiler"]
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    table = []
    for dtype_name, dtype in dtypes.items():
        tflops = dense_tflops(dtype)
        log(f"{dtype_name} dense matmul: {tflops:.0f} TFLOP/s (cuBLAS, 8192^3)")
        for in_features, out_features in layers:
            base = make_layer(in_features, out_features, dtype)
            copies = [base] + [copy.deepcopy(base) for _ in range(copies_for(in_features, out_features, l2) - 1)]
            for m in rows:
                x = torch.randn(m, in_features, device="cuda", dtype=dtype)
                roofline_us = max(nf4_bytes(in_features, out_features) / bandwidth / 1e3,
                                  2 * m * in_features * out_features / tflops / 1e6)
                route = matmul.device_route(None, m, in_features, out_features)[0]
                with torch.no_grad():
                    calls = contenders(copies, x, out_features)
                    samples = {name: [] for name in calls}
                    for _ in range(rounds):
                        for name, fns in calls.items():
                            samples[name].append(graph_us(fns, replays=10))
                for name, times in samples.items():
                    median, p20, p80 = bench.timing.summarize(times)
                    table.append(dict(meta, kind="matmul", shape=f"{in_features}x{out_features}", dtype=dtype_name,
                                      rows=m, implementation=name, median_us=median, p20_us=p20, p80_us=p80,
                                      roofline_us=roofline_us, pct_roofline=100 * roofline_us / median,
                                      route=route.path, copy_gbps=bandwidth, dense_tflops=tflops))
                best = min(("bitsandbytes", "dequantize + F.linear", "fused kernel"),
                           key=lambda name: statistics.median(samples[name]))
                log(f"{dtype_name} {in_features}x{out_features} M={m}: " + ", ".join(
                    f"{name} {statistics.median(times):.1f}" for name, times in samples.items())
                    + f" us; roofline {roofline_us:.1f}; route {route.path}, best {best}")
            del copies, base
            torch.cuda.empty_cache()
    return table


README_ROWS = (1, 8, 16, 32, 64, 128, 256)
BEFORE = ("bitsandbytes", "dequantize + F.linear")  # the paths a 4-bit layer had without the fused kernel
SHOWN = BEFORE + ("fused kernel",)  # the notebooks' contenders


def fused_difference(layer, x):
    """(largest |fused kernel - dequantize + F.linear|, largest |dequantize + F.linear|) over x @ W.T."""
    rows, in_features = x.shape
    out_features = layer.weight.quant_state.shape[0]
    out = torch.empty(rows, out_features, device=x.device, dtype=x.dtype)
    with torch.no_grad():
        fused_call(layer, x, fused_config(rows, in_features, out_features), out)()
        reference = torch.nn.functional.linear(x, kernel.dequantize_nf4(layer)).float()
    return (out.float() - reference).abs().max().item(), reference.abs().max().item()


def wall_clock_us(calls, rounds):
    """name -> median wall-clock microseconds per call over ``rounds`` interleaved rounds, after a
    warm-up call of each (a GPU synchronized around every call)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() and not fastpath.INTERPRET else lambda: None
    samples = {name: [] for name in calls}
    with torch.no_grad():
        for call in calls.values():
            call()
        for _ in range(rounds):
            for name, call in calls.items():
                sync()
                start = time.perf_counter()
                call()
                sync()
                samples[name].append((time.perf_counter() - start) * 1e6)
    return {name: statistics.median(times) for name, times in samples.items()}


def notebook_points(dtype_name, dtype, layer, rows, rounds, rooflines=None, meta=None, log=print):
    """The notebooks' matmul section at one (in, out) layer: (what the times are, one dict per M of
    rows) with each of SHOWN's median microseconds per call, the route ``choose_route`` picks here
    and the fused kernel's largest difference from dequantize + F.linear with the largest |y|.
    With ``rooflines`` (a GPU run): ``run``'s GPU times and the point's roofline. Without (smoke
    mode): wall clock per call, through Triton's interpreter without a GPU, where bitsandbytes'
    kernels (CUDA only) are not timed."""
    in_features, out_features = layer
    device = "cpu" if fastpath.INTERPRET else "cuda"
    if rooflines is not None:
        timer = "GPU time per call, us (CUDA graphs)"
        timed = {(row["rows"], row["implementation"]): row for row in run(
            {dtype_name: dtype}, rounds, rooflines, meta, lambda line: None, layers=[layer], rows=rows)}
    else:
        timer = "wall clock per call, us (smoke mode" + (": Triton's interpreter)" if device == "cpu" else ")")
        shown = [name for name in SHOWN if device == "cuda" or name != "bitsandbytes"]
        if device == "cpu":
            log("bitsandbytes: not timed (its kernels run on CUDA tensors)")
    base = make_layer(in_features, out_features, dtype, device=device)
    points = []
    for m in rows:
        x = torch.randn(m, in_features, device=device, dtype=dtype)
        difference, largest = fused_difference(base, x)
        if rooflines is not None:
            times = {name: timed[m, name]["median_us"] for name in SHOWN}
            times["roofline"] = timed[m, "fused kernel"]["roofline_us"]
        else:
            calls = contenders([base], x, out_features)
            times = wall_clock_us({name: calls[name][0] for name in shown}, rounds)
        points.append(dict(M=m, **times, route=matmul.device_route(None, m, in_features, out_features)[0].path,
                           max_difference=difference, max_y=largest))
    return timer, points


def readme_table(path, dtype="bf16"):
    """The README's matmul table from a matmul.csv: per layer and M, nf4_linear's GPU time, the best
    path before it (bitsandbytes or dequantize + cuBLAS) and how many times faster, the roofline and
    nf4_linear's share of it, and the floor kernel's time."""
    import csv

    with open(path, newline="") as handle:
        found = [row for row in csv.DictReader(handle) if row["dtype"] == dtype]
    time = {(row["shape"], int(row["rows"]), row["implementation"]): float(row["median_us"]) for row in found}
    roofline = {(row["shape"], int(row["rows"])): float(row["roofline_us"]) for row in found}
    route = {(row["shape"], int(row["rows"])): row["route"] for row in found}
    lines = ["| layer (in x out) | M | nf4_linear, us (route) | best before, us | speed-up | roofline, us | "
             "% of roofline | floor (bytes once), us |", "|---|---|---|---|---|---|---|---|"]
    for layer in dict.fromkeys(row["shape"] for row in found):
        for m in README_ROWS:
            ours = time[layer, m, "nf4_linear (routed)"]
            before = min(BEFORE, key=lambda name: time[layer, m, name])
            lines.append(f"| {layer} | {m} | {ours:.1f} ({route[layer, m]}) | {time[layer, m, before]:.1f} "
                         f"({'bitsandbytes' if before == 'bitsandbytes' else 'dequantize'}) | "
                         f"{time[layer, m, before] / ours:.2f}x | {roofline[layer, m]:.1f} | "
                         f"{100 * roofline[layer, m] / ours:.0f} % | {time[layer, m, bench.contenders.MATMUL_FLOOR]:.1f} |")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bf16", choices=[*bench.weights.DTYPES, "all"])
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--layers", default=None, help="e.g. 4096x14336,14336x4096")
    parser.add_argument("--rows", default=None, help="e.g. 1,4,16")
    args = parser.parse_args()
    dtypes = bench.weights.DTYPES if args.dtype == "all" else {args.dtype: bench.weights.DTYPES[args.dtype]}
    layers = [tuple(map(int, s.split("x"))) for s in args.layers.split(",")] if args.layers else LAYERS
    rows = [int(s) for s in args.rows.split(",")] if args.rows else ROWS
    if args.sweep:
        for dtype in dtypes.values():
            sweep(dtype, layers, rows, candidates)


if __name__ == "__main__":
    main()
