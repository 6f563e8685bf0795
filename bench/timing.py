"""How the benchmarks time a call: ``do_bench`` medians, GPU time per call from the profiler, host
time per call, peak memory beyond the result, the copy roofline, and medians with p20/p80 over
rounds. Every section, the model benchmark and the notebooks time through these.
"""

import os
import statistics
import time

import torch
import triton


def do_bench(fn):
    """(median, p20, p80) milliseconds of ``fn`` by ``triton.testing.do_bench``, the L2 flushed before each call."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, quantiles=[0.5, 0.2, 0.8])


def summarize(times):
    """(median, p20, p80) of samples."""
    times = sorted(times)
    pick = lambda q: times[min(len(times) - 1, int(q * (len(times) - 1) + 0.5))]  # noqa: E731
    return statistics.median(times), pick(0.2), pick(0.8)


def turned(names, round_index):
    """The contenders in the order of this round: each starts a round in turn, so over len(names)
    rounds each takes every place in a round once."""
    shift = round_index % len(names)
    return names[shift:] + names[:shift]


def cuda_records(run):
    """The profiler's records (CUPTI) of the GPU kernels and copies that ``run()`` issues, in order of
    their start; the session is over, and CUPTI torn down, when this returns."""
    from torch.profiler import ProfilerActivity, profile

    # Without CUPTI's teardown at the end of a session, every later launch in the process pays
    # for it: 18.4 against 23.1 us of host time per dequantize call on the H100 host (NOTES.md,
    # item 30), which would leak into the harness and compile timings.
    os.environ.setdefault("TEARDOWN_CUPTI", "1")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    # The teardown runs on a thread that the next CUDA call starts; a session begun before it
    # is done (two sessions back to back) left the process hanging at exit on the H100 host.
    torch.cuda.synchronize()
    time.sleep(0.05)
    torch.cuda.synchronize()
    return sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                  key=lambda e: e.time_range.start)


def gpu_times(fns, calls=30, only=None):
    """Per-call GPU time of each callable, from the profiler's activity records (CUPTI), every call
    after do_bench's L2 flush: the span from the start of the first kernel or copy a call runs to
    the end of its last, or with ``only`` the summed durations of the kernels whose names contain
    it. Unlike do_bench's CUDA events it leaves out the GPU front end's time between an event and
    the kernel, whose samples fall on two levels 0.65 us apart at 8192x2048 on the H100 (NOTES.md,
    item 30). All callables share one profiled session. Returns name -> median in milliseconds."""
    driver = triton.runtime.driver.active
    cache = driver.get_empty_cache_for_benchmark()
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()

    def flushed_calls():
        for fn in fns.values():
            for _ in range(calls):
                driver.clear_cache(cache)
                fn()

    for _ in range(3):  # a session re-initialising CUPTI after a teardown came back empty once
        records = cuda_records(flushed_calls)
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
