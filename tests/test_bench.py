"""The benchmark module's CPU behaviour: the no-GPU demo and the charts from a results folder."""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
RESULTS = os.path.join(ROOT, "results", "nvidia-h100-80gb-hbm3")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the demo runs only without a GPU")
def test_without_gpu_runs_the_demo():
    result = subprocess.run([sys.executable, os.path.join(ROOT, "bench.py"), "--quick"], capture_output=True,
                            text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "No CUDA GPU" in result.stdout
    assert "bit-exact with bitsandbytes: True" in result.stdout


def test_charts_from_results(tmp_path):
    pytest.importorskip("matplotlib")
    pytest.importorskip("pandas")
    sys.path.insert(0, ROOT)
    import bench

    for name in ("bench.csv", "sweep.csv"):
        shutil.copy(os.path.join(RESULTS, name), tmp_path / name)
    written = bench.plot(str(tmp_path))
    assert [os.path.basename(path) for path in written] == ["kernel_roofline.png", "sweep.png"]
    assert all(os.path.getsize(path) > 10_000 for path in written)


def test_best_launch_config_from_the_sweep():
    """The notebooks' pick: the all-on configuration with the smallest geometric-mean slowdown, read
    from the sweep's rows (a faster configuration with the inline PTX off is not a candidate)."""
    import csv

    sys.path.insert(0, ROOT)
    import bench
    import kernel

    labels = {bench.config_label(config): config for config in bench.SWEEP_CONFIGS}
    fast = "bpp=1024 warps=4 asm=True hints=True tables=global loads=auto"
    slow = "bpp=512 warps=2 asm=True hints=True tables=global loads=auto"
    no_asm = next(label for label in labels if "asm=False" in label)
    rows = [dict(kind="sweep-gpu", shape=shape, dtype="fp16", implementation=label, median_us=us)
            for shape in ("4096x1024", "8192x2048") for label, us in ((fast, 10.0), (slow, 11.0), (no_asm, 9.0))]
    best, label, slowdown = bench.best_launch_config(rows)
    assert (best, label) == (kernel.LaunchConfig(1024, 4, False), fast) and slowdown == pytest.approx(10 / 9)
    with open(os.path.join(RESULTS, "sweep.csv")) as handle:
        committed = [dict(row, median_us=float(row["median_us"])) for row in csv.DictReader(handle)]
    best, label, slowdown = bench.best_launch_config(committed)
    assert label in labels and best.bytes_per_program == labels[label]["BYTES_PER_PROGRAM"] and slowdown >= 1


@pytest.mark.gpu
def test_gpu_times_per_callable():
    import torch

    sys.path.insert(0, ROOT)
    import bench
    import kernel

    packed, state = bench.make_weight((256, 128), torch.float16)
    x = torch.ones(4096, device="cuda")
    fns = {"ours": lambda: kernel.dequantize_nf4(packed, state), "x*2": lambda: x * 2}
    times = bench.gpu_times(fns, calls=5)
    assert list(times) == ["ours", "x*2"] and all(ms > 0 for ms in times.values())
    only = bench.gpu_times(fns, calls=5, only="dequantize_4bit_kernel")
    assert only["ours"] > 0 and only["x*2"] == 0
    with pytest.raises(RuntimeError, match="flushed calls with GPU work"):
        bench.gpu_times({"nothing": lambda: None}, calls=3)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(256, 192), (100, 64)])
def test_floor_kernel_reads_the_packed_bytes_and_the_absmax(shape):
    import torch

    sys.path.insert(0, ROOT)
    import bench

    packed, state = bench.make_weight(shape, torch.float16)
    out = bench.expand_floor(packed, state)
    summed = (packed.view(-1).to(torch.int32) + state.absmax.repeat_interleave(32).to(torch.int32)) & 0xFF
    expected = torch.stack((summed >> 4, summed & 0xF), dim=1).reshape(shape).to(torch.float16)
    assert torch.equal(out, expected)


@pytest.mark.gpu
def test_compiled_floor_matches_the_floor_kernel():
    """The compile section's floor: the same kernel inside a compiled graph, no graph break."""
    import torch
    from torch._dynamo.utils import counters

    sys.path.insert(0, ROOT)
    import bench

    packed, state = bench.make_weight((256, 192), torch.bfloat16)
    counters.clear()
    assert torch.equal(bench.compiled_floor(packed, state)(), bench.expand_floor(packed, state))
    assert not counters["graph_break"]
