"""Section ``compile``: eager (launch plan) against torch.compile in several modes, beside graphs
that are not ours (PyTorch's own ``x * 2``, the floor kernel, Unsloth's fused kernel). Rows
``compile`` (do_bench), ``compile-kernel`` (our kernel's GPU time inside each mode),
``compile-reference`` and ``compile-host`` (host time per call)."""

import copy

import torch

import bench.contenders
import bench.results
import bench.timing
import bench.weights
from nf4_triton import kernel

COMPILE_SHAPES = [(4096, 1024), (14336, 4096)]


def static_weight(packed, state):
    """A copy of a nested weight whose packed bytes and five state tensors are marked static for
    CUDA graphs, as a model's parameters would be (the caller's tensors stay unmarked)."""
    static_packed, static_state = packed.clone(), copy.deepcopy(state)
    for tensor in (static_packed, static_state.absmax, static_state.code, static_state.offset,
                   static_state.state2.absmax, static_state.state2.code):
        torch._dynamo.mark_static_address(tensor)
    return static_packed, static_state


def compiled_modes(packed, state):
    """name -> callable: eager and torch.compile of one dequantize call in several modes. The last
    runs CUDA graphs on a copy of the weight whose tensors are marked static, as a model's would
    be: without the mark, every replay first copies each of the six input tensors into the
    graph's own buffers."""
    modes = {"eager": lambda: kernel.dequantize_nf4(packed, state)}
    for name, options in (("compiled-default", dict()),
                          ("compiled-cpp-wrapper", dict(options={"cpp_wrapper": True})),
                          ("compiled-reduce-overhead", dict(mode="reduce-overhead"))):
        compiled = torch.compile(lambda weight: kernel.dequantize_nf4(weight, state), fullgraph=True, **options)
        modes[name] = lambda compiled=compiled: compiled(packed)
    static_packed, static_state = static_weight(packed, state)
    static = torch.compile(lambda weight: kernel.dequantize_nf4(weight, static_state), fullgraph=True,
                           mode="reduce-overhead")
    modes["compiled-reduce-overhead-static"] = lambda: static(static_packed)
    return modes


def compile_references(packed, state, fused):
    """The same timing for graphs that are not ours, eager and compiled (default mode): PyTorch's
    own one-kernel graph (``x * 2`` on a tensor of the output's size) and Unsloth's fused kernel
    (``fused``, or None without Unsloth). They show how much of a compiled call's cost is the
    graph's, whoever's kernel is inside."""
    x = torch.zeros(tuple(state.shape), dtype=state.dtype, device=packed.device)
    twice = torch.compile(lambda tensor: tensor * 2, fullgraph=True)
    references = {"x*2 eager": lambda: x * 2, "x*2 compiled-default": lambda: twice(x),
                  "floor (no decode) eager": lambda: bench.contenders.expand_floor(packed, state),
                  "floor (no decode) compiled-default": bench.contenders.compiled_floor(packed, state)}
    if fused is not None:
        compiled_fused = torch.compile(lambda weight: fused(weight, state), fullgraph=True)
        references["unsloth-fused eager"] = lambda: fused(packed, state)
        references["unsloth-fused compiled-default"] = lambda: compiled_fused(packed)
    return references


def run(shapes, dtypes, rounds, rooflines, meta, log):
    """Eager (launch plan) against torch.compile, all callables interleaved in each round:
    do_bench medians over the rounds (host cost included when it exceeds the L2 flush, so single
    samples of the default mode at 4096x1024 fp16 ranged from 7.4 to 45.4 us in one run, NOTES.md
    item 23), each callable's host time per call in the same rounds, and the profiler's time of
    our kernel inside each mode."""
    rows = []
    fused = bench.contenders.unsloth_fast_dequantize(log)
    for dtype_name, shape, packed, state in bench.weights.weights(shapes, dtypes):
        expected = kernel.dequantize_nf4(packed, state)
        torch._dynamo.reset()
        modes = compiled_modes(packed, state)
        references = compile_references(packed, state, fused)
        for name, fn in modes.items():
            for _ in range(3):
                assert torch.equal(fn(), expected), name
        for fn in references.values():
            fn()
        samples = {name: [] for name in (*modes, *references)}
        host_samples = {name: [] for name in samples}
        for _ in range(rounds):
            for name, fn in (*modes.items(), *references.items()):
                samples[name].append(bench.timing.do_bench(fn)[0])
                host_samples[name].append(bench.timing.host_time_per_call(fn))
        first = len(rows)
        kernel_ms = bench.timing.gpu_times(modes, only="dequantize_4bit_kernel")
        for name in modes:
            rows.append(bench.results.timing_row(meta, "compile", shape, dtype_name, name,
                                                 bench.timing.summarize(samples[name]), rooflines["do_bench"]))
            rows.append(bench.results.timing_row(meta, "compile-kernel", shape, dtype_name, name,
                                                 (kernel_ms[name],) * 3, rooflines["profiler"]))
        for name in references:
            rows.append(bench.results.timing_row(meta, "compile-reference", shape, dtype_name, name,
                                                 bench.timing.summarize(samples[name]), rooflines["do_bench"]))
        rows += [bench.results.seconds_row(meta, "compile-host", f"{shape[0]}x{shape[1]}", dtype_name, name, times)
                 for name, times in host_samples.items()]
        tags = {"compile-kernel": " (kernel)", "compile-host": " (host)"}
        log(f"compile {dtype_name} {shape}: " + ", ".join(
            f"{r['implementation']} {r['median_us']:.1f} us"
            + tags.get(r["kind"], f" [{r['p20_us']:.1f}..{r['p80_us']:.1f}]") for r in rows[first:]))
    return rows
