"""The benchmarks' CPU behaviour: the no-GPU demo, the command's arguments, every module importable,
the CSVs written as the committed results have them, the charts from a results folder."""

import csv
import filecmp
import glob
import importlib
import os
import shutil
import subprocess
import sys

import pytest
import triton

import bench.contenders
import bench.matmul
import bench.plots
import bench.results
import bench.run
import bench.serve
import bench.sweep
import bench.timing
import bench.weights
from nf4_triton import kernel

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
RESULTS = os.path.join(ROOT, "results", "nvidia-h100-80gb-hbm3")


def csv_rows(path):
    """A CSV file's rows as dicts of strings."""
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the demo runs only without a GPU")
def test_without_gpu_runs_the_demo():
    result = subprocess.run([sys.executable, "-m", "bench", "--quick"], capture_output=True, text=True, timeout=600,
                            cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "No CUDA GPU" in result.stdout
    assert "bit-exact with bitsandbytes: True" in result.stdout


MODULES = sorted(os.path.relpath(path, ROOT)[:-len(".py")].replace(os.sep, ".").removesuffix(".__init__")
                 for folder in ("nf4_triton", "bench", "tools") for path in glob.glob(os.path.join(ROOT, folder, "*.py"))
                 if not path.endswith("__main__.py"))


@pytest.mark.parametrize("name", MODULES)
def test_every_module_imports(name):
    """The benchmarks' GPU code paths cannot run here: at least every module of the package, bench/ and tools/
    loads on the CPU, with a docstring; the Gluon kernels' modules where this Triton has Gluon's layouts (3.6 on),
    the only place the package imports them (``mma_layouts.AVAILABLE``)."""
    from nf4_triton import mma_layouts

    if name in ("nf4_triton.mma_helpers", "nf4_triton.mma_sync", "nf4_triton.wgmma") and not mma_layouts.AVAILABLE:
        pytest.skip(f"Triton {triton.__version__} has no Gluon layouts: the package does not import {name}")
    assert importlib.import_module(name).__doc__


def test_arguments():
    args = bench.run.parse_args([])
    assert args.sections == list(bench.run.DEFAULT_SECTIONS) and args.dtype == "all" and not args.quick
    assert bench.run.parse_args(["--sections", "model,forms", "--quick"]).sections == ["model", "forms"]
    with pytest.raises(SystemExit):
        bench.run.parse_args(["--sections", "kernels,everything"])


@pytest.mark.parametrize("name", bench.results.RESULT_FILES)
def test_results_written_as_committed(name, tmp_path):
    """A committed CSV's rows, written again, give the same bytes: the same columns in the same
    order, in the same file, and no other file from them (a roofline alone writes nothing)."""
    bench.results.write_results(csv_rows(os.path.join(RESULTS, name)), str(tmp_path))
    assert os.listdir(tmp_path) == [name]
    assert filecmp.cmp(os.path.join(RESULTS, name), tmp_path / name, shallow=False)


def test_rows_and_versions():
    meta = dict(gpu="a GPU", **bench.results.version_columns(("torch", "no_such_package")))
    assert meta["torch_version"] == __import__("torch").__version__
    assert meta["no_such_package_version"] == "unavailable (ModuleNotFoundError)"
    row = bench.results.timing_row(meta, "kernel", (4096, 1024), "fp16", "nf4-triton", (0.01, 0.009, 0.011), 2000.0)
    assert row["gbps"] == pytest.approx(bench.weights.bytes_moved((4096, 1024), bench.weights.DTYPES["fp16"]) / 1e4)
    assert (row["median_us"], row["shape"], row["pct_roofline"]) == (10.0, "4096x1024", pytest.approx(100 * row["gbps"] / 2000))
    assert bench.results.seconds_row(meta, "forms", "2x2", "bf16", "x", [3e-6, 1e-6, 2e-6])["median_us"] == pytest.approx(2.0)
    assert bench.timing.summarize([5, 1, 4, 2, 3]) == (3, 2, 4)
    assert bench.results.gpu_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"


def test_each_contender_takes_every_place_in_a_round_once():
    names = ["bitsandbytes", "nf4-triton", "unsloth-fused"]
    orders = [bench.timing.turned(names, round_index) for round_index in range(5)]
    assert [order[0] for order in orders] == names + names[:2]
    assert all(sorted(order) == sorted(names) for order in orders)
    for place in range(len(names)):
        assert sorted(order[place] for order in orders[:3]) == sorted(names)
    assert names == ["bitsandbytes", "nf4-triton", "unsloth-fused"]  # the caller's list is left as it was


def test_charts_from_results(tmp_path):
    pytest.importorskip("matplotlib")
    pytest.importorskip("pandas")
    for name in ("bench.csv", "sweep.csv", "model.csv"):
        shutil.copy(os.path.join(RESULTS, name), tmp_path / name)
    written = bench.plots.plot(str(tmp_path))
    assert [os.path.basename(path) for path in written] == ["kernel_roofline.png", "sweep.png", "model.png"]
    assert all(os.path.getsize(path) > 10_000 for path in written)


def test_serve_charts_without_the_loss_curves(tmp_path):
    """A bench.serve run of a few sections (``--sections decode --batches 1``, or ``--sections train,curves``)
    charts what it measured; one of sections the charts do not draw (``--sections merged``) draws none."""
    pd = pytest.importorskip("pandas")
    pytest.importorskip("matplotlib")
    rows = pd.read_csv(os.path.join(RESULTS, "serve_bf16.csv"))
    rows[rows["kind"] == "decode"].assign(kind="decode merged").to_csv(tmp_path / "serve_bf16.csv", index=False)
    assert bench.plots.plot_serve(str(tmp_path)) == []
    rows[rows["kind"] == "decode"].to_csv(tmp_path / "serve_bf16.csv", index=False)
    written = bench.plots.plot_serve(str(tmp_path))
    assert [os.path.basename(path) for path in written] == ["serve.png"]
    rows[rows["kind"].isin(["qlora-step", "qlora-step-checkpointed", "loss"])].to_csv(tmp_path / "serve_bf16.csv",
                                                                                       index=False)
    assert [os.path.basename(path) for path in bench.plots.plot_serve(str(tmp_path))] == ["serve.png", "serve_losses.png"]
    shutil.copy(os.path.join(RESULTS, "serve_bf16.csv"), tmp_path / "serve_bf16.csv")
    assert [os.path.basename(path) for path in bench.plots.plot_serve(str(tmp_path))] == ["serve.png", "serve_losses.png"]


def test_serve_rows_saved_as_measured(tmp_path):
    """bench.serve writes its CSV at each row, so a run stopped at a time limit keeps what it measured; a later
    section's new columns join the header."""
    path = tmp_path / "serve_bf16.csv"
    rows = bench.serve.SavedRows(str(path))
    rows.append(dict(kind="decode merged", tokens="1x128+128", median_ms=3.5))
    assert csv_rows(path) == [dict(kind="decode merged", tokens="1x128+128", median_ms="3.5")]
    rows.extend([dict(kind="decode merged", tokens="8x128+128", median_ms=4.5)])
    rows += [dict(kind="loss", tokens="2x512", step=0)]
    assert csv_rows(path) == [dict(kind="decode merged", tokens="1x128+128", median_ms="3.5", step=""),
                             dict(kind="decode merged", tokens="8x128+128", median_ms="4.5", step=""),
                             dict(kind="loss", tokens="2x512", median_ms="", step="0")]
    assert isinstance(rows, bench.serve.SavedRows) and len(rows) == 3


def test_best_launch_config_from_the_sweep():
    """The notebooks' pick: the all-on configuration with the smallest geometric-mean slowdown, read
    from the sweep's rows (a faster configuration with the inline PTX off is not a candidate)."""
    labels = {bench.sweep.config_label(config): config for config in bench.sweep.SWEEP_CONFIGS}
    fast = "bpp=1024 warps=4 asm=True hints=True tables=global loads=auto"
    slow = "bpp=512 warps=2 asm=True hints=True tables=global loads=auto"
    no_asm = next(label for label in labels if "asm=False" in label)
    rows = [dict(kind="sweep-gpu", shape=shape, dtype="fp16", implementation=label, median_us=us)
            for shape in ("4096x1024", "8192x2048") for label, us in ((fast, 10.0), (slow, 11.0), (no_asm, 9.0))]
    best, label, slowdown = bench.sweep.best_launch_config(rows)
    assert (best, label) == (kernel.LaunchConfig(1024, 4, False), fast) and slowdown == pytest.approx(10 / 9)
    committed = [dict(row, median_us=float(row["median_us"])) for row in csv_rows(os.path.join(RESULTS, "sweep.csv"))]
    best, label, slowdown = bench.sweep.best_launch_config(committed)
    assert label in labels and best.bytes_per_program == labels[label]["BYTES_PER_PROGRAM"] and slowdown >= 1


@pytest.mark.gpu
def test_gpu_times_per_callable():
    import torch

    packed, state = bench.weights.make_weight((256, 128), torch.float16)
    x = torch.ones(4096, device="cuda")
    fns = {"ours": lambda: kernel.dequantize_nf4(packed, state), "x*2": lambda: x * 2}
    times = bench.timing.gpu_times(fns, calls=5)
    assert list(times) == ["ours", "x*2"] and all(ms > 0 for ms in times.values())
    only = bench.timing.gpu_times(fns, calls=5, only="dequantize_4bit_kernel")
    assert only["ours"] > 0 and only["x*2"] == 0
    with pytest.raises(RuntimeError, match="flushed calls with GPU work"):
        bench.timing.gpu_times({"nothing": lambda: None}, calls=3)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(256, 192), (100, 64)])
def test_floor_kernel_reads_the_packed_bytes_and_the_absmax(shape):
    import torch

    packed, state = bench.weights.make_weight(shape, torch.float16)
    out = bench.contenders.expand_floor(packed, state)
    summed = (packed.view(-1).to(torch.int32) + state.absmax.repeat_interleave(32).to(torch.int32)) & 0xFF
    expected = torch.stack((summed >> 4, summed & 0xF), dim=1).reshape(shape).to(torch.float16)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("shape", [(100, 192), (8, 64), (3, 40)])
def test_matmul_floor_reads_every_word_and_absmax_byte_once(shape, device):
    """Every word and absmax byte summed (a last block of 40 codes, 100x192's last program partial),
    every output written."""
    import torch

    from helpers import quantize

    packed, state = quantize(shape, dtype=torch.float16, device=device)
    x = torch.randn(3, shape[1], dtype=torch.float16, device=device)
    checksums = []
    poisoned = torch.full((3, shape[0]), float("nan"), dtype=x.dtype, device=device)
    out = bench.contenders.bytes_once(x, packed, state, checksums, out=poisoned)
    assert out is poisoned and not out.any()
    words = packed.view(torch.uint8).reshape(-1).view(torch.int32).to(torch.int64).sum()
    expected = (words + state.absmax.to(torch.int64).sum()) % 2**32
    assert checksums[0].to(torch.int64).sum().item() % 2**32 == expected.item()


@pytest.mark.gpu
def test_compiled_floor_matches_the_floor_kernel():
    """The compile section's floor: the same kernel inside a compiled graph, no graph break."""
    import torch
    from torch._dynamo.utils import counters

    packed, state = bench.weights.make_weight((256, 192), torch.bfloat16)
    counters.clear()
    assert torch.equal(bench.contenders.compiled_floor(packed, state)(), bench.contenders.expand_floor(packed, state))
    assert not counters["graph_break"]


@pytest.mark.gpu
def test_matmul_sweep_times_and_checks_each_candidate():
    """``python -m bench.matmul --sweep`` on a small layer: every candidate given is timed and checked."""
    import torch

    lines = []
    results = bench.matmul.sweep(torch.float16, [(256, 128)], [16], lambda m: bench.matmul.candidates(m)[:2],
                                 log=lines.append)
    assert len(results) == 2 and all(r["error"] < 1e-2 for r in results), lines
    assert sum(line.startswith("row,") for line in lines) == 3 + 2, lines
