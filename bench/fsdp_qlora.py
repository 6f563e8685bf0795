"""QLoRA under FSDP on several GPUs: bitsandbytes' own Linear4bit against the drop-in, side by side in one job.

    torchrun --nproc_per_node 2 -m bench.fsdp_qlora [--sizes 2048x5632x4,4096x14336x2,4096x14336x8@2x2048]
                                                 [--steps 20] [--plan-steps 1000] [--fsdp 1|2] [--out results]

The path PEFT, Accelerate and TRL document for FSDP QLoRA: the model of bench/model.py (random
weights saved offline) loaded in 4-bit NF4 with ``bnb_4bit_quant_storage=torch.bfloat16`` so that
FSDP can flatten and shard the packed bytes with the rest, PEFT LoRA r=16 on every linear layer,
FSDP (PyTorch's FSDP1, ``use_orig_params=False``, PEFT's ``fsdp_auto_wrap_policy``: each decoder
layer a unit, each LoRA layer a unit of its own, bf16 mixed precision; ``--fsdp 2``: FSDP2's
``fully_shard`` on each decoder layer and the root, bf16 parameters and reductions), AdamW, fixed
random token batches (each rank its own), LoRA weights in bf16. Sizes are bench/model.py's models or,
spelled with the tokens per rank and step, real-size ones with Llama-3's vocabulary (``--sizes``).

Side by side: every contender's model is loaded and wrapped first, each from the same LoRA
initialisation with its own AdamW; then each step runs for every contender in turn, the order turning
each step; bitsandbytes runs twice, so that its own run-to-run spread is measured beside ours.
Losses per step and the first step's LoRA gradients are compared with bitsandbytes', and
every rank's frozen shards (the 4-bit weights among them) must be bit-for-bit what they were before
training. Memory per rank: what the loaded, wrapped model holds and each step's peak above what was
allocated before it. Then, first size only, the drop-in trains ``--plan-steps`` more steps with every
dequantization checked against the validating path, counting launch plans (live, made) and calls that
missed one. Writes fsdp1.csv and fsdp1_losses.csv (``--fsdp 2``: fsdp2.csv, fsdp2_losses.csv) into the
per-GPU results folder, again after each size.
"""

import argparse
import gc
import os
import re
import shutil
import tempfile
import time
from typing import NamedTuple

import torch

import bench.model
import bench.results
import bench.timing
from nf4_triton import dropin, kernel

CONTENDERS = ("bitsandbytes", "nf4-triton")
TOKENS = (4, 512)  # per rank and step, for bench.model's models
WARMUP_STEPS = 2  # left out of the step-time medians: the first step makes the drop-in's plans and AdamW's state
SIZES = "2048x5632x4,4096x14336x2,4096x14336x8@2x2048"
SIZE_SPELLING = re.compile(r"(\d+x\d+)x(\d+)(?:@(\d+)x(\d+))?")
# Versions in each row: Unsloth is not a contender here and is not imported.
PACKAGES = ("torch", "triton", "bitsandbytes", "transformers", "peft")
FSDP_FLAVOURS = {1: "FSDP1 use_orig_params=False", 2: "FSDP2 fully_shard"}
# The drop-in's plan counts; a bitsandbytes row leaves them empty.
PLAN_COLUMNS = ("timed_plan_misses", "timed_live_plans", "plan_calls", "plan_misses", "stale_results",
                "most_live_plans", "live_plans_after")


class Size(NamedTuple):
    """One ``--sizes`` entry: its spelling, the shape of bench.model.SIZES it takes, its decoder
    layers, tokens per rank and step (batch, sequence) and vocabulary."""

    name: str
    shape: str
    layers: int
    tokens: tuple
    vocab_size: int


def parse_size(name):
    """``HIDDENxINTERMEDIATExLAYERS[@BATCHxSEQUENCE]`` as a Size; a ValueError says what is wrong."""
    spelled = SIZE_SPELLING.fullmatch(name)
    if spelled is None:
        raise ValueError(f"size {name!r} is not HIDDENxINTERMEDIATExLAYERS[@BATCHxSEQUENCE]")
    hidden_intermediate, layers, batch, sequence = spelled.groups()
    shape = next((key for key in bench.model.SIZES if key.startswith(f"{hidden_intermediate}x")), None)
    if shape is None:
        raise ValueError(f"size {name!r}: no shape {hidden_intermediate} in bench.model.SIZES "
                         f"({', '.join(bench.model.SIZES)})")
    if int(layers) < 1:
        raise ValueError(f"size {name!r}: a model needs at least one decoder layer")
    config = bench.model.llama_config(shape)
    if batch is None:  # bench.model's model: its vocabulary, its training tokens
        return Size(name, shape, int(layers), TOKENS, config.vocab_size)
    longest = config.max_position_embeddings
    if int(batch) < 1 or not 2 <= int(sequence) <= longest:  # a next-token loss needs two positions
        raise ValueError(f"size {name!r}: the batch must be at least 1 and the sequence from 2 to {longest} "
                         "(the model's max_position_embeddings)")
    return Size(name, shape, int(layers), (int(batch), int(sequence)), bench.model.LLAMA3_VOCAB)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    config = bench.model.llama_config(next(iter(bench.model.SIZES)))
    parser.add_argument("--sizes", default=SIZES, help=(
        "comma-separated HIDDENxINTERMEDIATExLAYERS[@BATCHxSEQUENCE]: HIDDENxINTERMEDIATE picks the shape of "
        f"bench.model.SIZES ({', '.join(bench.model.SIZES)}) whose name starts with it, LAYERS its decoder layers. "
        f"Without @: bench.model's model, vocabulary {config.vocab_size}, {TOKENS[0]}x{TOKENS[1]} tokens per rank "
        f"and step. With @BATCHxSEQUENCE: a real-size model, Llama-3's vocabulary ({bench.model.LLAMA3_VOCAB}, as "
        "bench/serve.py loads it), BATCHxSEQUENCE tokens per rank and step, SEQUENCE at most "
        f"{config.max_position_embeddings} (the model's max_position_embeddings). Default: %(default)s"))
    parser.add_argument("--steps", type=int, default=20,
                        help=f"training steps per contender, the first {WARMUP_STEPS} left out of the medians")
    parser.add_argument("--plan-steps", type=int, default=1000,
                        help="more steps with the drop-in, every dequantization checked (first size only)")
    parser.add_argument("--fsdp", type=int, choices=(1, 2), default=1,
                        help="1: FullyShardedDataParallel (use_orig_params=False); 2: fully_shard")
    parser.add_argument("--out", default="results", help="folder for CSVs (a per-GPU subfolder is made)")
    args = parser.parse_args(argv)
    try:
        args.sizes = [parse_size(name) for name in args.sizes.split(",")]
    except ValueError as error:
        parser.error(str(error))
    names = [size.name for size in args.sizes]
    if len(set(names)) < len(names):
        parser.error(f"--sizes names a size twice: {','.join(names)}")
    if args.steps <= WARMUP_STEPS or args.plan_steps < 0:
        parser.error(f"--steps must be more than {WARMUP_STEPS} and --plan-steps at least 0")
    return args


def compare_losses(reference, other):
    """Per-step losses of two runs: (all equal, largest absolute difference, first step that differs)."""
    if len(reference) != len(other):
        raise ValueError(f"compare_losses: {len(reference)} against {len(other)} steps")
    differences = [abs(a - b) for a, b in zip(reference, other)]
    first = next((step for step, (a, b) in enumerate(zip(reference, other)) if a != b), None)
    return first is None, max(differences, default=0.0), first


def loss_rows(flavour, size_name, contender, losses):
    """One contender's rows of fsdpN_losses.csv at one size."""
    return [dict(fsdp=FSDP_FLAVOURS[flavour], model=size_name, implementation=contender, step=step, loss=loss)
            for step, loss in enumerate(losses)]


def batch(step, rank, tokens, vocab_size, device):
    generator = torch.Generator(device).manual_seed(1000 * step + rank)
    return torch.randint(0, vocab_size, tokens, device=device, generator=generator)


def wrap(model, flavour=1):
    """The model sharded by FSDP1 (PEFT's auto-wrap policy) or FSDP2 (each decoder layer, then the root)."""
    if flavour == 2:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        for layer in model.get_base_model().model.layers:
            fully_shard(layer, mp_policy=policy)
        return fully_shard(model, mp_policy=policy)
    from peft.utils.other import fsdp_auto_wrap_policy
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision

    precision = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)
    return FullyShardedDataParallel(model, auto_wrap_policy=fsdp_auto_wrap_policy(model), use_orig_params=False,
                                    mixed_precision=precision, device_id=torch.cuda.current_device(),
                                    limit_all_gathers=True)


class CheckedDequantize:
    """The kernel's dequantization, each result compared with the validating path's (``out=``
    takes no plan) and the plans counted: a call that kept a new plan missed the fast path."""

    def __init__(self):
        self.calls = self.misses = self.stale = self.most_plans = 0

    def __call__(self, packed, quant_state):
        self.calls += 1
        kept = kernel.PLANS.stats()["kept"]
        got = kernel.dequantize_nf4(packed, quant_state)
        plans = kernel.PLANS.stats()
        self.misses += plans["kept"] - kept
        self.most_plans = max(self.most_plans, plans["live"])
        expected = kernel.dequantize_nf4(packed, quant_state,
                                         out=torch.empty(got.shape, dtype=got.dtype, device=got.device))
        if not torch.equal(got.view(torch.int16), expected.view(torch.int16)):
            self.stale += 1
        return got


def frozen_weights(model):
    """The bytes of every parameter outside the LoRA adapters, each whole: FSDP gathers every
    rank's shard. Bytes, not values: packed 4-bit weights stored as bf16 hold NaN patterns."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    def whole_bytes():
        return {name: whole(p.detach()).contiguous().view(torch.uint8).clone()
                for name, p in model.named_parameters() if "lora_" not in name}

    if isinstance(model, FullyShardedDataParallel):
        with FullyShardedDataParallel.summon_full_params(model, writeback=False):
            return whole_bytes()
    return whole_bytes()


def whole(tensor):
    """An FSDP2 parameter or gradient (a DTensor) gathered whole; any other tensor as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def changed_weights(before, after):
    """Names of the weights whose bytes changed, went missing (``-``) or appeared (``+``)."""
    changed = [name for name in before if name in after and not torch.equal(before[name], after[name])]
    return changed + [f"-{name}" for name in before if name not in after] + [
        f"+{name}" for name in after if name not in before]


class Contender:
    """One contender's model (loaded, LoRA added, wrapped, routed), its optimizer, its frozen weights
    as they were before training, and what its steps measured on this rank."""

    def __init__(self, name, folder, flavour):
        self.name = name
        gc.collect()  # the previous load's garbage in reference cycles, counted in neither model's memory
        before = torch.cuda.memory_allocated()
        model = bench.model.load_4bit(folder, torch.bfloat16, device_map={"": torch.cuda.current_device()},
                                     quant_storage=torch.bfloat16)
        self.vocab_size = model.config.vocab_size  # the batches' token range: the saved model's own
        torch.manual_seed(0)  # every contender's LoRA starts from the same weights
        model = bench.model.add_lora(model)
        # LoRA weights in bf16 like the rest: PEFT casts a layer's input to its adapter's dtype, read
        # outside the adapter's FSDP unit (the fp32 shard) while FSDP computes in bf16 inside it.
        for parameter in model.parameters():
            if parameter.requires_grad:
                parameter.data = parameter.data.to(torch.bfloat16)
        self.model = wrap(model, flavour)
        if name.split(" ")[0] != "bitsandbytes":
            dropin.enable(self.model)
        gc.collect()  # the load's own garbage in reference cycles: not the model's
        self.resident_bytes = torch.cuda.memory_allocated() - before
        self.frozen = frozen_weights(self.model)
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.trainable, lr=1e-4)
        self.losses, self.seconds, self.grads, self.step_peak_bytes, self.plans = [], [], None, 0, {}

    def step(self, ids, world):
        """One timed training step on ``ids``: its seconds, its peak above what was allocated before
        it, the loss averaged over ranks, and the first step's LoRA gradients."""
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        start = time.perf_counter()
        loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        if self.grads is None:
            self.grads = [whole(p.grad.detach()).clone() for p in self.trainable if p.grad is not None]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        self.seconds.append(time.perf_counter() - start)
        self.step_peak_bytes = max(self.step_peak_bytes, torch.cuda.max_memory_allocated() - before)
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        self.losses.append(mean.item() / world)

    def changed_frozen_weights(self):
        """Names of the frozen weights whose bytes differ from before training (``changed_weights``)."""
        return changed_weights(self.frozen, frozen_weights(self.model))

    def checked_steps(self, steps, first_step, rank, tokens):
        """``steps`` more training steps, every dequantization checked; their plan columns."""
        checked = CheckedDequantize()
        dropin.disable(self.model)
        dropin.enable(self.model, dequantize=checked)
        device = torch.device("cuda", torch.cuda.current_device())
        for step in range(first_step, first_step + steps):
            ids = batch(step, rank, tokens, self.vocab_size, device)
            self.model(input_ids=ids, labels=ids).loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return dict(plan_calls=checked.calls, plan_misses=checked.misses, stale_results=checked.stale,
                    most_live_plans=checked.most_plans, live_plans_after=kernel.PLANS.stats()["live"])


def run_size(size, folder, args, rank, world, first):
    """Every contender at one size, side by side; returns (CSV rows, loss rows), each row naming
    every rank's memory, frozen-shard and plan numbers."""
    # bitsandbytes twice: its own run-to-run spread in bf16 is the yardstick for ours
    names = list(CONTENDERS) + ["bitsandbytes (again)"]
    contenders = [Contender(name, folder, args.fsdp) for name in names]
    ours = next(contender for contender in contenders if contender.name == "nf4-triton")
    vocab = ours.vocab_size
    device = torch.device("cuda", torch.cuda.current_device())
    kept = kernel.PLANS.stats()["kept"]
    for step in range(args.steps):
        ids = batch(step, rank, size.tokens, vocab, device)
        turn = step % len(contenders)  # the order turns each step: no contender always goes first
        for contender in contenders[turn:] + contenders[:turn]:
            contender.step(ids, world)
    # Only the drop-in keeps plans: the first step of each layer makes its plan, so more kept than
    # the layers' count is a later call that missed one.
    plans = kernel.PLANS.stats()
    ours.plans.update(timed_plan_misses=plans["kept"] - kept, timed_live_plans=plans["live"])
    changed = {contender.name: contender.changed_frozen_weights() for contender in contenders}
    if first and args.plan_steps:
        ours.plans.update(ours.checked_steps(args.plan_steps, args.steps, rank, size.tokens))
    reference = contenders[0]
    tokens = world * size.tokens[0] * size.tokens[1]
    rows, losses = [], []
    for contender in contenders:
        equal, largest, first_differing = compare_losses(reference.losses, contender.losses)
        grads = list(zip(reference.grads, contender.grads))
        gathered = [None] * world
        torch.distributed.all_gather_object(gathered, dict(
            resident=contender.resident_bytes / 2**20, peak=contender.step_peak_bytes / 2**20,
            changed=changed[contender.name], grads=all(torch.equal(a, b) for a, b in grads),
            grad_diff=max((a.float() - b.float()).abs().max().item() for a, b in grads), plans=contender.plans))
        median, p20, p80 = bench.timing.summarize(contender.seconds[WARMUP_STEPS:])
        row = dict(gpu=torch.cuda.get_device_name(), world_size=world, timestamp=bench.results.utc_timestamp(),
                   **bench.results.version_columns(PACKAGES), model=size.name, implementation=contender.name,
                   fsdp=FSDP_FLAVOURS[args.fsdp], steps=args.steps, tokens_per_step=tokens, vocab_size=vocab,
                   median_step_ms=median * 1e3, p20_step_ms=p20 * 1e3, p80_step_ms=p80 * 1e3,
                   tokens_per_s=tokens / median,
                   resident_mib_per_rank=" ".join(f"{g['resident']:.0f}" for g in gathered),
                   step_peak_mib_per_rank=" ".join(f"{g['peak']:.0f}" for g in gathered),
                   losses_equal_bitsandbytes=equal, loss_max_diff=largest, first_differing_step=first_differing,
                   lora_grads_equal_bitsandbytes=all(g["grads"] for g in gathered),
                   lora_grad_max_diff=max(g["grad_diff"] for g in gathered),
                   frozen_shards_unchanged=not any(g["changed"] for g in gathered),
                   frozen_changed_or_added=" | ".join(f"rank {index}: {' '.join(g['changed'])}"
                                                      for index, g in enumerate(gathered) if g["changed"])[:500])
        for key in PLAN_COLUMNS:
            values = [g["plans"].get(key) for g in gathered]
            row[key] = "" if values[0] is None else " ".join(map(str, values))
        rows.append(row)
        losses += loss_rows(args.fsdp, size.name, contender.name, contender.losses)
        if rank == 0:
            print(f"{size.name} {contender.name}: {row['median_step_ms']:.1f} ms/step, {row['tokens_per_s']:.0f} "
                  f"tokens/s, resident {row['resident_mib_per_rank']} MiB, step peak {row['step_peak_mib_per_rank']} "
                  f"MiB, losses equal {equal} (max diff {largest:.3g}), LoRA grads equal "
                  f"{row['lora_grads_equal_bitsandbytes']} (max diff {row['lora_grad_max_diff']:.3g}), frozen shards "
                  f"unchanged {row['frozen_shards_unchanged']} {row['frozen_changed_or_added'][:200]}"
                  + (f", timed steps: {row['timed_plan_misses']} plans made, {row['timed_live_plans']} live"
                     if row["timed_plan_misses"] else "")
                  + (f", checked: {row['plan_calls']} calls, {row['plan_misses']} misses, {row['stale_results']} "
                     f"stale, at most {row['most_live_plans']} live" if row["plan_calls"] else ""), flush=True)
    return rows, losses


def main(argv=None):
    args = parse_args(argv)
    torch.distributed.init_process_group("nccl")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    root = tempfile.mkdtemp() if rank == 0 else None
    shared = [root]
    torch.distributed.broadcast_object_list(shared)
    root = shared[0]
    rows, losses = [], []
    results = bench.results.results_folder(args.out)
    for index, size in enumerate(args.sizes):
        folder = os.path.join(root, size.name)
        if rank == 0:
            bench.model.save_random_llama(size.shape, folder, vocab_size=size.vocab_size, layers=size.layers)
        torch.distributed.barrier()
        size_rows, size_losses = run_size(size, folder, args, rank, world, first=index == 0)
        rows += size_rows
        losses += size_losses
        if rank == 0:  # after every size: a run stopped in a later one keeps the sizes done
            shutil.rmtree(folder)  # every rank loaded its models: run_size's all_gather_object waited for them
            os.makedirs(results, exist_ok=True)
            for name, table in ((f"fsdp{args.fsdp}.csv", rows), (f"fsdp{args.fsdp}_losses.csv", losses)):
                bench.results.write_csv(os.path.join(results, name), table)
            print("wrote", results, flush=True)
        gc.collect()  # the models' reference cycles (their plans go with them), before the next size loads
        torch.cuda.empty_cache()
    if rank == 0:
        os.rmdir(root)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
