"""QLoRA under FSDP on several GPUs: bitsandbytes' own Linear4bit against the drop-in, one job.

    torchrun --nproc_per_node 2 fsdp_qlora.py [--sizes 2048x5632x4,4096x14336x2] [--steps 20]
                                              [--plan-steps 1000] [--fsdp 1|2] [--out results]

The path PEFT, Accelerate and TRL document for FSDP QLoRA: the model of modelbench.py (random
weights saved offline) loaded in 4-bit NF4 with ``bnb_4bit_quant_storage=torch.bfloat16`` so that
FSDP can flatten and shard the packed bytes with the rest, PEFT LoRA r=16 on every linear layer,
FSDP (PyTorch's FSDP1, ``use_orig_params=False``, PEFT's ``fsdp_auto_wrap_policy``: each decoder
layer a unit, each LoRA layer a unit of its own, bf16 mixed precision; ``--fsdp 2``: FSDP2's
``fully_shard`` on each decoder layer and the root, bf16 parameters and reductions), AdamW, fixed random token
batches (each rank its own), LoRA weights in bf16. Each contender trains from the same LoRA initialisation on the same
batches: losses per step and the first step's LoRA gradients are compared, and every rank's frozen
shards (the 4-bit weights among them) must be bit-for-bit what they were before training. Then the
drop-in trains ``--plan-steps`` more steps with every dequantization checked against the validating
path, counting launch plans (live, made) and calls that missed one.
"""

import argparse
import gc
import os
import tempfile
import time

import torch

import bench_results
import bench_timing
import dropin
import kernel
import modelbench

CONTENDERS = ("bitsandbytes", "nf4-triton")
TOKENS = (4, 512)  # per rank and step
# Versions in each row: Unsloth is not a contender here and is not imported.
PACKAGES = ("torch", "triton", "bitsandbytes", "transformers", "peft")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default=",".join(modelbench.SIZES),
                        help=f"comma-separated model sizes from {','.join(modelbench.SIZES)}")
    parser.add_argument("--steps", type=int, default=20, help="training steps per contender")
    parser.add_argument("--plan-steps", type=int, default=1000,
                        help="more steps with the drop-in, every dequantization checked (first size only)")
    parser.add_argument("--fsdp", type=int, choices=(1, 2), default=1,
                        help="1: FullyShardedDataParallel (use_orig_params=False); 2: fully_shard")
    parser.add_argument("--out", default="results", help="folder for CSVs (a per-GPU subfolder is made)")
    args = parser.parse_args(argv)
    args.sizes = args.sizes.split(",")
    unknown = set(args.sizes) - set(modelbench.SIZES)
    if unknown:
        parser.error(f"unknown sizes {sorted(unknown)}; choose from {','.join(modelbench.SIZES)}")
    if args.steps < 2 or args.plan_steps < 0:
        parser.error("--steps must be at least 2 and --plan-steps at least 0")
    return args


def compare_losses(reference, other):
    """Per-step losses of two runs: (all equal, largest absolute difference, first step that differs)."""
    if len(reference) != len(other):
        raise ValueError(f"compare_losses: {len(reference)} against {len(other)} steps")
    differences = [abs(a - b) for a, b in zip(reference, other)]
    first = next((step for step, (a, b) in enumerate(zip(reference, other)) if a != b), None)
    return first is None, max(differences, default=0.0), first


def batch(step, rank, vocab_size, device):
    generator = torch.Generator(device).manual_seed(1000 * step + rank)
    return torch.randint(0, vocab_size, TOKENS, device=device, generator=generator)


FSDP_FLAVOURS = {1: "FSDP1 use_orig_params=False", 2: "FSDP2 fully_shard"}


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
        expected = kernel.dequantize_nf4(packed, quant_state, out=torch.empty(got.shape, dtype=got.dtype, device=got.device))
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


def train(folder, contender, steps, rank, world, plan_steps=0, flavour=1):
    """One contender's run; returns its record (rank's own numbers)."""
    model = modelbench.load_4bit(folder, torch.bfloat16, device_map={"": rank}, quant_storage=torch.bfloat16)
    torch.manual_seed(0)
    model = modelbench.add_lora(model)
    # LoRA weights in bf16 like the rest: PEFT casts a layer's input to its adapter's dtype, read
    # outside the adapter's FSDP unit (the fp32 shard) while FSDP computes in bf16 inside it.
    for parameter in model.parameters():
        if parameter.requires_grad:
            parameter.data = parameter.data.to(torch.bfloat16)
    model = wrap(model, flavour)
    if contender != "bitsandbytes":
        dropin.enable(model)
    frozen = frozen_weights(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    vocab = modelbench.llama_config(modelbench_size(folder)).vocab_size
    device = torch.device("cuda", torch.cuda.current_device())
    losses, seconds, grads = [], [], None
    torch.cuda.reset_peak_memory_stats()
    start_bytes = torch.cuda.memory_allocated()
    for step in range(steps):
        ids = batch(step, rank, vocab, device)
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if step == 0:
            grads = [whole(p.grad.detach()).clone() for p in trainable if p.grad is not None]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        losses.append(mean.item() / world)
    median, p20, p80 = bench_timing.summarize(seconds[2:])  # the first two steps warm up
    # Peak above what the wrapped model, its optimizer and the batch held before the first step.
    record = dict(losses=losses, grads=grads, peak_mib=(torch.cuda.max_memory_allocated() - start_bytes) / 2**20,
                  step_ms=median * 1e3, step_ms_p20=p20 * 1e3, step_ms_p80=p80 * 1e3)
    changed = changed_weights(frozen, frozen_weights(model))
    record["shards_unchanged"] = not changed
    record["frozen_changed_or_added"] = " ".join(changed)
    if plan_steps:
        checked = CheckedDequantize()
        dropin.disable(model)
        dropin.enable(model, dequantize=checked)
        for step in range(plan_steps):
            ids = batch(steps + step, rank, vocab, device)
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        record.update(plan_calls=checked.calls, plan_misses=checked.misses, stale_results=checked.stale,
                      most_live_plans=checked.most_plans, live_plans_after=kernel.PLANS.stats()["live"])
    del model, optimizer
    gc.collect()  # the model's reference cycles, before the next run's peak is measured
    torch.cuda.empty_cache()
    return record


def main(argv=None):
    args = parse_args(argv)
    torch.distributed.init_process_group("nccl")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    root = tempfile.mkdtemp() if rank == 0 else None
    shared = [root]
    torch.distributed.broadcast_object_list(shared)
    root = shared[0]
    rows, loss_rows = [], []
    for index, size in enumerate(args.sizes):
        folder = os.path.join(root, size)
        if rank == 0:
            modelbench.save_random_llama(size, folder)
        torch.distributed.barrier()
        records = {}
        runs = list(CONTENDERS) + (["bitsandbytes (again)"] if index == 0 else [])
        for contender in runs:
            plan_steps = args.plan_steps if contender == "nf4-triton" and index == 0 else 0
            records[contender] = train(folder, contender.split(" ")[0], args.steps, rank, world, plan_steps,
                                       args.fsdp)
        reference = records["bitsandbytes"]
        for contender, record in records.items():
            equal, largest, first = compare_losses(reference["losses"], record["losses"])
            grads_equal = all(torch.equal(a, b) for a, b in zip(reference["grads"], record["grads"]))
            grad_diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(reference["grads"], record["grads"]))
            gathered = [None] * world
            torch.distributed.all_gather_object(gathered, dict(peak=record["peak_mib"], shards=record["shards_unchanged"],
                                                               changed=record["frozen_changed_or_added"],
                                                               grads=grads_equal, grad_diff=grad_diff,
                                                               plans={k: record.get(k) for k in (
                                                                   "plan_calls", "plan_misses", "stale_results",
                                                                   "most_live_plans", "live_plans_after")}))
            row = dict(gpu=torch.cuda.get_device_name(), world_size=world, timestamp=bench_results.utc_timestamp(),
                       **bench_results.version_columns(PACKAGES), model=size, implementation=contender,
                       fsdp=FSDP_FLAVOURS[args.fsdp], steps=args.steps, tokens_per_step=world * TOKENS[0] * TOKENS[1],
                       median_step_ms=record["step_ms"], p20_step_ms=record["step_ms_p20"],
                       p80_step_ms=record["step_ms_p80"],
                       tokens_per_s=world * TOKENS[0] * TOKENS[1] / record["step_ms"] * 1e3,
                       peak_above_start_mib_per_rank=" ".join(f"{g['peak']:.0f}" for g in gathered),
                       losses_equal_bitsandbytes=equal, loss_max_diff=largest, first_differing_step=first,
                       lora_grads_equal_bitsandbytes=all(g["grads"] for g in gathered),
                       lora_grad_max_diff=max(g["grad_diff"] for g in gathered),
                       frozen_shards_unchanged=all(g["shards"] for g in gathered),
                       frozen_changed_or_added=" | ".join(g["changed"] for g in gathered)[:500])
            for key in ("plan_calls", "plan_misses", "stale_results", "most_live_plans", "live_plans_after"):
                values = [g["plans"][key] for g in gathered]
                row[key] = "" if values[0] is None else " ".join(map(str, values))
            rows.append(row)
            loss_rows += [dict(model=size, implementation=contender, step=step, loss=loss)
                          for step, loss in enumerate(record["losses"])]
            if rank == 0:
                print(f"{size} {contender}: {record['step_ms']:.1f} ms/step, {row['tokens_per_s']:.0f} tokens/s, "
                      f"peak {row['peak_above_start_mib_per_rank']} MiB, losses equal {equal} (max diff {largest:.3g}), "
                      f"LoRA grads equal {row['lora_grads_equal_bitsandbytes']} (max diff {row['lora_grad_max_diff']:.3g}), "
                      f"frozen shards unchanged {row['frozen_shards_unchanged']} {row['frozen_changed_or_added'][:200]}"
                      + (f", plans: {row['plan_calls']} calls, {row['plan_misses']} misses, "
                         f"{row['stale_results']} stale, at most {row['most_live_plans']} live" if row["plan_calls"] else ""),
                      flush=True)
    if rank == 0:
        folder = bench_results.results_folder(args.out)
        os.makedirs(folder, exist_ok=True)
        for name, table in (("fsdp.csv", rows), ("fsdp_losses.csv", loss_rows)):
            bench_results.write_csv(os.path.join(folder, name), table)
        print("wrote", folder)
    torch.distributed.destroy_process_group()


def modelbench_size(folder):
    return os.path.basename(folder.rstrip(os.sep))


if __name__ == "__main__":
    main()
