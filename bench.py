"""Benchmark: this kernel against bitsandbytes and Unsloth, the copy roofline, a launch sweep.

    python bench.py [--quick] [--dtype fp16|bf16|all] [--out results/] [--rounds N]
                    [--sections kernels,harness,compile,sweep] [--plot FOLDER]

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
"""

import argparse
import copy
import csv
import datetime
import functools
import math
import os
import platform
import statistics
import time

import torch
import triton
import triton.language as tl
from tqdm import tqdm  # text bars: a saved notebook shows their last state; a widget bar needs a live kernel

import fastpath
import kernel

SHAPES = [(4096, 1024), (1024, 4096), (8192, 2048), (2048, 8192), (14336, 4096), (4096, 14336), (28672, 8192)]
QUICK_SHAPES = [(4096, 1024), (8192, 2048), (14336, 4096), (28672, 8192)]
COMPILE_SHAPES = [(4096, 1024), (14336, 4096)]
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
SECTIONS = ("kernels", "harness", "compile", "sweep", "forms", "model")
DEFAULT_SECTIONS = ("kernels", "harness", "compile", "sweep", "forms")  # "model" takes minutes more


def versions():
    found = {"torch": torch.__version__, "triton": triton.__version__}
    for name in ("bitsandbytes", "unsloth"):
        try:
            found[name] = __import__(name).__version__
        except Exception as error:  # optional contenders: missing or failing on import
            found[name] = f"unavailable ({type(error).__name__})"
    return found


def contenders(log=print):
    """name -> fn(packed, state); a missing package drops its contenders with one line."""
    import bitsandbytes.functional as F

    found = {"nf4-triton": kernel.dequantize_nf4, "bitsandbytes": F.dequantize_4bit, **unsloth_functions(log)}
    try:
        from peft.utils.integrations import dequantize_module_weight

        found["peft"] = lambda packed, state: dequantize_module_weight(params4bit_module(packed, state))
    except Exception as error:
        log(f"peft: skipped ({type(error).__name__}: {error})")
    found["floor (no decode)"] = expand_floor
    found["copy (same bytes)"] = same_bytes_copy
    return found


# Measuring instruments among the contenders: they move the same bytes but do not dequantize.
INSTRUMENTS = ("floor (no decode)", "copy (same bytes)")


def params4bit_module(packed, state):
    """A module whose weight is ``packed`` as a bitsandbytes Params4bit, as Linear4bit holds it after
    its move to CUDA (built directly, so that it exists on the CPU too): what PEFT's
    dequantize_module_weight and the challenge's entry point take."""
    import bitsandbytes as bnb

    module = torch.nn.Module()
    module.weight = bnb.nn.Params4bit(packed, requires_grad=False, quant_state=state, blocksize=state.blocksize,
                                      compress_statistics=state.nested, quant_type=state.quant_type,
                                      quant_storage=packed.dtype, bnb_quantized=True)
    return module


@triton.jit
def _expand_floor_kernel(
    packed_ptr,  # uint8 [n_bytes]
    absmax_ptr,  # uint8 [n_bytes / BYTES_PER_ABSMAX]
    code_ptr,  # unused, like the three below: the launch carries our kernel's pointer arguments
    absmax2_ptr,
    code2_ptr,
    offset_ptr,
    out_ptr,  # fp16/bf16/fp32 [2 * n_bytes]
    n_bytes,  # packed bytes
    BYTES_PER_ABSMAX: tl.constexpr,  # packed bytes per absmax byte (blocksize / 2)
    BYTES_PER_PROGRAM: tl.constexpr,  # packed bytes per program
    OUT_HINT: tl.constexpr,  # eviction policy of the output stores
):
    """The dequantization's memory traffic with no decoding: each byte becomes two outputs (its
    nibbles as numbers, plus its block's absmax byte so that the absmax is read as ours reads it),
    with the kernel's tile size and output eviction hint."""
    ROWS: tl.constexpr = BYTES_PER_PROGRAM // BYTES_PER_ABSMAX
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    absmax = tl.load(absmax_ptr + rows, mask=rows * BYTES_PER_ABSMAX < n_bytes, other=0)
    offsets = rows[:, None] * BYTES_PER_ABSMAX + tl.arange(0, BYTES_PER_ABSMAX)[None, :]
    packed = tl.load(packed_ptr + offsets, mask=offsets < n_bytes, other=0) + absmax[:, None]
    values = tl.join((packed >> 4).to(tl.float32), (packed & 0xF).to(tl.float32)).reshape(ROWS, 2 * BYTES_PER_ABSMAX)
    out_offsets = 2 * rows[:, None] * BYTES_PER_ABSMAX + tl.arange(0, 2 * BYTES_PER_ABSMAX)[None, :]
    tl.store(out_ptr + out_offsets, values.to(out_ptr.dtype.element_ty), mask=out_offsets < 2 * n_bytes,
             eviction_policy=OUT_HINT)


def _floor_launch(packed, state):
    """(packed bytes per program, warps, output eviction hint): the tile, warps and store hint
    ``kernel.py`` picks for this weight."""
    launch = kernel.choose_launch(packed, state.dtype, math.prod(state.shape), blocksize=state.blocksize,
                                  blocksize2=state.state2.blocksize, nested=True, fp4=False)
    per_program = max(launch.constexprs["BYTES_PER_PROGRAM"], state.blocksize // 2)
    return per_program, launch.num_warps, "evict_first" if launch.constexprs["STREAM_STORES"] else ""


def expand_floor(packed, state, launch=None):
    """The floor kernel on a weight: the bytes ours reads and writes (absmax included), passed all
    of our kernel's pointer arguments. ``launch``: ``_floor_launch``'s result, if already known."""
    out = torch.empty(tuple(state.shape), dtype=state.dtype, device=packed.device)
    n_bytes = out.numel() // 2
    per_program, num_warps, out_hint = _floor_launch(packed, state) if launch is None else launch
    _expand_floor_kernel[(triton.cdiv(n_bytes, per_program),)](
        packed, state.absmax, state.code, state.state2.absmax, state.state2.code, state.offset, out, n_bytes,
        state.blocksize // 2, per_program, out_hint, num_warps=num_warps)
    return out


def compiled_floor(packed, state):
    """The floor kernel compiled whole in the default mode, the launch configuration worked out
    beforehand: a graph with our six input tensors, our kernel's pointer arguments and our bytes,
    but no validation and no decode."""
    launch = _floor_launch(packed, state)
    compiled = torch.compile(lambda weight: expand_floor(weight, state, launch), fullgraph=True)
    return lambda: compiled(packed)


def same_bytes_copy(packed, state):
    """A device-to-device copy moving as many bytes as the dequantization (half read, half
    written): what the copy roofline reaches at this size, launch and ramp included."""
    half = bytes_moved(tuple(state.shape), state.dtype) // 2
    return torch.empty(half, dtype=torch.uint8, device=packed.device).copy_(_copy_source(half, packed.device))


def _copy_source(n_bytes, device):
    if _COPY_SOURCE.get(device) is None or _COPY_SOURCE[device].numel() < n_bytes:
        _COPY_SOURCE[device] = torch.zeros(n_bytes, dtype=torch.uint8, device=device)
    return _COPY_SOURCE[device][:n_bytes]


_COPY_SOURCE = {}


def make_weight(shape, dtype, seed=0):
    import bitsandbytes.functional as F

    torch.manual_seed(seed)
    weight = torch.randn(shape, device="cuda", dtype=torch.float16)
    packed, state = F.quantize_4bit(weight, blocksize=64, compress_statistics=True, quant_type="nf4")
    state.dtype = dtype
    return packed, state


def weights(shapes, dtypes):
    """(dtype name, shape, packed, state) for every benchmarked weight, made one at a time."""
    for dtype_name, dtype in dtypes.items():
        for shape in shapes:
            yield (dtype_name, shape, *make_weight(shape, dtype))


def bytes_moved(shape, dtype):
    n = shape[0] * shape[1]
    return n // 2 + n // 64 + n * torch.finfo(dtype).bits // 8


def do_bench(fn):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, quantiles=[0.5, 0.2, 0.8])


def copy_roofline():
    """Device-to-device copy bandwidth in GB/s (bytes read + written), 1 GiB each way, timed two
    ways: {"do_bench": ..., "profiler": ...} (3005 and 3019 GB/s in one H100 run). Rows timed by
    do_bench are set against the first, GPU-time rows against the second."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy = lambda: dst.copy_(src)  # noqa: E731
    ms = {"do_bench": statistics.median(do_bench(copy)[0] for _ in range(3)),
          "profiler": gpu_times({"copy": copy}, calls=10)["copy"]}
    return {timer: 2 * src.numel() / value / 1e6 for timer, value in ms.items()}


def timing_row(meta, kind, shape, dtype_name, implementation, times_ms, roofline, extra_peak_bytes=0):
    """One tidy CSV row from (median, p20, p80) kernel times in milliseconds."""
    median, p20, p80 = times_ms
    dtype = DTYPES[dtype_name]
    gbps = bytes_moved(shape, dtype) / median / 1e6
    return dict(meta, kind=kind, shape=f"{shape[0]}x{shape[1]}", dtype=dtype_name, implementation=implementation,
                median_us=median * 1e3, p20_us=p20 * 1e3, p80_us=p80 * 1e3, gbps=gbps,
                pct_roofline=100 * gbps / roofline, extra_peak_bytes=extra_peak_bytes)


def seconds_row(meta, kind, shape, dtype_name, implementation, seconds):
    """One tidy CSV row from samples of wall or host seconds (no bandwidth: not kernel times)."""
    median, p20, p80 = summarize(seconds)
    return dict(meta, kind=kind, shape=shape, dtype=dtype_name, implementation=implementation,
                median_us=median * 1e6, p20_us=p20 * 1e6, p80_us=p80 * 1e6, gbps=0.0, pct_roofline=0.0,
                extra_peak_bytes=0)


def extra_peak_bytes(fn):
    """Peak allocation of one call beyond what it returns (warm: plans made, kernels compiled)."""
    fn()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    return peak - result.untyped_storage().nbytes()


def summarize(times):
    times = sorted(times)
    pick = lambda q: times[min(len(times) - 1, int(q * (len(times) - 1) + 0.5))]  # noqa: E731
    return statistics.median(times), pick(0.2), pick(0.8)


def bench_kernels(shapes, dtypes, rounds, rooflines, meta, log):
    rows = []
    funcs = contenders(log)
    cases = weights(shapes, dtypes)
    for dtype_name, shape, packed, state in tqdm(cases, desc="kernels", total=len(shapes) * len(dtypes)):
        expected = funcs["bitsandbytes"](packed, state)
        for name, fn in funcs.items():
            if name not in INSTRUMENTS:
                assert torch.equal(fn(packed, state), expected), f"{name} is not bit-exact with bitsandbytes"
        callables = {name: (lambda fn=fn: fn(packed, state)) for name, fn in funcs.items()}
        samples = {name: [] for name in funcs}
        gpu_samples = {name: [] for name in funcs}
        for _ in range(rounds):
            for name, call in callables.items():
                samples[name].append(do_bench(call)[0])
            for name, ms in gpu_times(callables).items():
                gpu_samples[name].append(ms)
        event_rows = [timing_row(meta, "kernel", shape, dtype_name, name, summarize(samples[name]),
                                 rooflines["do_bench"], extra_peak_bytes(call)) for name, call in callables.items()]
        gpu_rows = [timing_row(meta, "kernel-gpu", shape, dtype_name, name, summarize(gpu_samples[name]),
                               rooflines["profiler"]) for name in callables]
        for label, new_rows, digits in (("", event_rows, 1), (", GPU time (profiler)", gpu_rows, 2)):
            log(f"{dtype_name} {shape}{label}: " + ", ".join(
                f"{r['implementation']} {r['median_us']:.{digits}f} us ({r['pct_roofline']:.0f} %)" for r in new_rows))
        rows += event_rows + gpu_rows
    return rows


HARNESS_ROUNDS_PER_ROUND = 3  # harness rounds per round of the other sections
HARNESS_OPTIONS = [
    (2, 3333, 2048, 8192, 3407, torch.float16),
    (5, 777, 1024, 4096, 3409, torch.bfloat16),
    (3, 2048, 4096, 14336, 3408, torch.bfloat16),
]


def harness_layers(hd, m, seed, dtype):
    """The challenge's MLP: gate, up (hd -> m) and down (m -> hd) Linear4bit layers on CUDA."""
    import bitsandbytes as bnb
    from transformers import set_seed

    set_seed(seed)
    torch.set_default_dtype(torch.float32)
    layers = {name: bnb.nn.Linear4bit(fan_in, fan_out, bias=None, compute_dtype=dtype, compress_statistics=True,
                                      quant_type="nf4").cuda()
              for name, (fan_in, fan_out) in (("gate", (hd, m)), ("up", (hd, m)), ("down", (m, hd)))}
    for layer in layers.values():
        layer.weight.quant_state.dtype = dtype
    return layers


def unsloth_functions(log=print):
    """Unsloth's fused fast_dequantize and its 2025 two-launch path, by contender name; a missing
    one is left out with one line saying why."""
    try:
        from unsloth.kernels import utils as unsloth_utils
    except Exception as error:  # not installed, or no GPU for it
        log(f"unsloth: skipped ({type(error).__name__}: {error})")
        return {}
    found = {"unsloth-fused": unsloth_utils.fast_dequantize}
    if hasattr(unsloth_utils, "_fast_dequantize_ctypes"):
        found["unsloth-2025"] = unsloth_utils._fast_dequantize_ctypes
    else:
        log("unsloth: no _fast_dequantize_ctypes, the 2025 path is skipped")
    return found


def unsloth_fast_dequantize(log=print):
    """Unsloth's fast_dequantize, or None (with one line saying why)."""
    return unsloth_functions(log).get("unsloth-fused")


def challenge_check(fx, option, fast_dequantize=None):
    """The harness's warm-up checks for one option (challenge.md), twice; raises on a mismatch.
    Returns the largest |output| (finite when the forward is sane)."""
    bsz, qlen, hd, m, seed, dtype = option
    layers = harness_layers(hd, m, seed, dtype)
    X = torch.randn((bsz, qlen, hd), device="cuda", dtype=dtype)
    silu = torch.nn.functional.silu
    for _ in range(2):
        expected = layers["down"](silu(layers["gate"](X)) * layers["up"](X))
        up = X @ fx(layers["up"]).t()
        gate = X @ fx(layers["gate"]).t()
        got = (silu(gate) * up) @ fx(layers["down"]).t()
        torch.testing.assert_close(got, expected, check_stride=True)
        assert got.dtype == dtype
        for layer in layers.values():
            state = layer.weight.quant_state
            assert layer.weight.dtype == torch.uint8 and state.absmax.dtype == torch.uint8
            assert state.code.dtype == torch.float32 and state.offset.dtype == torch.float32
            assert state.blocksize == 64 and state.state2.blocksize == 256
            assert state.state2.absmax.dtype == torch.float32 and state.state2.code.dtype == torch.float32
            if fast_dequantize is not None:
                assert torch.equal(fx(layer).t(), fast_dequantize(layer.weight, state).t())
    return got.float().abs().max().item()


def harness_seconds(fx, options_layers, iterations=1000):
    """The challenge's timing: wall clock over 1000 x (up, sync, gate, sync, down, sync), summed."""
    total = 0.0
    for layers in options_layers:
        up, gate, down = layers["up"], layers["gate"], layers["down"]
        torch.cuda.synchronize()
        start = time.time()
        for _ in range(iterations):
            fx(up)
            torch.cuda.synchronize()
            fx(gate)
            torch.cuda.synchronize()
            fx(down)
            torch.cuda.synchronize()
        total += time.time() - start
    return total


@triton.jit
def _empty_kernel(
    packed_ptr,  # the packed weight's place in a plan's launch, unread
    out_ptr,  # the freshly allocated output, left untouched
):
    pass


def harness_floor():
    """An fx for the harness that allocates the output and launches an empty kernel the way the
    launch plans do: the host path every dequantizer pays, with no kernel time."""
    first_out = torch.empty(1, device="cuda")
    compiled = _empty_kernel[(1,)](first_out, first_out)
    pointer = first_out.data_ptr()
    launch = fastpath.kernel_launcher(compiled, 1, (), (), torch._C._cuda_getCurrentRawStream(first_out.device.index),
                                     pointer, pointer)

    def fx(layer):
        state = layer.weight.quant_state
        out = torch.empty(size=state.shape, dtype=state.dtype, device="cuda")  # the cheapest form (kernel.py)
        launch(torch._C._cuda_getCurrentRawStream(out.device.index), pointer, out.data_ptr())
        return out

    return fx


HARNESS_FLOOR = "floor (alloc + empty launch)"


def bench_harness(rounds, meta, log):
    """The challenge harness in interleaved rounds; rows hold seconds, ratios are printed. The
    floor instrument runs in the same rounds: ours minus the floor is our kernel time plus
    whatever host time we spend beyond the floor."""
    funcs = {"nf4-triton": kernel.your_dequantize_nf4}
    for name, fn in unsloth_functions(log).items():
        funcs[name] = lambda layer, fn=fn: fn(layer.weight, layer.weight.quant_state)
    funcs[HARNESS_FLOOR] = harness_floor()
    options_layers = [harness_layers(hd, m, seed, dtype) for _, _, hd, m, seed, dtype in HARNESS_OPTIONS]
    for fx in funcs.values():
        harness_seconds(fx, options_layers, iterations=20)  # warm-up: compile, plans, clocks
    samples = {name: [] for name in funcs}
    for round_index in tqdm(range(rounds), desc="harness rounds"):
        for name in list(funcs) if round_index % 2 == 0 else reversed(funcs):  # no contender always first
            samples[name].append(harness_seconds(funcs[name], options_layers))
        log(f"harness round {round_index + 1}: " + ", ".join(f"{n} {s[-1]:.3f} s" for n, s in samples.items()))
    rows = [seconds_row(meta, "harness", "3 options", "fp16+bf16", name, times) for name, times in samples.items()]
    ours = statistics.median(samples["nf4-triton"])
    log(f"harness: ours {ours:.3f} s, {HARNESS_FLOOR} {statistics.median(samples[HARNESS_FLOOR]):.3f} s")
    for name, times in samples.items():
        if name not in ("nf4-triton", HARNESS_FLOOR):
            ratios = sorted(t / o for t, o in zip(times, samples["nf4-triton"]))
            log(f"harness speedup vs {name}: median of medians {statistics.median(times) / ours:.2f}x, "
                     f"per-round ratios {ratios[0]:.2f}..{ratios[-1]:.2f}")
    return rows


def gpu_times(fns, calls=30, only=None):
    """Per-call GPU time of each callable, from the profiler's activity records (CUPTI), every call
    after do_bench's L2 flush: the span from the start of the first kernel or copy a call runs to
    the end of its last, or with ``only`` the summed durations of the kernels whose names contain
    it. Unlike do_bench's CUDA events it leaves out the GPU front end's time between an event and
    the kernel, whose samples fall on two levels 0.65 us apart at 8192x2048 on the H100 (NOTES.md,
    item 30). All callables share one profiled session. Returns name -> median in milliseconds."""
    from torch.profiler import ProfilerActivity, profile

    # Without CUPTI's teardown at the end of a session, every later launch in the process pays
    # for it: 18.4 against 23.1 us of host time per dequantize call on the H100 host (NOTES.md,
    # item 30), which would leak into the harness and compile timings.
    os.environ.setdefault("TEARDOWN_CUPTI", "1")
    driver = triton.runtime.driver.active
    cache = driver.get_empty_cache_for_benchmark()
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    for _ in range(3):  # a session re-initialising CUPTI after a teardown came back empty once
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for fn in fns.values():
                for _ in range(calls):
                    driver.clear_cache(cache)
                    fn()
            torch.cuda.synchronize()
        # The teardown runs on a thread that the next CUDA call starts; a session begun before it
        # is done (two sessions back to back) left the process hanging at exit on the H100 host.
        torch.cuda.synchronize()
        time.sleep(0.05)
        torch.cuda.synchronize()
        records = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                         key=lambda e: e.time_range.start)
        per_call = []
        for record in records:
            if record.name == records[0].name:  # the session opens with a flush
                per_call.append([])
            elif per_call:
                per_call[-1].append(record)
        if per_call:
            break
    if len(per_call) != calls * len(fns) or not all(per_call):
        raise RuntimeError(f"gpu_times: expected {calls * len(fns)} flushed calls with GPU work, found "
                           f"{sum(map(bool, per_call))} of {len(per_call)}")
    if only is None:
        spans = [max(e.time_range.end for e in call) - call[0].time_range.start for call in per_call]
    else:
        spans = [sum(e.time_range.elapsed_us() for e in call if only in e.name) for call in per_call]
    return {name: statistics.median(spans[index * calls:(index + 1) * calls]) / 1e3
            for index, name in enumerate(fns)}


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
                  "floor (no decode) eager": lambda: expand_floor(packed, state),
                  "floor (no decode) compiled-default": compiled_floor(packed, state)}
    if fused is not None:
        compiled_fused = torch.compile(lambda weight: fused(weight, state), fullgraph=True)
        references["unsloth-fused eager"] = lambda: fused(packed, state)
        references["unsloth-fused compiled-default"] = lambda: compiled_fused(packed)
    return references


def bench_compile(shapes, dtypes, rounds, rooflines, meta, log):
    """Eager (launch plan) against torch.compile, all callables interleaved in each round:
    do_bench medians over the rounds (host cost included when it exceeds the L2 flush, so single
    samples of the default mode at 4096x1024 fp16 ranged from 7.4 to 45.4 us in one run, NOTES.md
    item 23), each callable's host time per call in the same rounds, and the profiler's time of
    our kernel inside each mode."""
    rows = []
    fused = unsloth_fast_dequantize(log)
    for dtype_name, shape, packed, state in weights(shapes, dtypes):
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
                samples[name].append(do_bench(fn)[0])
                host_samples[name].append(host_time_per_call(fn))
        first = len(rows)
        kernel_ms = gpu_times(modes, only="dequantize_4bit_kernel")
        for name in modes:
            rows.append(timing_row(meta, "compile", shape, dtype_name, name, summarize(samples[name]),
                                   rooflines["do_bench"]))
            rows.append(timing_row(meta, "compile-kernel", shape, dtype_name, name, (kernel_ms[name],) * 3,
                                   rooflines["profiler"]))
        for name in references:
            rows.append(timing_row(meta, "compile-reference", shape, dtype_name, name, summarize(samples[name]),
                                   rooflines["do_bench"]))
        rows += [seconds_row(meta, "compile-host", f"{shape[0]}x{shape[1]}", dtype_name, name, times)
                 for name, times in host_samples.items()]
        tags = {"compile-kernel": " (kernel)", "compile-host": " (host)"}
        log(f"compile {dtype_name} {shape}: " + ", ".join(
            f"{r['implementation']} {r['median_us']:.1f} us"
            + tags.get(r["kind"], f" [{r['p20_us']:.1f}..{r['p80_us']:.1f}]") for r in rows[first:]))
    return rows


FORMS_SHAPE = (2048, 5632)  # out x in: a projection of the small end-to-end model


def call_forms(layer, device=None):
    """Every documented way to dequantize a Linear4bit, and bitsandbytes' own, by name; with
    ``device``, the same calls made while that device is current."""
    import bitsandbytes.functional as F

    weight = layer.weight
    forms = {
        "dequantize_nf4(layer)": lambda: kernel.dequantize_nf4(layer),
        "dequantize_nf4(params4bit)": lambda: kernel.dequantize_nf4(layer.weight),
        "dequantize_nf4(params4bit, state)": lambda: kernel.dequantize_nf4(layer.weight, weight.quant_state),
        "dequantize_nf4(packed, state)": lambda: kernel.dequantize_nf4(weight.data, weight.quant_state),
        "your_dequantize_nf4(layer)": lambda: kernel.your_dequantize_nf4(layer),
        "bitsandbytes dequantize_4bit(packed, state)": lambda: F.dequantize_4bit(weight.data, weight.quant_state),
    }
    if device is None:
        return forms

    def on(fn):
        def call():
            with torch.cuda.device(device):
                return fn()
        return call

    return {f"{name} [cuda:{device} current]": on(fn) for name, fn in forms.items()}


def bench_forms(rounds, meta, log, calls=2000):
    """Host time per call of each call form, issued back to back (the GPU's queue never drains:
    this is the time a model's forward pays per layer on the host), rounds interleaved."""
    import bitsandbytes as bnb

    rows = []
    for dtype_name, dtype in DTYPES.items():
        torch.manual_seed(0)
        layer = bnb.nn.Linear4bit(FORMS_SHAPE[1], FORMS_SHAPE[0], bias=False, compute_dtype=dtype,
                                  quant_type="nf4").cuda()
        layer.weight.quant_state.dtype = dtype
        forms = call_forms(layer)
        if torch.cuda.device_count() > 1:
            forms.update(call_forms(layer, device=1))
        expected = bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state)
        for name, fn in forms.items():
            if not torch.equal(fn(), expected):
                raise AssertionError(f"forms: {name} is not bit-exact")
        samples = {name: [] for name in forms}
        for round_index in range(rounds):
            for name in list(forms) if round_index % 2 == 0 else reversed(forms):
                samples[name].append(host_time_per_call(forms[name], calls))
        shape = f"{FORMS_SHAPE[0]}x{FORMS_SHAPE[1]}"
        rows += [seconds_row(meta, "forms", shape, dtype_name, name, times) for name, times in samples.items()]
        log(f"forms {dtype_name} {shape}, host us per call: " + ", ".join(
            f"{name} {statistics.median(times) * 1e6:.1f}" for name, times in samples.items()))
    return rows


def host_time_per_call(fn, calls=300):
    """Host seconds per call of ``fn``, its calls issued back to back without waiting for the GPU:
    once this exceeds what do_bench's L2 flush keeps the GPU busy for, do_bench times the host."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls


# Bytes per program x warps with everything on, with the codebooks in global memory and (from
# Triton 3.6) in shared memory; then, at 4 warps, one thing changed at a time: the inline PTX off,
# the eviction hints off, the int32 word loads off (loads=auto takes words on these shapes).
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


def bench_sweep(shapes, dtypes, rooflines, meta, log):
    """Every SWEEP_CONFIGS entry on each weight (launch plans: no validation in the timing), one
    do_bench sample each, and each configuration's GPU time per call (profiler, 30 calls)."""
    rows = []
    for dtype_name, shape, packed, state in tqdm(weights(shapes, dtypes), desc="sweep", total=len(shapes) * len(dtypes)):
        expected = kernel.dequantize_nf4(packed, state)
        launches = {config_label(config): functools.partial(kernel.build_plan(packed, state, **config).launch, packed)
                    for config in SWEEP_CONFIGS}
        for label, fn in launches.items():
            assert torch.equal(fn(), expected), label
            rows.append(timing_row(meta, "sweep", shape, dtype_name, label, do_bench(fn), rooflines["do_bench"]))
        gpu_rows = [timing_row(meta, "sweep-gpu", shape, dtype_name, label, (ms,) * 3, rooflines["profiler"])
                    for label, ms in gpu_times(launches).items()]
        rows += gpu_rows
        best = min(gpu_rows, key=lambda r: r["median_us"])
        log(f"sweep {dtype_name} {shape}: best by GPU time {best['implementation']} {best['median_us']:.2f} us")
    return rows


def plot(folder):
    """Charts from the CSVs in one results folder: kernel % of copy roofline per shape, and the
    launch sweep (time against bytes per program, a line per num_warps / asm family)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    written = []
    bench_csv = os.path.join(folder, "bench.csv")
    frame = pd.read_csv(bench_csv) if os.path.exists(bench_csv) else pd.DataFrame({"kind": []})
    kernels = frame[frame["kind"].isin(["kernel", "kernel-gpu"])]
    if len(kernels):
        meta = frame.iloc[0]
        groups = list(kernels.groupby(["kind", "dtype"]))
        n_dtypes = kernels["dtype"].nunique()
        fig, axes = plt.subplots(len(groups) // n_dtypes, n_dtypes, figsize=(12, 4.5 * len(groups) // n_dtypes),
                                 squeeze=False)
        for ax, ((kind, dtype), rows) in zip(axes.flat, groups):
            table = rows.pivot(index="shape", columns="implementation", values="pct_roofline")
            table = table.loc[sorted(table.index, key=lambda s: int(s.split("x")[0]) * int(s.split("x")[1]))]
            table.plot.bar(ax=ax, rot=30)
            ax.axhline(100, color="black", linewidth=0.8, linestyle="--")
            timing = "do_bench" if kind == "kernel" else "GPU time, profiler"
            ax.set_title(f"{dtype}: % of device copy bandwidth ({timing})")
            ax.set_ylabel("% of copy roofline")
            ax.get_legend().remove()  # one legend below the panels: inside one it covers the small shapes' bars
        title = (f"{meta['gpu']} | torch {meta['torch_version']} | triton {meta['triton_version']} | "
                 f"bnb {meta['bitsandbytes_version']} | unsloth {meta['unsloth_version']}")
        written.append(_save_with_legend_below(plt, fig, axes, os.path.join(folder, "kernel_roofline.png"), title,
                                               ncol=None, fontsize=9, bottom=0.04, dpi=110))
    sweep_csv = os.path.join(folder, "sweep.csv")
    if os.path.exists(sweep_csv):
        frame = pd.read_csv(sweep_csv)
        kind = "sweep-gpu" if (frame["kind"] == "sweep-gpu").any() else "sweep"
        frame = frame[frame["kind"] == kind].copy()
        config = frame["implementation"].str.extract(r"bpp=(\d+) (.*)")
        frame["bytes_per_program"] = config[0].astype(int)
        frame["family"] = config[1]
        groups = list(frame.groupby(["shape", "dtype"], sort=False))
        fig, axes = plt.subplots(2, (len(groups) + 1) // 2, figsize=(15, 9), squeeze=False)
        for ax, ((shape, dtype), rows) in zip(axes.flat, groups):
            best = rows["median_us"].min()
            top = best * 1.3  # the close configurations; the slower ones are marked on the top edge
            for family, line in rows.groupby("family"):
                line = line.sort_values("bytes_per_program")
                (drawn,) = ax.plot(line["bytes_per_program"], line["median_us"], marker="o", label=family)
                above = line[line["median_us"] > top]
                ax.plot(above["bytes_per_program"], [top] * len(above), marker="^", markersize=9, linestyle="none",
                        color=drawn.get_color(), clip_on=False)
            ax.set_ylim(best * 0.98, top)
            ax.set_xscale("log", base=2)
            clipped = int((rows["median_us"] > top).sum())
            ax.set_title(f"{shape} {dtype}: best {best:.2f} us\n{clipped} points above the top (\u25b2)", fontsize=10, pad=8)
            ax.set_xlabel("packed bytes per program")
            ax.set_ylabel("GPU time per call, us (profiler)" if kind == "sweep-gpu" else "us (do_bench, L2 flushed)")
        title = (f"Launch sweep on {frame.iloc[0]['gpu']} (triton {frame.iloc[0]['triton_version']}); "
                 "y axis up to 1.3x each shape's best, \u25b2 on the top edge: a point above it")
        written.append(_save_with_legend_below(plt, fig, axes, os.path.join(folder, "sweep.png"), title, ncol=3,
                                               fontsize=10, bottom=0.08, dpi=100))
    model_csv = os.path.join(folder, "model.csv")
    if os.path.exists(model_csv):
        written.append(plot_model(pd.read_csv(model_csv), os.path.join(folder, "model.png"), plt))
    return written


def _save_with_legend_below(plt, fig, axes, path, title, *, ncol, fontsize, bottom, dpi):
    """One legend for all panels below them (``ncol`` None: one row), the title, the file; returns its path."""
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=ncol or len(labels), fontsize=8)
    fig.suptitle(title, fontsize=fontsize)
    fig.tight_layout(rect=(0, bottom, 1, 1))
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def plot_model(frame, path, plt):
    """End to end: time per prefill and per QLoRA step, each contender over bitsandbytes' own
    (a bar per contender, a panel per model and dtype)."""
    frame = frame[frame["kind"] != "crossover"].copy()
    frame["case"] = frame["kind"].str.replace("qlora-step-checkpointed", "step+ckpt").str.replace(
        "qlora-step", "step") + " " + frame["tokens"]
    groups = list(frame.groupby(["model", "dtype"], sort=False))
    fig, axes = plt.subplots(1, len(groups), figsize=(4.5 * len(groups), 4.5), squeeze=False)
    for ax, ((model, dtype), rows) in zip(axes.flat, groups):
        table = rows.pivot(index="case", columns="implementation", values="median_ms")
        table = table.loc[list(dict.fromkeys(rows["case"]))]
        (table["bitsandbytes"].to_numpy()[:, None] / table).plot.bar(ax=ax, rot=30)
        ax.axhline(1, color="black", linewidth=0.8, linestyle="--")
        ax.set_title(f"{model} {dtype}", fontsize=9)
        ax.set_ylabel("speed over bitsandbytes' Linear4bit (x)")
        ax.get_legend().remove()  # one legend below the panels: inside one it covered the tallest bars
    meta = frame.iloc[0]
    title = (f"Llama-style model, 4-bit NF4 (hidden x intermediate x layers) | {meta['gpu']} | torch "
             f"{meta['torch_version']} | triton {meta['triton_version']} | bnb {meta['bitsandbytes_version']} | "
             f"unsloth {meta['unsloth_version']}")
    return _save_with_legend_below(plt, fig, axes, path, title, ncol=None, fontsize=8, bottom=0.07, dpi=100)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="three shapes, fewer rounds")
    parser.add_argument("--dtype", choices=["fp16", "bf16", "all"], default="all")
    parser.add_argument("--out", default="results", help="folder for CSVs (a per-GPU subfolder is made)")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--sections", default=",".join(DEFAULT_SECTIONS),
                        help=f"comma-separated subset of {','.join(SECTIONS)} (default: all but model)")
    parser.add_argument("--plot", metavar="FOLDER", help="only draw the charts of a results folder")
    args = parser.parse_args()
    sections = args.sections.split(",")
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {','.join(SECTIONS)}")
    if args.plot:
        print("\n".join(plot(args.plot)))
        return

    if not torch.cuda.is_available():
        print("No CUDA GPU: nothing to time. Running a small correctness demo through Triton's interpreter.")
        import bitsandbytes.functional as F

        quiet_bitsandbytes_cpu_notice()
        weight = torch.randn(24, 320, generator=torch.Generator().manual_seed(0))
        packed, state = F.quantize_4bit(weight, blocksize=64, compress_statistics=True, quant_type="nf4")
        state.dtype = torch.bfloat16
        ours, theirs = kernel.dequantize_nf4(packed, state), F.dequantize_4bit(packed, state)
        print("Checked: a 24x320 weight quantized by bitsandbytes (NF4, double-quantized absmax), dequantized "
              "to bf16 by the kernel on the CPU against bitsandbytes' own CPU dequantization.")
        print("bit-exact with bitsandbytes:", torch.equal(ours.view(torch.int16), theirs.view(torch.int16)))
        print("Next: `python -m pytest -q tests` runs the CPU test suite (GPU-only tests show as skipped, `s`); "
              "on a CUDA GPU, `python bench.py` times everything and writes results/<gpu>/.")
        return

    dtypes = DTYPES if args.dtype == "all" else {args.dtype: DTYPES[args.dtype]}
    shapes = QUICK_SHAPES if args.quick else SHAPES
    rounds = args.rounds or (3 if args.quick else 5)
    gpu = torch.cuda.get_device_name()
    meta = run_metadata()
    print(meta)
    rooflines = copy_roofline()
    print("device-to-device copy: " + ", ".join(f"{gbps:.0f} GB/s ({timer})" for timer, gbps in rooflines.items()))
    rows = roofline_rows(meta, rooflines)
    if "kernels" in sections:
        rows += bench_kernels(shapes, dtypes, rounds, rooflines, meta, tqdm.write)
    if "harness" in sections:
        # A harness round takes about 2 s on the H100 host, and its per-round ratio against Unsloth
        # fused spanned 1.20 to 1.66 over 7 rounds of one run (NOTES.md, item 50): three times the rounds.
        rows += bench_harness(HARNESS_ROUNDS_PER_ROUND * rounds, meta, tqdm.write)
    if "compile" in sections:
        rows += bench_compile(COMPILE_SHAPES, dtypes, rounds, rooflines, meta, tqdm.write)
    if "sweep" in sections:
        rows += bench_sweep(QUICK_SHAPES, dtypes, rooflines, meta, tqdm.write)
    if "forms" in sections:
        rows += bench_forms(rounds, meta, tqdm.write)
    if "model" in sections:
        import modelbench

        sizes = list(modelbench.SIZES)[:1] if args.quick else list(modelbench.SIZES)
        rows += modelbench.bench_models(sizes, dtypes, rounds, meta, tqdm.write)

    folder = write_results(rows, os.path.join(args.out, gpu_slug(gpu)))
    print("wrote", ", ".join(plot(folder)), "and the CSVs in", folder)


def quiet_bitsandbytes_cpu_notice():
    """bitsandbytes warns at import, on CPUs with AVX512-BF16, that its optional CPU matmul
    package ("kernels") is missing. Nothing here uses it: the warning is silenced."""
    import logging

    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


def gpu_slug(name):
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")


def run_metadata():
    """GPU name, timestamp and versions: the first columns of every CSV row."""
    return dict(gpu=torch.cuda.get_device_name(),
                timestamp=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                python=platform.python_version(), **{f"{k}_version": v for k, v in versions().items()})


def roofline_rows(meta, rooflines):
    return [dict(meta, kind="roofline", shape="", dtype="", implementation=f"copy ({timer})", median_us=0.0,
                 p20_us=0.0, p80_us=0.0, gbps=gbps, pct_roofline=100.0, extra_peak_bytes=0)
            for timer, gbps in rooflines.items()]


def write_results(rows, folder):
    """bench.csv (roofline, kernels by do_bench and by the profiler, harness), forms.csv, model.csv,
    sweep.csv and compile.csv, each only if it has rows."""
    os.makedirs(folder, exist_ok=True)
    for name, kinds in (("bench.csv", ("roofline", "kernel", "kernel-gpu", "harness")),
                        ("forms.csv", ("forms",)),
                        ("model.csv", ("crossover", "prefill", "qlora-step", "qlora-step-checkpointed")),
                        ("sweep.csv", ("roofline", "sweep", "sweep-gpu")),
                        ("compile.csv", ("roofline", "compile", "compile-kernel", "compile-reference",
                                         "compile-host"))):
        selected = [row for row in rows if row["kind"] in kinds]
        if any(row["kind"] != "roofline" for row in selected):
            with open(os.path.join(folder, name), "w", newline="") as handle:
                columns = list(dict.fromkeys(key for row in selected for key in row))  # sections add columns
                writer = csv.DictWriter(handle, fieldnames=columns, restval="")
                writer.writeheader()
                writer.writerows(selected)
    return folder


if __name__ == "__main__":
    main()
