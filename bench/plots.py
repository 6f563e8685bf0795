"""Charts of a results folder, drawn from its CSVs alone: kernel time as % of the copy roofline
(kernel_roofline.png), the launch sweep (sweep.png), the model's speed over bitsandbytes
(model.png), the fused matmul over M (matmul.png), bench.serve's decode, prefill and QLoRA
(serve.png, serve_losses.png) and bench/fsdp_qlora.py's loss curves per FSDP flavour and size
(fsdp_losses.png). ``python -m bench --plot FOLDER`` redraws them."""

import os


def plot(folder):
    """Charts from the CSVs in one results folder: kernel % of copy roofline per shape, the launch
    sweep (time against bytes per program, a line per num_warps / asm family) and the model's
    speed over bitsandbytes, each where its CSV is there; returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    written = []
    bench_csv = os.path.join(folder, "bench.csv")
    frame = pd.read_csv(bench_csv) if os.path.exists(bench_csv) else pd.DataFrame({"kind": []})
    kernels = frame[frame["kind"].isin(["kernel", "kernel-gpu"])]
    if len(kernels):
        meta = frame.iloc[0]
        groups = list(kernels.groupby(["kind", "dtype"]))
        n_dtypes = kernels["dtype"].nunique()
        fig, axes = plt.subplots(len(groups) // n_dtypes, n_dtypes, figsize=(12, 4.5 * len(groups) // n_dtypes),
                                 squeeze=False)
        for ax, ((kind, dtype), rows) in zip(axes.flat, groups):
            table = rows.pivot(index="shape", columns="implementation", values="pct_roofline")
            table = table.loc[sorted(table.index, key=lambda s: int(s.split("x")[0]) * int(s.split("x")[1]))]
            table.plot.bar(ax=ax, rot=30)
            ax.axhline(100, color="black", linewidth=0.8, linestyle="--")
            timing = "do_bench" if kind == "kernel" else "GPU time, profiler"
            ax.set_title(f"{dtype}: % of device copy bandwidth ({timing})")
            ax.set_ylabel("% of copy roofline")
            ax.get_legend().remove()  # one legend below the panels: inside one it covers the small shapes' bars
        written.append(_save_with_legend_below(plt, fig, axes, os.path.join(folder, "kernel_roofline.png"), run_line(meta),
                                               ncol=None, fontsize=9, bottom=0.04, dpi=110))
    sweep_csv = os.path.join(folder, "sweep.csv")
    if os.path.exists(sweep_csv):
        frame = pd.read_csv(sweep_csv)
        kind = "sweep-gpu" if (frame["kind"] == "sweep-gpu").any() else "sweep"
        frame = frame[frame["kind"] == kind].copy()
        config = frame["implementation"].str.extract(r"bpp=(\d+) (.*)")
        frame["bytes_per_program"] = config[0].astype(int)
        frame["family"] = config[1]
        groups = list(frame.groupby(["shape", "dtype"], sort=False))
        fig, axes = plt.subplots(2, (len(groups) + 1) // 2, figsize=(15, 9), squeeze=False)
        for ax, ((shape, dtype), rows) in zip(axes.flat, groups):
            best = rows["median_us"].min()
            top = best * 1.3  # the close configurations; the slower ones are marked on the top edge
            for family, line in rows.groupby("family"):
                line = line.sort_values("bytes_per_program")
                (drawn,) = ax.plot(line["bytes_per_program"], line["median_us"], marker="o", label=family)
                above = line[line["median_us"] > top]
                ax.plot(above["bytes_per_program"], [top] * len(above), marker="^", markersize=9, linestyle="none",
                        color=drawn.get_color(), clip_on=False)
            ax.set_ylim(best * 0.98, top)
            ax.set_xscale("log", base=2)
            clipped = int((rows["median_us"] > top).sum())
            ax.set_title(f"{shape} {dtype}: best {best:.2f} us\n{clipped} points above the top (\u25b2)", fontsize=10, pad=8)
            ax.set_xlabel("packed bytes per program")
            ax.set_ylabel("GPU time per call, us (profiler)" if kind == "sweep-gpu" else "us (do_bench, L2 flushed)")
        title = (f"Launch sweep on {frame.iloc[0]['gpu']} (triton {frame.iloc[0]['triton_version']}); "
                 "y axis up to 1.3x each shape's best, \u25b2 on the top edge: a point above it")
        written.append(_save_with_legend_below(plt, fig, axes, os.path.join(folder, "sweep.png"), title, ncol=3,
                                               fontsize=10, bottom=0.08, dpi=100))
    model_csv = os.path.join(folder, "model.csv")
    if os.path.exists(model_csv):
        written.append(plot_model(pd.read_csv(model_csv), os.path.join(folder, "model.png"), plt))
    matmul_csv = os.path.join(folder, "matmul.csv")
    if os.path.exists(matmul_csv):
        written.append(plot_matmul(pd.read_csv(matmul_csv), os.path.join(folder, "matmul.png"), plt))
    return written + plot_serve(folder) + plot_fsdp(folder)


def plot_matmul(frame, path, plt):
    """GPU time per call against rows M on log axes, a panel per (dtype, layer), the roofline dashed."""
    groups = list(frame.groupby(["dtype", "shape"], sort=False))
    columns = frame["shape"].nunique()
    fig, axes = plt.subplots(len(groups) // columns, columns, figsize=(4 * columns, 4 * len(groups) // columns),
                             squeeze=False)
    for ax, ((dtype, shape), rows) in zip(axes.flat, groups):
        for name, line in rows.groupby("implementation", sort=False):
            line = line.sort_values("rows")
            ax.plot(line["rows"], line["median_us"], marker="o", markersize=3, label=name)
        roofline = rows.drop_duplicates("rows").sort_values("rows")
        ax.plot(roofline["rows"], roofline["roofline_us"], color="black", linestyle="--", label="roofline")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{shape} (in x out), {dtype}", fontsize=10)
        ax.set_xlabel("rows M")
        ax.set_ylabel("GPU time per call, us (CUDA graph)")
        ax.grid(True, which="both", linewidth=0.3)
    meta = frame.iloc[0]
    return _save_with_legend_below(plt, fig, axes, path, run_line(meta), ncol=6, fontsize=10, bottom=0.08, dpi=90)


def plot_serve(folder):
    """bench.serve's charts from the folder's serve_<dtype>.csv files: decode tokens/s against batch and
    each timed case over bitsandbytes (serve.png), the QLoRA loss curves (serve_losses.png)."""
    import glob

    import matplotlib
    import pandas as pd

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = sorted(glob.glob(os.path.join(folder, "serve_??16.csv")))  # not the run with Unsloth imported
    if not paths:
        return []
    frame = pd.concat([pd.read_csv(path) for path in paths], ignore_index=True)
    if not frame["kind"].isin(["decode", "prefill", "qlora-step", "qlora-step-checkpointed"]).any():
        return []  # a run of sections these charts do not draw (bench/serve.py --sections merged)
    dtypes = list(dict.fromkeys(frame["dtype"]))
    meta = frame.iloc[0]
    with_decode = bool((frame["kind"] == "decode").any())  # not in a run of training alone (--sections train)
    fig, axes = plt.subplots(1 + with_decode, len(dtypes), figsize=(6 * len(dtypes), 4.5 * (1 + with_decode)),
                             squeeze=False)
    for column, dtype in enumerate(dtypes):
        rows = frame[frame["dtype"] == dtype]
        timed = rows[rows["kind"].isin(["decode", "prefill", "qlora-step", "qlora-step-checkpointed"])]
        _speed_bars(axes[-1, column], timed, timed["tokens"].str.split("+").str[0], rot=45)
        axes[-1, column].set_title(f"{meta['model']}, {dtype}: each case", fontsize=10)
        if not with_decode:
            continue
        decode = rows[rows["kind"] == "decode"].copy()
        decode["batch"] = decode["tokens"].str.split("x").str[0].astype(int)
        ax = axes[0, column]
        for name, line in decode.groupby("implementation", sort=False):
            ax.plot(line["batch"], line["tokens_per_s"], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch (sequences decoded at once)")
        ax.set_ylabel("decode tokens/s (CUDA graph)")
        ax.set_title(f"{meta['model']}, {dtype}: decode", fontsize=10)
        ax.grid(True, which="both", linewidth=0.3)
    written = [_save_with_legend_below(plt, fig, axes, os.path.join(folder, "serve.png"), run_line(meta), ncol=None,
                                       fontsize=9, bottom=0.06, dpi=90)]
    losses = frame[frame["kind"] == "loss"]
    if losses.empty:  # a run without the curves section (bench/serve.py --sections)
        return written
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6 * len(dtypes), 4.5), squeeze=False)
    for ax, dtype in zip(axes.flat, dtypes):
        for name, curve in losses[losses["dtype"] == dtype].groupby("implementation", sort=False):
            ax.plot(curve["step"], curve["loss"], label=name, linewidth=1.2)
        ax.set_xlabel("QLoRA step")
        ax.set_ylabel("loss")
        ax.set_title(f"{meta['model']}, {dtype}, LoRA r=16 from one start", fontsize=10)
    written.append(_save_with_legend_below(plt, fig, axes, os.path.join(folder, "serve_losses.png"), run_line(meta),
                                           ncol=None, fontsize=9, bottom=0.1, dpi=90))
    return written


def plot_fsdp(folder):
    """bench/fsdp_qlora.py's loss curves (fsdp_losses.png) from each flavour whose fsdpN.csv and
    fsdpN_losses.csv are in the folder: a panel per flavour and size, a line per contender; returns
    the paths written (none where no flavour's files are there)."""
    import matplotlib
    import pandas as pd

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [name for name in ("fsdp1", "fsdp2") if all(os.path.exists(os.path.join(folder, f"{name}{suffix}.csv"))
                                                       for suffix in ("", "_losses"))]
    if not runs:
        return []
    metas = [pd.read_csv(os.path.join(folder, f"{name}.csv")).iloc[0] for name in runs]
    tables = [pd.read_csv(os.path.join(folder, f"{name}_losses.csv")) for name in runs]
    columns = max(table["model"].nunique() for table in tables)
    fig, axes = plt.subplots(len(runs), columns, figsize=(4.5 * columns, 3.8 * len(runs)), squeeze=False)
    for panels, losses in zip(axes, tables):
        sizes = list(losses.groupby(["fsdp", "model"], sort=False))
        for ax, ((flavour, model), rows) in zip(panels, sizes):
            for index, (name, curve) in enumerate(rows.groupby("implementation", sort=False)):
                # Dashes: equal losses, the point of the run, draw one curve over another.
                ax.plot(curve["step"], curve["loss"], label=name, linewidth=1.2, linestyle=("-", "--", ":")[index % 3])
            ax.set_xlabel("QLoRA step")
            ax.set_ylabel("loss (mean over ranks)")
            ax.set_title(f"{model}\n{flavour}", fontsize=10)
        for ax in panels[len(sizes):]:  # a flavour that ran fewer sizes than the other
            ax.set_visible(False)
    title = "\n".join(dict.fromkeys(f"{meta['world_size']} x {run_line(meta)} | transformers "
                                    f"{meta['transformers_version']} | peft {meta['peft_version']}" for meta in metas))
    return [_save_with_legend_below(plt, fig, axes, os.path.join(folder, "fsdp_losses.png"), title, ncol=None,
                                    fontsize=9, bottom=0.1, dpi=90)]


def _speed_bars(ax, rows, tokens, rot):
    """Bars of each contender's speed over bitsandbytes' (its median time over theirs) per case, a case
    being a row's kind and ``tokens``; the legend is left to the figure."""
    case = rows["kind"].str.replace("qlora-step-checkpointed", "step+ckpt").str.replace("qlora-step", "step") + " " + tokens
    table = rows.assign(case=case).pivot(index="case", columns="implementation", values="median_ms")
    table = table.loc[list(dict.fromkeys(case)), list(dict.fromkeys(rows["implementation"]))]
    (table["bitsandbytes"].to_numpy()[:, None] / table).plot.bar(ax=ax, rot=rot, legend=False)
    ax.axhline(1, color="black", linewidth=0.8, linestyle="--")
    ax.set_ylabel("speed over bitsandbytes' Linear4bit (x)")


def _save_with_legend_below(plt, fig, axes, path, title, *, ncol, fontsize, bottom, dpi):
    """One legend for all panels below them (``ncol`` None: one row), the title, the file; returns its path."""
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=ncol or len(labels), fontsize=8)
    fig.suptitle(title, fontsize=fontsize)
    fig.tight_layout(rect=(0, bottom, 1, 1))
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def plot_model(frame, path, plt):
    """End to end: time per prefill and per QLoRA step, each contender over bitsandbytes' own
    (a bar per contender, a panel per model and dtype)."""
    frame = frame[frame["kind"] != "crossover"]
    groups = list(frame.groupby(["model", "dtype"], sort=False))
    fig, axes = plt.subplots(1, len(groups), figsize=(4.5 * len(groups), 4.5), squeeze=False)
    for ax, ((model, dtype), rows) in zip(axes.flat, groups):
        _speed_bars(ax, rows, rows["tokens"], rot=30)
        ax.set_title(f"{model} {dtype}", fontsize=9)
    meta = frame.iloc[0]
    title = f"Llama-style model, 4-bit NF4 (hidden x intermediate x layers) | {run_line(meta)}"
    return _save_with_legend_below(plt, fig, axes, path, title, ncol=None, fontsize=8, bottom=0.07, dpi=100)


def run_line(meta):
    """The GPU and versions of a CSV row, as a chart's title gives them (Unsloth's where the row has it)."""
    line = (f"{meta['gpu']} | torch {meta['torch_version']} | triton {meta['triton_version']} | "
            f"bnb {meta['bitsandbytes_version']}")
    return line + (f" | unsloth {meta['unsloth_version']}" if "unsloth_version" in meta else "")
