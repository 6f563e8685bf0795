"""fsdp_qlora.py: its arguments, its CSV's version columns and loss comparison on the CPU; the
two-GPU run itself where two GPUs are present (a short run: every frozen shard unchanged, no stale
plan, plans bounded)."""

import csv
import os
import shutil
import subprocess
import sys

import pytest
import torch

import bench_results
import fsdp_qlora

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_arguments():
    args = fsdp_qlora.parse_args([])
    assert args.sizes == ["2048x5632x4", "4096x14336x2"] and args.steps == 20 and args.plan_steps == 1000
    assert fsdp_qlora.parse_args(["--sizes", "4096x14336x2", "--steps", "3"]).sizes == ["4096x14336x2"]
    assert args.fsdp == 1 and fsdp_qlora.parse_args(["--fsdp", "2"]).fsdp == 2


@pytest.mark.parametrize("argv", [["--sizes", "7b"], ["--steps", "1"], ["--plan-steps", "-1"], ["--fsdp", "3"]])
def test_bad_arguments(argv):
    with pytest.raises(SystemExit):
        fsdp_qlora.parse_args(argv)


def test_version_columns_as_committed():
    """fsdp.csv's version columns, in the committed run's order."""
    with open(os.path.join(ROOT, "results", "nvidia-h200", "fsdp.csv"), newline="") as handle:
        header = next(csv.reader(handle))
    columns = list(bench_results.version_columns(fsdp_qlora.PACKAGES))
    assert header[3:3 + len(columns)] == columns


def test_compare_losses():
    assert fsdp_qlora.compare_losses([2.5, 2.25], [2.5, 2.25]) == (True, 0.0, None)
    assert fsdp_qlora.compare_losses([2.5, 2.25, 2.0], [2.5, 2.5, 2.0]) == (False, 0.25, 1)
    with pytest.raises(ValueError, match="2 against 1 steps"):
        fsdp_qlora.compare_losses([1.0, 2.0], [1.0])


def test_changed_weights():
    """Bytes compared, so a packed weight whose bf16 view holds a NaN equals itself; a changed,
    missing or new weight is named."""
    packed = torch.tensor([0x7FC1, 0x0001, -0x0080], dtype=torch.int16).view(torch.bfloat16)  # a NaN first
    before = {"a": packed.view(torch.uint8).clone(), "b": torch.zeros(4, dtype=torch.uint8)}
    assert fsdp_qlora.changed_weights(before, {name: t.clone() for name, t in before.items()}) == []
    after = {"a": before["a"].clone(), "c": before["b"].clone()}
    after["a"][0] ^= 1
    assert fsdp_qlora.changed_weights(before, after) == ["a", "-b", "+c"]


def test_whole_gathers_only_sharded_tensors():
    """FSDP2's parameters and gradients are DTensors, gathered whole; FSDP1's are plain tensors, kept."""

    class Sharded:
        def full_tensor(self):
            return "gathered"

    plain = torch.arange(3)
    assert fsdp_qlora.whole(plain) is plain and fsdp_qlora.whole(Sharded()) == "gathered"


@pytest.mark.gpu(2)
@pytest.mark.parametrize("flavour", ["1", "2"], ids=["FSDP1", "FSDP2"])
def test_two_gpu_run(flavour, tmp_path):
    torchrun = shutil.which("torchrun") or [sys.executable, "-m", "torch.distributed.run"]
    command = ([torchrun] if isinstance(torchrun, str) else torchrun) + [
        "--nproc_per_node", "2", os.path.join(ROOT, "fsdp_qlora.py"), "--sizes", "2048x5632x4", "--steps", "3",
        "--plan-steps", "5", "--fsdp", flavour, "--out", str(tmp_path)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    (folder,) = [os.path.join(tmp_path, name) for name in os.listdir(tmp_path)]
    rows = list(csv.DictReader(open(os.path.join(folder, "fsdp.csv"))))
    assert {row["implementation"] for row in rows} == {"bitsandbytes", "nf4-triton", "bitsandbytes (again)"}
    assert all(row["frozen_shards_unchanged"] == "True" for row in rows), [
        (row["implementation"], row["frozen_changed_or_added"][:300]) for row in rows]
    ours = next(row for row in rows if row["implementation"] == "nf4-triton")
    assert ours["stale_results"] == "0 0"
    layers = 4 * 7  # one plan per quant state: the model's Linear4bit layers, at most
    assert all(int(count) <= layers for count in ours["most_live_plans"].split())
