"""bench/bench.fsdp_qlora.py: its arguments and sizes, its CSV's version columns, loss comparison and loss chart on
the CPU; the two-GPU run itself where two GPUs are present (a short run: every frozen shard unchanged,
no stale plan, plans bounded)."""

import csv
import os
import shutil
import subprocess
import sys

import pytest
import torch

import bench.fsdp_qlora
import bench.model
import bench.plots
import bench.results

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_arguments():
    args = bench.fsdp_qlora.parse_args([])
    assert [size.name for size in args.sizes] == ["2048x5632x4", "4096x14336x2", "4096x14336x8@2x2048"]
    assert args.steps == 20 and args.plan_steps == 1000 and args.fsdp == 1
    args = bench.fsdp_qlora.parse_args(["--sizes", "4096x14336x2", "--steps", "3", "--fsdp", "2"])
    assert [size.name for size in args.sizes] == ["4096x14336x2"] and args.steps == 3 and args.fsdp == 2


def test_sizes():
    """bench.model's models as committed, a shape with other layers, and real-size models spelled
    with their tokens per rank and step (Llama-3's vocabulary)."""
    Size = bench.fsdp_qlora.Size
    assert bench.fsdp_qlora.parse_size("2048x5632x4") == Size("2048x5632x4", "2048x5632x4", 4, (4, 512), 32000)
    assert bench.fsdp_qlora.parse_size("4096x14336x2") == Size("4096x14336x2", "4096x14336x2", 2, (4, 512), 32000)
    assert bench.fsdp_qlora.parse_size("2048x5632x1") == Size("2048x5632x1", "2048x5632x4", 1, (4, 512), 32000)
    assert bench.fsdp_qlora.parse_size("4096x14336x8@2x2048") == Size(
        "4096x14336x8@2x2048", "4096x14336x2", 8, (2, 2048), 128256)
    assert bench.model.LLAMA3_VOCAB == 128256  # Llama-3's, as bench/serve.py loads it
    assert bench.fsdp_qlora.parse_size("2048x5632x4@1x2").tokens == (1, 2)


@pytest.mark.parametrize("size, error", [
    ("7b", "is not HIDDENxINTERMEDIATExLAYERS"), ("4096x1433x2", "no shape 4096x1433"),
    ("1024x4096x2", "no shape 1024x4096"), ("4096x14336", "is not"), ("4096x14336x0", "at least one decoder layer"),
    ("4096x14336x8@2x4096", "sequence from 2 to 2048"), ("4096x14336x8@0x512", "batch must be at least 1"),
    ("4096x14336x8@2x1", "sequence from 2"), ("4096x14336x8@2048", "is not"), ("4096x14336x8@2x", "is not"),
    ("4096x14336x8@", "is not"), ("4096x14336x8@2x512x1", "is not")])
def test_bad_sizes(size, error):
    with pytest.raises(ValueError, match=error):
        bench.fsdp_qlora.parse_size(size)


@pytest.mark.parametrize("argv", [
    ["--sizes", "7b"], ["--sizes", "1024x4096x2"], ["--sizes", "4096x14336x8@2x4096"], ["--sizes", "4096x14336x8@2"],
    ["--sizes", "2048x5632x4,2048x5632x4"], ["--sizes", "2048x5632x4,"], ["--steps", "1"], ["--steps", "2"],
    ["--plan-steps", "-1"], ["--fsdp", "3"]])
def test_bad_arguments(argv):
    with pytest.raises(SystemExit):
        bench.fsdp_qlora.parse_args(argv)


@pytest.mark.parametrize("flavour", [1, 2])
def test_committed_run_is_complete(flavour):
    """The committed run of each flavour: its version columns in order, every default size with every
    contender, and the frozen-weight check filled for each row."""
    with open(os.path.join(ROOT, "results", "nvidia-h100-80gb-hbm3", f"fsdp{flavour}.csv"), newline="") as handle:
        header = next(csv.reader(handle))
        handle.seek(0)
        rows = list(csv.DictReader(handle))
    columns = list(bench.results.version_columns(bench.fsdp_qlora.PACKAGES))
    assert header[3:3 + len(columns)] == columns
    names = ["bitsandbytes", "nf4-triton", "bitsandbytes (again)"]
    assert [(row["model"], row["implementation"]) for row in rows] == [
        (size.name, name) for size in bench.fsdp_qlora.parse_args([]).sizes for name in names]
    assert {row["fsdp"] for row in rows} == {bench.fsdp_qlora.FSDP_FLAVOURS[flavour]}
    # What the README states of the run: every frozen weight unchanged, every checked call served and equal
    assert all(row["frozen_shards_unchanged"] == "True" and not row["frozen_changed_or_added"] for row in rows)
    (checked,) = [row for row in rows if row["plan_calls"]]
    assert checked["implementation"] == "nf4-triton" and checked["model"] == rows[0]["model"]
    assert checked["plan_misses"] == checked["stale_results"] == "0 0"


def test_compare_losses():
    assert bench.fsdp_qlora.compare_losses([2.5, 2.25], [2.5, 2.25]) == (True, 0.0, None)
    assert bench.fsdp_qlora.compare_losses([2.5, 2.25, 2.0], [2.5, 2.5, 2.0]) == (False, 0.25, 1)
    with pytest.raises(ValueError, match="2 against 1 steps"):
        bench.fsdp_qlora.compare_losses([1.0, 2.0], [1.0])


def test_loss_chart(tmp_path):
    """fsdp_losses.png from the two flavours' CSVs, a panel per flavour and size (one flavour ran one
    size fewer); nothing from a folder without them, nor from a loss file without its run's CSV."""
    pytest.importorskip("matplotlib")
    pytest.importorskip("pandas")
    assert bench.plots.plot_fsdp(str(tmp_path)) == [] and bench.plots.plot(str(tmp_path)) == []
    meta = dict(gpu="NVIDIA H100 80GB HBM3", world_size=2, timestamp="2026-11-25T00:00:00+00:00",
                **bench.results.version_columns(bench.fsdp_qlora.PACKAGES))
    for flavour, sizes in ((1, ["2048x5632x4", "4096x14336x8@2x2048"]), (2, ["2048x5632x4"])):
        names = ["bitsandbytes", "nf4-triton", "bitsandbytes (again)"]
        bench.results.write_csv(tmp_path / f"fsdp{flavour}_losses.csv", [
            row for size in sizes for name in names
            for row in bench.fsdp_qlora.loss_rows(flavour, size, name, [11.0 - step / 8 for step in range(20)])])
        if flavour == 1:
            assert bench.plots.plot_fsdp(str(tmp_path)) == []  # a loss file without its run's CSV
        bench.results.write_csv(tmp_path / f"fsdp{flavour}.csv", [
            dict(meta, model=size, implementation=name, fsdp=bench.fsdp_qlora.FSDP_FLAVOURS[flavour])
            for size in sizes for name in names])
    written = bench.plots.plot(str(tmp_path))
    assert written == [str(tmp_path / "fsdp_losses.png")] and os.path.getsize(written[0]) > 10_000


def test_changed_weights():
    """Bytes compared, so a packed weight whose bf16 view holds a NaN equals itself; a changed,
    missing or new weight is named."""
    packed = torch.tensor([0x7FC1, 0x0001, -0x0080], dtype=torch.int16).view(torch.bfloat16)  # a NaN first
    before = {"a": packed.view(torch.uint8).clone(), "b": torch.zeros(4, dtype=torch.uint8)}
    assert bench.fsdp_qlora.changed_weights(before, {name: t.clone() for name, t in before.items()}) == []
    after = {"a": before["a"].clone(), "c": before["b"].clone()}
    after["a"][0] ^= 1
    assert bench.fsdp_qlora.changed_weights(before, after) == ["a", "-b", "+c"]


def test_whole_gathers_only_sharded_tensors():
    """FSDP2's parameters and gradients are DTensors, gathered whole; FSDP1's are plain tensors, kept."""

    class Sharded:
        def full_tensor(self):
            return "gathered"

    plain = torch.arange(3)
    assert bench.fsdp_qlora.whole(plain) is plain and bench.fsdp_qlora.whole(Sharded()) == "gathered"


@pytest.mark.gpu(2)
@pytest.mark.parametrize("flavour", ["1", "2"], ids=["FSDP1", "FSDP2"])
def test_two_gpu_run(flavour, tmp_path):
    torchrun = shutil.which("torchrun") or [sys.executable, "-m", "torch.distributed.run"]
    command = ([torchrun] if isinstance(torchrun, str) else torchrun) + [
        "--nproc_per_node", "2", os.path.join(ROOT, "bench/bench.fsdp_qlora.py"), "--sizes", "2048x5632x4", "--steps", "3",
        "--plan-steps", "5", "--fsdp", flavour, "--out", str(tmp_path)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    (folder,) = [os.path.join(tmp_path, name) for name in os.listdir(tmp_path)]
    assert sorted(os.listdir(folder)) == [f"fsdp{flavour}.csv", f"fsdp{flavour}_losses.csv"]
    rows = list(csv.DictReader(open(os.path.join(folder, f"fsdp{flavour}.csv"))))
    names = ["bitsandbytes", "nf4-triton", "bitsandbytes (again)"]
    assert [row["implementation"] for row in rows] == names
    assert all(row["frozen_shards_unchanged"] == "True" for row in rows), [
        (row["implementation"], row["frozen_changed_or_added"][:300]) for row in rows]
    memory = [(row["resident_mib_per_rank"], row["step_peak_mib_per_rank"]) for row in rows]
    assert all(int(mib) > 0 for resident, peak in memory for mib in resident.split() + peak.split()), memory
    ours = next(row for row in rows if row["implementation"] == "nf4-triton")
    assert ours["stale_results"] == "0 0"
    layers = 4 * 7  # one plan per quant state: the model's Linear4bit layers, at most
    assert all(int(count) <= layers for count in ours["most_live_plans"].split())
    # The first step of each layer makes its plan, every later call is served (NOTES 56: 0 misses in 53,000).
    assert ours["timed_plan_misses"] == ours["timed_live_plans"] == f"{layers} {layers}"
    losses = list(csv.DictReader(open(os.path.join(folder, f"fsdp{flavour}_losses.csv"))))
    assert [(row["implementation"], row["step"]) for row in losses] == [(name, str(step)) for name in names
                                                                         for step in range(3)]
    assert {row["fsdp"] for row in losses} == {rows[0]["fsdp"]}
