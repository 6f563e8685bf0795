"""What a benchmark run writes: the versions and metadata that start every row, rows of kernel,
host or wall times, and the CSV files of a per-GPU results folder."""

import csv
import datetime
import os
import platform

import torch

import bench.timing
import bench.weights

# Which rows each CSV of a results folder holds, by their ``kind``.
RESULT_FILES = {
    "bench.csv": ("roofline", "kernel", "kernel-gpu", "harness"),
    "forms.csv": ("forms",),
    "model.csv": ("crossover", "prefill", "qlora-step", "qlora-step-checkpointed"),
    "sweep.csv": ("roofline", "sweep", "sweep-gpu"),
    "compile.csv": ("roofline", "compile", "compile-kernel", "compile-reference", "compile-host"),
    "matmul.csv": ("matmul",),
}


def versions(packages=("torch", "triton", "bitsandbytes", "unsloth")):
    """{package: version}; a package missing or failing on import (an optional contender) says so instead."""
    found = {}
    for name in packages:
        try:
            found[name] = __import__(name).__version__
        except Exception as error:
            found[name] = f"unavailable ({type(error).__name__})"
    return found


def version_columns(packages=("torch", "triton", "bitsandbytes", "unsloth")):
    """``versions`` as CSV columns: {"torch_version": ..., ...}."""
    return {f"{name}_version": version for name, version in versions(packages).items()}


def utc_timestamp():
    """Now, in UTC, to the second (ISO 8601)."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def run_metadata():
    """GPU name, timestamp and versions: the first columns of every CSV row."""
    return dict(gpu=torch.cuda.get_device_name(), timestamp=utc_timestamp(), python=platform.python_version(),
                **version_columns())


def gpu_slug(name):
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")


def results_folder(out):
    """``out``'s subfolder for this GPU's results."""
    return os.path.join(out, gpu_slug(torch.cuda.get_device_name()))


def timing_row(meta, kind, shape, dtype_name, implementation, times_ms, roofline, extra_peak_bytes=0):
    """One tidy CSV row from (median, p20, p80) kernel times in milliseconds."""
    median, p20, p80 = times_ms
    gbps = bench.weights.bytes_moved(shape, bench.weights.DTYPES[dtype_name]) / median / 1e6
    return dict(meta, kind=kind, shape=f"{shape[0]}x{shape[1]}", dtype=dtype_name, implementation=implementation,
                median_us=median * 1e3, p20_us=p20 * 1e3, p80_us=p80 * 1e3, gbps=gbps,
                pct_roofline=100 * gbps / roofline, extra_peak_bytes=extra_peak_bytes)


def seconds_row(meta, kind, shape, dtype_name, implementation, seconds):
    """One tidy CSV row from samples of wall or host seconds (no bandwidth: not kernel times)."""
    median, p20, p80 = bench.timing.summarize(seconds)
    return dict(meta, kind=kind, shape=shape, dtype=dtype_name, implementation=implementation,
                median_us=median * 1e6, p20_us=p20 * 1e6, p80_us=p80 * 1e6, gbps=0.0, pct_roofline=0.0,
                extra_peak_bytes=0)


def roofline_rows(meta, rooflines):
    return [dict(meta, kind="roofline", shape="", dtype="", implementation=f"copy ({timer})", median_us=0.0,
                 p20_us=0.0, p80_us=0.0, gbps=gbps, pct_roofline=100.0, extra_peak_bytes=0)
            for timer, gbps in rooflines.items()]


def write_csv(path, rows):
    """``rows`` as one CSV file, its columns every row's keys in order of appearance (sections add columns)."""
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(dict.fromkeys(key for row in rows for key in row)), restval="")
        writer.writeheader()
        writer.writerows(rows)


def write_results(rows, folder):
    """Each of RESULT_FILES that has rows of more than the roofline, into ``folder``; returns the folder."""
    os.makedirs(folder, exist_ok=True)
    for name, kinds in RESULT_FILES.items():
        selected = [row for row in rows if row["kind"] in kinds]
        if any(row["kind"] != "roofline" for row in selected):
            write_csv(os.path.join(folder, name), selected)
    return folder
