"""End to end: a Llama-style model in 4-bit NF4, its Linear4bit layers computed by bitsandbytes,
by this kernel through the drop-in, or by Unsloth's fast_dequantize through the same drop-in.

The model is built offline from a config with random weights, saved, and loaded back through
transformers' BitsAndBytesConfig as users load a 4-bit model (NF4, double quantization). Timed
per contender, rounds interleaved (the order turns each round): prefill (inference forward) at
several token counts, a QLoRA training step (PEFT LoRA r=16 on every linear layer, forward +
backward + AdamW) with and without gradient checkpointing, and, per layer shape, bitsandbytes' own
4-bit matmul against dequantize + matmul at small token counts (where bitsandbytes uses its fused
kernels). Section ``model`` of ``python -m bench`` runs it; bench/fsdp_qlora.py builds and loads its model the same way.
"""

import contextlib
import os
import tempfile
import time

import torch

import bench.contenders
import bench.timing
from nf4_triton import dropin, kernel

SIZES = {  # the first: a small model whose host time matters; the second: the challenge's layers
    "2048x5632x4": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=4, num_attention_heads=16,
                        num_key_value_heads=16),
    "4096x14336x2": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=2, num_attention_heads=32,
                         num_key_value_heads=8),
}
PREFILL_TOKENS = [(1, 1), (1, 128), (4, 512)]  # (batch, sequence)
TRAIN_TOKENS = (4, 512)
CROSSOVER_ROWS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 1536]
LORA_RANK = 16
LLAMA3_VOCAB = 128256  # the real-size models' vocabulary (bench/serve.py, bench/fsdp_qlora.py)


def llama_config(size, vocab_size=32000, layers=None):
    """A LlamaConfig of ``size`` (SIZES), with ``layers`` decoder layers where given."""
    from transformers import LlamaConfig

    shape = dict(SIZES[size], **({} if layers is None else {"num_hidden_layers": layers}))
    return LlamaConfig(vocab_size=vocab_size, max_position_embeddings=2048, **shape)


def save_random_llama(size, folder, seed=0, vocab_size=32000, layers=None):
    """A LlamaForCausalLM of ``size`` with random weights, saved in bf16 to ``folder``."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = LlamaForCausalLM(llama_config(size, vocab_size, layers)).to(torch.bfloat16)
    model.save_pretrained(folder)
    del model


def load_4bit(folder, dtype, device_map="cuda:0", quant_storage=torch.uint8):
    """The saved model in 4-bit NF4 with double quantization, as transformers loads it
    (``quant_storage``: the dtype of the tensors that hold the packed bytes; FSDP needs the
    compute dtype there)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                bnb_4bit_compute_dtype=dtype, bnb_4bit_quant_storage=quant_storage)
    return AutoModelForCausalLM.from_pretrained(folder, quantization_config=config, dtype=dtype,
                                                device_map=device_map)


def linear4bit_layers(model):
    import bitsandbytes as bnb

    return [module for module in model.modules() if isinstance(module, bnb.nn.Linear4bit)]


def add_lora(model):
    """PEFT LoRA r=16 on every linear layer, as QLoRA fine-tuning sets it up."""
    import peft

    config = peft.LoraConfig(r=LORA_RANK, lora_alpha=2 * LORA_RANK, lora_dropout=0.0, target_modules="all-linear",
                             task_type="CAUSAL_LM")
    return peft.get_peft_model(model, config)


def route(model, contender, dequantize_functions):
    """Compute the model's Linear4bit layers as ``contender`` does."""
    dropin.disable(model)
    if contender != "bitsandbytes":
        dropin.enable(model, dequantize=dequantize_functions[contender])


def contenders(log=print):
    """name -> dequantize function for the drop-in (None: bitsandbytes' own forward)."""
    found = {"bitsandbytes": None, "nf4-triton": kernel.dequantize_nf4}
    unsloth = bench.contenders.unsloth_fast_dequantize(log)
    if unsloth is not None:
        found["unsloth-fused"] = unsloth
    return found


def timed(fn, calls):
    """Seconds per call and peak bytes allocated during the calls."""
    fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls, torch.cuda.max_memory_allocated()


def kernel_time(fn, calls=3):
    """(GPU kernel time per call of ``fn`` in ms, the share of it dequantization kernels take),
    from the profiler. Against a call's wall time, the first says whether the GPU or the host
    bounds it; the second bounds what a faster dequantization can gain."""
    fn()
    torch.cuda.synchronize()

    def profiled_calls():
        for _ in range(calls):
            fn()

    kernels = bench.timing.cuda_records(profiled_calls)
    total = sum(e.time_range.elapsed_us() for e in kernels)
    dequant = sum(e.time_range.elapsed_us() for e in kernels if "dequant" in e.name.lower())
    return total / calls / 1e3, (dequant / total if total else 0.0)


def prefill_fn(model, batch, seq, vocab_size):
    ids = torch.randint(0, vocab_size, (batch, seq), device="cuda", generator=torch.Generator("cuda").manual_seed(1))

    def prefill():
        with torch.inference_mode():
            return model(ids).logits

    return prefill


def train_step_fn(model, optimizer, batch, seq, vocab_size):
    ids = torch.randint(0, vocab_size, (batch, seq), device="cuda", generator=torch.Generator("cuda").manual_seed(2))

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return step


def row(meta, kind, size, dtype_name, tokens, implementation, seconds, peaks, profile, **extra):
    median, p20, p80 = bench.timing.summarize(seconds)
    n_tokens = tokens[0] * tokens[1]
    return dict(meta, kind=kind, model=size, dtype=dtype_name, tokens=f"{tokens[0]}x{tokens[1]}",
                implementation=implementation, median_ms=median * 1e3, p20_ms=p20 * 1e3,
                p80_ms=p80 * 1e3, tokens_per_s=n_tokens / median, peak_mib=max(peaks) / 2**20,
                gpu_ms=profile[0], dequant_share=profile[1], **extra)


def bench_prefill(model, size, dtype_name, rounds, functions, meta, log):
    vocab = model.config.vocab_size
    rows = []
    for tokens in PREFILL_TOKENS:
        prefill = prefill_fn(model, *tokens, vocab)
        calls = 20 if tokens[0] * tokens[1] >= 2048 else 50
        samples = {name: ([], []) for name in functions}
        logits = {}
        for round_index in range(rounds):
            for name in bench.timing.turned(list(functions), round_index):
                route(model, name, functions)
                seconds, peak = timed(prefill, calls)
                samples[name][0].append(seconds)
                samples[name][1].append(peak)
        for name in functions:
            route(model, name, functions)
            logits[name] = prefill()
            profile = kernel_time(prefill)
            same = torch.equal(logits[name], logits["bitsandbytes"])
            rows.append(row(meta, "prefill", size, dtype_name, tokens, name, *samples[name], profile,
                            logits_equal_bitsandbytes=same))
        route(model, "bitsandbytes", functions)
        log(f"prefill {size} {dtype_name} {tokens[0]}x{tokens[1]}: " + ", ".join(
            f"{r['implementation']} {r['median_ms']:.2f} ms (GPU {r['gpu_ms']:.2f})" for r in rows[-len(functions):]))
    return rows


def bench_train(model, size, dtype_name, rounds, functions, meta, log, tokens=TRAIN_TOKENS, route_to=None):
    """A QLoRA step of ``tokens`` (batch, sequence) per contender, without and with gradient
    checkpointing. ``route_to(model, name)`` routes the model's layers (default: ``route``)."""
    route_to = route_to or (lambda model, name: route(model, name, functions))
    vocab = model.config.vocab_size
    rows = []
    for checkpointing in (False, True):
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_disable()
        model.train()
        lora = [p for p in model.parameters() if p.requires_grad]
        initial = [p.detach().clone() for p in lora]
        optimizer = torch.optim.AdamW(lora, lr=1e-4)
        step = train_step_fn(model, optimizer, *tokens, vocab)
        samples = {name: ([], []) for name in functions}
        for round_index in range(rounds):
            for name in bench.timing.turned(list(functions), round_index):
                route_to(model, name)
                seconds, peak = timed(step, 5)
                samples[name][0].append(seconds)
                samples[name][1].append(peak)
        # Loss and LoRA gradients of one batch from the starting LoRA weights, per contender;
        # bitsandbytes twice, the second run its own row: its run-to-run difference.
        ids = torch.randint(0, vocab, tokens, device="cuda", generator=torch.Generator("cuda").manual_seed(3))

        def loss_and_grads(name):
            route_to(model, name)
            for p, start in zip(lora, initial):
                p.data.copy_(start)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            grads = [p.grad.detach().clone() for p in lora]
            model.zero_grad(set_to_none=True)
            return loss.detach(), grads

        reference_loss, reference_grads = loss_and_grads("bitsandbytes")
        for name in functions:
            loss, grads = loss_and_grads(name)
            profile = kernel_time(step, calls=2)
            largest = max((a.float() - b.float()).abs().max().item() for a, b in zip(grads, reference_grads))
            rows.append(row(meta, "qlora-step-checkpointed" if checkpointing else "qlora-step", size, dtype_name,
                            tokens, name, *samples[name], profile,
                            loss_equal_bitsandbytes=torch.equal(loss, reference_loss),
                            lora_grads_equal_bitsandbytes=all(map(torch.equal, grads, reference_grads)),
                            lora_grad_max_diff=largest))
        for p, start in zip(lora, initial):
            p.data.copy_(start)
        route_to(model, "bitsandbytes")
        log(f"qlora step {size} {dtype_name} checkpointing={checkpointing}: " + ", ".join(
            f"{r['implementation']} {r['median_ms']:.1f} ms (GPU {r['gpu_ms']:.1f}) {r['peak_mib']:.0f} MiB"
            for r in rows[-len(functions):]))
    model.gradient_checkpointing_disable()
    model.eval()
    return rows


def bench_crossover(model, size, dtype_name, meta, log):
    """Per distinct Linear4bit shape: bitsandbytes' matmul_4bit (its own rule: fused kernel or
    dequantize + linear) against this kernel's dequantize + linear, at small row counts."""
    import bitsandbytes as bnb
    import triton.testing

    rows = []
    seen = set()
    for layer in linear4bit_layers(model):
        state = layer.weight.quant_state
        shape = tuple(state.shape)
        if shape in seen:
            continue
        seen.add(shape)
        packed = layer.weight.data
        for m in CROSSOVER_ROWS:
            x = torch.randn(m, shape[1], dtype=state.dtype, device="cuda")
            fns = {"bitsandbytes": lambda: bnb.matmul_4bit(x, layer.weight, quant_state=state),
                   "nf4-triton": lambda: torch.nn.functional.linear(x, kernel.dequantize_nf4(packed, state))}
            with torch.inference_mode():
                times = {name: triton.testing.do_bench(fn, warmup=10, rep=40, quantiles=[0.5, 0.2, 0.8])
                         for name, fn in fns.items()}
                fused = dropin.bitsandbytes_fuses(x, state.dtype, state)
            for name, (median, p20, p80) in times.items():
                rows.append(dict(meta, kind="crossover", model=size, dtype=dtype_name, tokens=str(m),
                                 implementation=name, median_ms=median, p20_ms=p20, p80_ms=p80,
                                 tokens_per_s=m / median * 1e3, peak_mib=0.0, dequant_share=0.0,
                                 layer=f"{shape[0]}x{shape[1]}", bitsandbytes_fused=fused))
        log(f"crossover {size} {dtype_name} {shape[0]}x{shape[1]}: " + ", ".join(
            f"m={r['tokens']} {'bnb-fused' if r['bitsandbytes_fused'] else 'bnb-deq'} "
            f"{r['median_ms'] * 1e3:.0f}/{s['median_ms'] * 1e3:.0f} us"
            for r, s in zip(rows[-2 * len(CROSSOVER_ROWS)::2], rows[-2 * len(CROSSOVER_ROWS) + 1::2])))
    return rows


def run(sizes, dtypes, rounds, meta, log=print, folder=None):
    """Every section for every size and dtype; returns CSV rows."""
    functions = contenders(log)
    rows = []
    with tempfile.TemporaryDirectory() if folder is None else contextlib.nullcontext(folder) as root:
        for size in sizes:
            path = os.path.join(root, size)
            if not os.path.exists(os.path.join(path, "config.json")):
                save_random_llama(size, path)
            for dtype_name, dtype in dtypes.items():
                model = load_4bit(path, dtype)
                model.eval()
                rows += bench_crossover(model, size, dtype_name, meta, log)
                rows += bench_prefill(model, size, dtype_name, rounds, functions, meta, log)
                model = add_lora(model)
                rows += bench_train(model, size, dtype_name, rounds, functions, meta, log)
                del model
                torch.cuda.empty_cache()
    return rows
