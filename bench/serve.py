"""Serving-shaped, GPU-bound end to end: a Llama model with Llama-3-8B's layer sizes in 4-bit NF4,
its Linear4bit layers computed by bitsandbytes, by the drop-in (with and without the fused
matmul) and by Unsloth's Linear4bit override, each step replayed from a CUDA graph.

    python bench/serve.py [--dtype bf16|fp16] [--layers 8] [--rounds 3] [--out results] [--model DIR]
                         [--sections decode,prefill,share,floor,compiled,merged,train,curves] [--batches 1,8,32,64]

Built as users load it: random weights saved locally, loaded through transformers'
BitsAndBytesConfig (NF4, double quantization). Per contender, rounds interleaved (the order turns
each round), medians with p20/p80 over rounds:
- decode: a static KV cache, a 128-token prompt, then 127 greedy steps, each one replay of a graph
  that holds the whole step (the next token and its position are updated inside the graph); batch
  1, 8, 32, 64; the tokens of the first round are the generation compared across contenders;
- prefill 1x128, 1x512, 8x512, 1x2048 (no cache, logits of the last position), one graph each;
- a QLoRA step (PEFT LoRA r=16 on every linear) at 4x1024, without and with gradient checkpointing
  (``bench.model.bench_train``), and loss curves over 50 steps from the same LoRA start;
- agreement: logits of the prompt's last position and of the first decode step (every contender
  fed the same token) against bitsandbytes and against an fp32 reference (each linear
  ``F.linear(x.float(), W.float())`` rounded once), greedy tokens against bitsandbytes';
- the share of the GPU's kernel time spent in the 4-bit linears (profiler, eager step);
- floor: decode again beside ``floor (bytes once)``, every 4-bit linear replaced by a kernel that only
  reads its packed codes and absmax once and writes zeros: what reading the bytes alone, one launch a
  linear, allows this model (its tokens are not a generation);
- compiled: the floor section's decode with every decoder layer compiled by ``torch.compile``
  (Inductor, ``fullgraph=True`` where it traces; a graph a layer, as the static cache is indexed by
  the layer's number) before the capture, so the norms, rotary embedding, residuals and activation
  fuse as a compiled server runs them;
- merged: decode, under CUDA graphs and compiled, then prefill, beside ``nf4-triton (merged)``: ``dropin.enable(model,
  merge=True)``, q|k|v and gate|up one launch each (not in the default sections' other contenders).
A contender whose step cannot be captured is timed eager, and its rows say so.
"""

import argparse
import contextlib
import functools
import os
import time
import traceback
import types

import torch
import torch.nn.functional as F

import bench.contenders
import bench.model
import bench.results
import bench.timing
from nf4_triton import dropin, matmul, quantstate

SIZE = "4096x14336x2"  # bench.model.SIZES: Llama-3-8B's hidden, intermediate and attention sizes
LAYERS = 8
PROMPT = 128
NEW_TOKENS = 128
DECODE_BATCHES = (1, 8, 32, 64)
PREFILL_TOKENS = ((1, 128), (1, 512), (8, 512), (1, 2048))
TRAIN_TOKENS = (4, 1024)
CURVE_STEPS = 50
CURVE_TOKENS = (2, 512)
CONTENDERS = ("bitsandbytes", "nf4-triton", "nf4-triton (no fused matmul)", "unsloth")
MERGED = "nf4-triton (merged)"  # dropin.enable(model, merge=True): q|k|v and gate|up one launch each
TRAINING = ("bitsandbytes", "nf4-triton", "unsloth")  # the fused matmul serves no-grad calls only
REFERENCE = "fp32 reference"
FLOOR = bench.contenders.MATMUL_FLOOR
# "train" adds LoRA: the inference sections first
SECTIONS = ("decode", "prefill", "share", "floor", "compiled", "merged", "train", "curves")


# --------------------------------------------------------------------------------------------
# Contenders
# --------------------------------------------------------------------------------------------
def unsloth_override():
    """Unsloth's (install, uninstall) of its Linear4bit override, or None with the reason. From
    bitsandbytes 0.50 Unsloth installs it by default only on sm_100 / sm_120; it is forced on here."""
    os.environ.setdefault("UNSLOTH_BNB_NF4_LINEAR", "1")  # read when Unsloth is first imported
    try:
        from unsloth.kernels import bnb_override
    except Exception as error:
        return None, f"{type(error).__name__}: {error}"
    if not bnb_override.install_bnb_nf4_override():
        return None, "install_bnb_nf4_override() declined"
    bnb_override.uninstall_bnb_nf4_override()
    return (bnb_override.install_bnb_nf4_override, bnb_override.uninstall_bnb_nf4_override), ""


def _reference_forward(module, x):
    """The layer in fp32: W decoded to fp32, ``F.linear`` of fp32 operands, one rounding to x's dtype."""
    packed, state = quantstate.resolve(module.weight, module.weight.quant_state)
    bias = None if module.bias is None else module.bias.float()
    return F.linear(x.float(), matmul.decoded_weight(packed, state, torch.float32), bias).to(x.dtype)


def _floor_forward(module, x):
    """The layer's bytes read once and a zero output (``bench.contenders.bytes_once``): no matmul."""
    packed, state = quantstate.resolve(module.weight, module.weight.quant_state)
    if torch.compiler.is_compiling():
        return _floor_op(x, packed, state.absmax, state.shape[0], state.blocksize, state.nested)
    return bench.contenders.bytes_once(x, packed, state)


@torch.library.custom_op("nf4_triton_bench::floor", mutates_args=())
def _floor_op(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, out_features: int, blocksize: int,
              nested: bool) -> torch.Tensor:
    """``bytes_once`` opaque to Inductor, which traced into the kernel and dropped it (NOTES item 86)."""
    state = types.SimpleNamespace(shape=(out_features, x.shape[-1]), absmax=absmax, blocksize=blocksize, nested=nested)
    return bench.contenders.bytes_once(x, packed, state)


@_floor_op.register_fake
def _floor_op_fake(x, packed, absmax, out_features, blocksize, nested):
    return x.new_empty(*x.shape[:-1], out_features)


LAYER_FORWARDS = {REFERENCE: _reference_forward, FLOOR: _floor_forward}  # contenders that replace each layer's forward


class Router:
    """Routes a model's Linear4bit layers to one contender at a time."""

    def __init__(self, model, unsloth):
        self.model = model
        self.unsloth = unsloth
        self.layers = bench.model.linear4bit_layers(model)

    def __call__(self, model, name):
        dropin.disable(self.model)
        if self.unsloth:
            self.unsloth[1]()
        for layer in self.layers:
            layer.__dict__.pop("forward", None)
        if name == "nf4-triton":
            dropin.enable(self.model)
        elif name == MERGED:
            dropin.enable(self.model, merge=True)
        elif name == "nf4-triton (no fused matmul)":
            dropin.enable(self.model, fused=False)
        elif name == "unsloth":
            self.unsloth[0]()
        elif name in LAYER_FORWARDS:
            for layer in self.layers:
                layer.forward = functools.partial(LAYER_FORWARDS[name], layer)
        elif name != "bitsandbytes":
            raise ValueError(f"unknown contender {name!r}")


# --------------------------------------------------------------------------------------------
# CUDA graphs
# --------------------------------------------------------------------------------------------
def capture(fn):
    """(replay, output): ``fn`` captured in a CUDA graph after two warm-up calls on a side stream;
    on a capture error, (None, the error's text)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")  # a synchronizing call raises where it is made, not at the capture's end
    try:
        with torch.cuda.graph(graph):
            output = fn()
    except Exception as error:
        torch.cuda.synchronize()
        where = traceback.extract_tb(error.__traceback__)[-1]
        return None, (f"{type(error).__name__}: {str(error).splitlines()[0][:120]} "
                      f"at {os.path.basename(where.filename)}:{where.lineno}")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return graph.replay, output


@contextlib.contextmanager
def compiled_layers(model, fullgraph):
    """Every decoder layer's call through ``torch.compile`` (``nn.Module.compile``), eager again on exit.
    Dynamo's cache keeps every graph (its guards tell the contenders apart): a captured graph's kernels
    must outlive the capture, and a cache past its limit would run eager unnoticed."""
    layers = model.model.layers
    with torch._dynamo.config.patch(recompile_limit=1024, accumulated_recompile_limit=1024):
        for layer in layers:
            layer.compile(fullgraph=fullgraph, dynamic=False)
        try:
            yield
        finally:
            for layer in layers:
                layer._compiled_call_impl = None


def capture_compiled(model, fn):
    """``capture(fn)`` with the decoder layers compiled, and how: (replay, output, timing); without
    ``fullgraph`` where the graph does not trace whole, its first break named."""
    how = "cuda graph, compiled"
    for fullgraph in (True, False):
        try:
            with compiled_layers(model, fullgraph):
                started = time.perf_counter()
                replay, output = capture(fn)
        except Exception as error:  # a graph break under fullgraph: compile again with the breaks
            how = f"cuda graph, compiled with graph breaks ({type(error).__name__}: {str(error).splitlines()[0][:80]})"
            continue
        if replay is None:
            return None, output, f"eager ({output})"
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        return replay, output, f"{how} in {time.perf_counter() - started:.0f} s ({graphs} graphs so far)"
    raise RuntimeError(how)


def gpu_seconds(fn, calls):
    """Seconds per call of ``fn`` between two CUDA events (a graph's replays: GPU time)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / calls


def static_cache(model, length):
    """The model's keyword argument for a new static KV cache of ``length`` positions (transformers
    5.17 takes it as ``past_key_values``, later 5.x as ``cache``)."""
    import inspect

    from transformers import StaticCache

    takes = inspect.signature(type(model.model).forward).parameters
    return {"cache" if "cache" in takes else "past_key_values": StaticCache(config=model.config, max_cache_len=length)}


class Decoder:
    """Greedy decoding of one prompt batch on a static KV cache; ``step`` updates the next token,
    the generated tokens and the position on the GPU (the cache its own length), so a captured step
    replays as decoding."""

    def __init__(self, model, batch):
        self.model = model
        self.cache_kwargs = static_cache(model, PROMPT + NEW_TOKENS)
        self.prompt = torch.randint(0, model.config.vocab_size, (batch, PROMPT), device="cuda",
                                    generator=torch.Generator("cuda").manual_seed(4))
        self.token = torch.zeros(batch, 1, dtype=torch.long, device="cuda")
        self.position = torch.full((1,), PROMPT, dtype=torch.long, device="cuda")
        self.tokens = torch.zeros(batch, NEW_TOKENS, dtype=torch.long, device="cuda")

    def prefill(self):
        """The prompt into a cleared cache; returns the logits of its last position."""
        next(iter(self.cache_kwargs.values())).reset()
        logits = self.model(input_ids=self.prompt, use_cache=True, logits_to_keep=1, **self.cache_kwargs).logits[:, -1]
        first = logits.argmax(-1)
        self.token.copy_(first[:, None])
        self.tokens.zero_()
        self.tokens[:, 0] = first
        self.position.fill_(PROMPT)
        return logits

    def step(self):
        logits = self.model(input_ids=self.token, use_cache=True, **self.cache_kwargs).logits[:, -1]
        following = logits.argmax(-1, keepdim=True)
        self.token.copy_(following)
        self.tokens.index_copy_(1, self.position - (PROMPT - 1), following)
        self.position.add_(1)
        return logits


# --------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------
def _row(meta, kind, dtype_name, tokens, name, seconds, **extra):
    median, p20, p80 = bench.timing.summarize(seconds)
    return dict(meta, kind=kind, dtype=dtype_name, tokens=tokens,
                implementation=name, median_ms=median * 1e3, p20_ms=p20 * 1e3, p80_ms=p80 * 1e3, **extra)


def _max_diff(a, b):
    return (a.float() - b.float()).abs().max().item()


def _timed_contenders(names, router, model, fn, before=None, compiled=False):
    """Per contender: (call, its output tensor or None, how it is timed, peak bytes), ``fn`` captured
    in a CUDA graph (eager where capture fails), with the decoder layers compiled where ``compiled``.
    ``before()`` readies the inputs before each capture."""
    found = {}
    for name in names:
        router(model, name)
        torch.cuda.reset_peak_memory_stats()
        if before:
            before()
        if compiled:
            replay, output, how = capture_compiled(model, fn)
        else:
            replay, output = capture(fn)
            how = "cuda graph" if replay is not None else f"eager ({output})"
        found[name] = (fn if replay is None else replay, None if replay is None else output, how,
                       torch.cuda.max_memory_allocated())
    return found


def _output(call, output):
    """The result of one call: a graph's replay leaves it in the graph's output tensor."""
    result = call()
    return (result if output is None else output).clone()


def _decode_rounds(names, router, model, decoder, timed, rounds):
    """({name: seconds per step, a sample a round}, {name: the generated tokens, one a round}): each
    round a prefill, then NEW_TOKENS - 1 replays of the contender's step, contenders in turn."""
    steps, generations = {name: [] for name in names}, {name: [] for name in names}
    for round_index in range(rounds):
        for name in bench.timing.turned(names, round_index):
            router(model, name)
            decoder.prefill()
            steps[name].append(gpu_seconds(timed[name][0], NEW_TOKENS - 1))
            generations[name].append(decoder.tokens.clone())
    return steps, generations


def bench_floor(model, router, dtype_name, rounds, meta, log, rows, batches=DECODE_BATCHES, compiled=False):
    """Decode tokens/s per batch for bitsandbytes, the drop-in and ``FLOOR`` in the same rounds, with the
    decoder layers compiled where ``compiled``; rows appended to ``rows``."""
    _decode_side_by_side(model, router, ["bitsandbytes", "nf4-triton", FLOOR],
                         "decode compiled" if compiled else "decode floor", dtype_name, rounds, meta, log, rows,
                         batches, compiled)


def bench_merged(model, router, dtype_name, rounds, meta, log, rows, batches=DECODE_BATCHES):
    """Decode tokens/s per batch for bitsandbytes, the drop-in and the drop-in with ``MERGED``'s projections in
    one launch each, in the same rounds: under CUDA graphs, then with the decoder layers compiled; then
    prefill under CUDA graphs; rows appended to ``rows``."""
    names = ["bitsandbytes", "nf4-triton", MERGED]
    _decode_side_by_side(model, router, names, "decode merged", dtype_name, rounds, meta, log, rows, batches)
    _decode_side_by_side(model, router, names, "decode merged compiled", dtype_name, rounds, meta, log, rows,
                         batches, compiled=True)
    bench_prefill(model, router, names, dtype_name, rounds, meta, log, rows, kind="prefill merged")


def _decode_side_by_side(model, router, names, kind, dtype_name, rounds, meta, log, rows, batches, compiled=False):
    """Decode tokens/s per batch for ``names`` in the same rounds, with the decoder layers compiled where
    ``compiled``; rows of ``kind`` appended to ``rows``, batch by batch."""
    for batch in batches:
        decoder = Decoder(model, batch)
        with torch.no_grad():
            timed = _timed_contenders(names, router, model, decoder.step, before=decoder.prefill, compiled=compiled)
            steps, generations = _decode_rounds(names, router, model, decoder, timed, rounds)
        bnb = bench.timing.summarize(steps["bitsandbytes"])[0]
        for name in names:
            median = bench.timing.summarize(steps[name])[0]
            rows.append(_row(meta, kind, dtype_name, f"{batch}x{PROMPT}+{NEW_TOKENS}", name, steps[name],
                             tokens_per_s=batch / median, speedup_over_bitsandbytes=bnb / median,
                             timing=timed[name][2], peak_mib=timed[name][3] / 2**20,
                             tokens_equal_bitsandbytes=(generations[name][0] == generations["bitsandbytes"][0])
                             .float().mean().item()))
        log(f"{kind} {dtype_name} batch {batch}: " + ", ".join(
            f"{r['implementation']} {r['tokens_per_s']:.0f} tok/s ({r['speedup_over_bitsandbytes']:.2f}x, "
            f"{r['timing']})" for r in rows[-len(names):]))
        del decoder, timed
        torch.cuda.empty_cache()


def bench_decode(model, router, names, dtype_name, rounds, meta, log, rows, batches=DECODE_BATCHES):
    """Decode tokens/s per batch under CUDA graphs, the generations and the logits' agreement; rows appended to
    ``rows``, batch by batch."""
    for batch in batches:
        decoder = Decoder(model, batch)
        with torch.no_grad():
            timed = _timed_contenders(names, router, model, decoder.step, before=decoder.prefill)
            steps, generations = _decode_rounds(names, router, model, decoder, timed, rounds)
            tokens = {name: runs[0] for name, runs in generations.items()}
            # Logits from the same inputs: the prompt's last position, then one step from one token.
            logits = {}
            for name in names + [REFERENCE]:
                router(model, name)
                prompt_logits = decoder.prefill().clone()
                decoder.token.copy_(tokens["bitsandbytes"][:, 1:2])
                call, output = timed[name][:2] if name in timed else (decoder.step, None)
                logits[name] = (prompt_logits, _output(call, output))
            decoder.prefill()
            for _ in range(NEW_TOKENS - 1):
                decoder.step()  # still the reference's route: its greedy generation, eager
            reference_tokens = decoder.tokens.clone()
        base = tokens["bitsandbytes"]
        top2 = logits["bitsandbytes"][1].float().topk(2, dim=-1).values
        for name in names:
            same = tokens[name] == base
            first_difference = torch.where(same.all(1), NEW_TOKENS, (~same).int().argmax(1))
            median = bench.timing.summarize(steps[name])[0]
            rows.append(_row(meta, "decode", dtype_name, f"{batch}x{PROMPT}+{NEW_TOKENS}", name, steps[name],
                             tokens_per_s=batch / median, timing=timed[name][2], peak_mib=timed[name][3] / 2**20,
                             tokens_equal_bitsandbytes=same.float().mean().item(),
                             sequences_equal_bitsandbytes=int(same.all(1).sum()),
                             mean_first_difference=first_difference.float().mean().item(),
                             tokens_equal_reference=(tokens[name] == reference_tokens).float().mean().item(),
                             tokens_equal_own_rerun=min((run == tokens[name]).float().mean().item()
                                                        for run in generations[name]),
                             prompt_logits_diff_bitsandbytes=_max_diff(logits[name][0], logits["bitsandbytes"][0]),
                             prompt_logits_diff_reference=_max_diff(logits[name][0], logits[REFERENCE][0]),
                             step_logits_diff_bitsandbytes=_max_diff(logits[name][1], logits["bitsandbytes"][1]),
                             step_logits_diff_reference=_max_diff(logits[name][1], logits[REFERENCE][1]),
                             median_top2_margin=(top2[:, 0] - top2[:, 1]).median().item()))
        log(f"decode {dtype_name} batch {batch}: " + ", ".join(
            f"{r['implementation']} {r['tokens_per_s']:.0f} tok/s ({r['timing'][:10]}; tokens = bnb "
            f"{100 * r['tokens_equal_bitsandbytes']:.0f} %; step logits vs fp32 {r['step_logits_diff_reference']:.3g})"
            for r in rows[-len(names):]))
        del decoder, timed
        torch.cuda.empty_cache()


def bench_prefill(model, router, names, dtype_name, rounds, meta, log, rows, kind="prefill"):
    """Prefill time per token count under CUDA graphs, and the last position's logits' agreement; rows of ``kind``
    appended to ``rows``, case by case."""
    for batch, sequence in PREFILL_TOKENS:
        ids = torch.randint(0, model.config.vocab_size, (batch, sequence), device="cuda",
                            generator=torch.Generator("cuda").manual_seed(5))

        cache = static_cache(model, sequence)

        def forward():  # as a server prefills: into a cleared KV cache
            next(iter(cache.values())).reset()
            return model(input_ids=ids, use_cache=True, logits_to_keep=1, **cache).logits[:, -1]

        with torch.no_grad():
            timed = _timed_contenders(names, router, model, forward)
            calls = max(3, 16384 // (batch * sequence))
            seconds = {name: [] for name in names}
            for round_index in range(rounds):
                for name in bench.timing.turned(names, round_index):
                    router(model, name)
                    seconds[name].append(gpu_seconds(timed[name][0], calls))
            logits = {}
            for name in names + [REFERENCE]:
                router(model, name)
                logits[name] = _output(*timed[name][:2]) if name in timed else forward().clone()
        bnb = bench.timing.summarize(seconds["bitsandbytes"])[0]
        for name in names:
            median = bench.timing.summarize(seconds[name])[0]
            rows.append(_row(meta, kind, dtype_name, f"{batch}x{sequence}", name, seconds[name],
                             tokens_per_s=batch * sequence / median, speedup_over_bitsandbytes=bnb / median,
                             timing=timed[name][2], peak_mib=timed[name][3] / 2**20,
                             prompt_logits_diff_bitsandbytes=_max_diff(logits[name], logits["bitsandbytes"]),
                             prompt_logits_diff_reference=_max_diff(logits[name], logits[REFERENCE])))
        log(f"{kind} {dtype_name} {batch}x{sequence}: " + ", ".join(
            f"{r['implementation']} {r['median_ms']:.2f} ms ({r['speedup_over_bitsandbytes']:.2f}x, {r['timing'][:10]})"
            for r in rows[-len(names):]))
        del timed
        torch.cuda.empty_cache()


LINEAR_RANGE = "nf4-linear"


def linear_share(model, fn):
    """The share of the GPU's kernel time in the model's Linear4bit layers over one eager call of
    ``fn``: kernels that start inside a layer's range on the GPU (the profiler's annotation of the
    range there), over all kernels."""
    from torch.profiler import ProfilerActivity, profile, record_function

    opened = []

    def enter(module, args):
        opened.append(record_function(LINEAR_RANGE))
        opened[-1].__enter__()

    def leave(module, args, output):
        opened.pop().__exit__(None, None, None)

    layers = bench.model.linear4bit_layers(model)
    handles = [layer.register_forward_pre_hook(enter) for layer in layers]
    handles += [layer.register_forward_hook(leave) for layer in layers]
    try:
        fn()
        torch.cuda.synchronize()
        os.environ.setdefault("TEARDOWN_CUPTI", "1")  # as bench.timing.cuda_records
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
    finally:
        for handle in handles:
            handle.remove()
    torch.cuda.synchronize()
    time.sleep(0.05)
    gpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    spans = sorted((e.time_range.start, e.time_range.end) for e in gpu if e.name == LINEAR_RANGE)
    kernels = [e for e in gpu if e.name != LINEAR_RANGE]
    total = sum(e.time_range.elapsed_us() for e in kernels)
    by_name = {}
    for e in kernels:
        if any(start <= e.time_range.start < end for start, end in spans):
            by_name[e.name[:40]] = by_name.get(e.name[:40], 0.0) + e.time_range.elapsed_us()
    inside = sum(by_name.values())
    top = ";".join(f"{name} {us:.0f}" for name, us in sorted(by_name.items(), key=lambda item: -item[1])[:4])
    return (inside / total if total else 0.0), total / 1e3, len(spans), top


def bench_share(model, router, names, dtype_name, meta, log, rows, batches=DECODE_BATCHES):
    """``linear_share`` of a decode step at every batch of ``batches`` and of a 1x128 and a 1x512 prefill,
    per contender; rows appended to ``rows``."""
    first = len(rows)
    decoders = {batch: Decoder(model, batch) for batch in batches}
    cases = {f"decode {batch}": (decoder, decoder.step) for batch, decoder in decoders.items()}
    for length in (128, 512):
        ids = torch.randint(0, model.config.vocab_size, (1, length), device="cuda",
                            generator=torch.Generator("cuda").manual_seed(6))
        cases[f"prefill 1x{length}"] = (next(iter(decoders.values())), lambda ids=ids: model(input_ids=ids, logits_to_keep=1))
    with torch.no_grad():
        for name in names:
            router(model, name)
            for case, (decoder, fn) in cases.items():
                decoder.prefill()
                share, kernel_ms, ranges, top = linear_share(model, fn)
                rows.append(dict(meta, kind="linear-share", dtype=dtype_name, tokens=case, implementation=name,
                                 linear_share=share, kernel_ms=kernel_ms, linear_ranges=ranges, linear_kernels_us=top))
    log(f"share of kernel time in the 4-bit linears, {dtype_name}: " + ", ".join(
        f"{r['implementation']} {r['tokens']} {100 * r['linear_share']:.0f} % of {r['kernel_ms']:.2f} ms "
        f"({r['linear_ranges']} ranges: {r['linear_kernels_us']})" for r in rows[first:]))
    del decoders


def loss_curves(model, router, names, dtype_name, meta, log, rows):
    """QLoRA losses over CURVE_STEPS steps per contender from the same LoRA start, on four batches in
    turn (bitsandbytes a second time: its own run-to-run spread); rows appended to ``rows``."""
    lora = [p for p in model.parameters() if p.requires_grad]
    start = [p.detach().clone() for p in lora]
    batches = [torch.randint(0, model.config.vocab_size, CURVE_TOKENS, device="cuda",
                             generator=torch.Generator("cuda").manual_seed(10 + i)) for i in range(4)]
    model.train()
    curves = {}
    # bitsandbytes twice: the second run is its own run-to-run spread
    for name, route_name in [(name, name) for name in names] + [("bitsandbytes (second run)", "bitsandbytes")]:
        router(model, route_name)
        for p, value in zip(lora, start):
            p.data.copy_(value)
        optimizer = torch.optim.AdamW(lora, lr=1e-3)
        losses = []
        for step in range(CURVE_STEPS):
            ids = batches[step % len(batches)]
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        curves[name] = torch.stack(losses).float().cpu()
        rows.extend(dict(meta, kind="loss", dtype=dtype_name, tokens=f"{CURVE_TOKENS[0]}x{CURVE_TOKENS[1]}",
                         implementation=name, step=step, loss=value.item())
                    for step, value in enumerate(curves[name]))
    for p, value in zip(lora, start):
        p.data.copy_(value)
    model.eval()
    log(f"loss curves {dtype_name}, {CURVE_STEPS} steps: " + ", ".join(
        f"{name} {curve[0]:.4f} -> {curve[-1]:.4f} (max diff from bitsandbytes "
        f"{(curve - curves['bitsandbytes']).abs().max():.3g})" for name, curve in curves.items()))


class SavedRows(list):
    """CSV rows written to ``path`` again at each append, so that a run stopped by a time limit keeps the rows
    it measured."""

    def __init__(self, path):
        super().__init__()
        self.path = path

    def append(self, row):
        super().append(row)
        bench.results.write_csv(self.path, self)

    def extend(self, rows):
        super().extend(rows)
        bench.results.write_csv(self.path, self)

    def __iadd__(self, rows):
        self.extend(rows)
        return self


def run(dtype_name, layers, rounds, model_folder, meta, log=print, with_unsloth=False, sections=SECTIONS,
        batches=DECODE_BATCHES, path=None):
    """The ``sections`` (``SECTIONS``) for one dtype, decoding at ``batches``; returns CSV rows, written to
    ``path`` as they are measured where it is given. ``with_unsloth``: import Unsloth (which patches
    transformers for every contender) and time its Linear4bit override too."""
    size = f"4096x14336 x{layers} layers"
    meta = dict(meta, model=size)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    unsloth, why = unsloth_override() if with_unsloth else (None, "not asked for: --unsloth")
    names = [name for name in CONTENDERS if name != "unsloth" or unsloth]
    if unsloth is None:
        log(f"unsloth: skipped ({why})")
    if not os.path.exists(os.path.join(model_folder, "config.json")):
        bench.model.save_random_llama(SIZE, model_folder, vocab_size=bench.model.LLAMA3_VOCAB, layers=layers)
    model = bench.model.load_4bit(model_folder, dtype)
    model.eval()
    router = Router(model, unsloth)
    log(f"{len(router.layers)} Linear4bit layers, {layers} decoder layers, vocab {model.config.vocab_size}")
    training = list(dict.fromkeys(name for name in TRAINING if name in names))
    rows = [] if path is None else SavedRows(path)
    bodies = {
        "decode": lambda: bench_decode(model, router, names, dtype_name, rounds, meta, log, rows, batches),
        "prefill": lambda: bench_prefill(model, router, names, dtype_name, rounds, meta, log, rows),
        "share": lambda: bench_share(model, router, names, dtype_name, meta, log, rows, batches),
        "train": lambda: rows.extend(bench.model.bench_train(bench.model.add_lora(model), size, dtype_name, rounds,
                                                            dict.fromkeys(training), meta, log,
                                                            tokens=TRAIN_TOKENS, route_to=router)),
        "curves": lambda: loss_curves(model, router, training, dtype_name, meta, log, rows),
        "floor": lambda: bench_floor(model, router, dtype_name, rounds, meta, log, rows, batches),
        "compiled": lambda: bench_floor(model, router, dtype_name, rounds, meta, log, rows, batches, compiled=True),
        "merged": lambda: bench_merged(model, router, dtype_name, rounds, meta, log, rows, batches),
    }
    for section in (bodies[name] for name in SECTIONS if name in sections):
        try:
            section()
        except Exception:  # the other sections still run; the log carries the failure
            log(f"section failed:\n{traceback.format_exc()}")
        router(model, "bitsandbytes")
        torch.cuda.empty_cache()
    return rows


def main(argv=None):
    import tempfile

    import bench.plots

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--layers", type=int, default=LAYERS, help="decoder layers (Llama-3-8B has 32)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--unsloth", action="store_true",
                        help="import Unsloth (it patches transformers, for every contender) and time its override")
    parser.add_argument("--out", default="results", help="folder for the CSV (a per-GPU subfolder is made)")
    parser.add_argument("--model", default=os.path.join(tempfile.gettempdir(), "nf4-triton-serve-model"),
                        help="where the random model is saved (reused when there)")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"a subset of {','.join(SECTIONS)}")
    parser.add_argument("--batches", default=",".join(map(str, DECODE_BATCHES)),
                        help="decode batch sizes; empty: no decode (the sections' prefill and training only)")
    args = parser.parse_args(argv)
    sections = args.sections.split(",")
    if not set(sections) <= set(SECTIONS):
        parser.error(f"--sections takes names from {','.join(SECTIONS)}, got {args.sections}")
    if not torch.cuda.is_available():
        raise SystemExit("bench/serve.py times CUDA graphs: it needs a CUDA GPU")
    from importlib import metadata

    # Unsloth's version without importing it: importing patches transformers for every contender
    meta = dict(gpu=torch.cuda.get_device_name(), timestamp=bench.results.utc_timestamp(),
                **bench.results.version_columns(("torch", "triton", "bitsandbytes", "transformers", "peft")),
                unsloth_version=metadata.version("unsloth") if args.unsloth else "not imported")
    print(meta)
    folder = bench.results.results_folder(args.out)
    os.makedirs(folder, exist_ok=True)
    layers = "" if args.layers == LAYERS else f"_{args.layers}layers"  # the charts read the default size's files
    path = os.path.join(folder, f"serve_{args.dtype}{layers}{'_unsloth' if args.unsloth else ''}.csv")
    rows = run(args.dtype, args.layers, args.rounds, f"{args.model}-{args.layers}", meta, with_unsloth=args.unsloth,
               sections=sections, batches=[int(batch) for batch in args.batches.split(",") if batch], path=path)
    if not rows:
        raise SystemExit("no rows measured: every section failed (the log says why)")
    print("wrote", ", ".join([path] + bench.plots.plot_serve(folder)))


if __name__ == "__main__":
    main()
