"""The README's measured numbers against the files in results/ they come from: its first two tables
(serving and QLoRA at real sizes; the versions above them, the harness, kernel GPU times, the
host-bound QLoRA and FSDP steps), the serving table and the model table, each parsed and recomputed
from the CSVs."""

import csv
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H100 = os.path.join(ROOT, "results", "nvidia-h100-80gb-hbm3")


def readme():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as handle:
        return handle.read()


def tables(text):
    """Each markdown table of `text` as its rows of stripped cells, the header row first."""
    found, current = [], None
    for line in text.splitlines():
        if not line.startswith("|"):
            current = None
            continue
        if current is None:
            current = []
            found.append(current)
        if not set(line) <= set("|-: "):  # not the separator row
            current.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return found


def rows(path, **match):
    with open(path, newline="") as handle:
        return [row for row in csv.DictReader(handle) if all(row[key] == value for key, value in match.items())]


def decimals(text):
    return re.findall(r"\d+\.\d+", text)


def headline_numbers():
    """{first-table row label: (the decimals its cells must hold, in order; words they must hold)} from results/."""
    bench = os.path.join(H100, "bench.csv")
    harness = {row["implementation"]: float(row["median_us"]) / 1e6 for row in rows(bench, kind="harness")}
    ours, fused, old = harness["nf4-triton"], harness["unsloth-fused"], harness["unsloth-2025"]
    with open(os.path.join(H100, "bench.log")) as handle:
        rounds = len(re.findall(r"^harness round \d+:", handle.read(), re.M))
    expected = {f"challenge harness ({rounds} rounds)": ([f"{ours:.3f}", f"{fused:.3f}", f"{fused / ours:.2f}",
                                                          f"{old:.3f}", f"{old / ours:.2f}"], [])}
    for shape in ("4096x1024", "14336x4096", "28672x8192"):
        gpu = {row["implementation"]: row for row in rows(bench, kind="kernel-gpu", shape=shape, dtype="fp16")}
        expected[f"GPU time, {shape} fp16"] = ([f"{float(gpu[name][column]):.{digits}f}"
                                               for name in ("nf4-triton", "unsloth-fused")
                                               for column, digits in (("median_us", 2), ("pct_roofline", 1))], [])
    model = os.path.join(H100, "model.csv")
    steps = [row for row in rows(model) if row["kind"].startswith("qlora-step")]
    time = {(row["model"], row["dtype"], row["kind"], row["implementation"]): float(row["median_ms"]) for row in steps}
    speedups = [time[case[:3] + ("bitsandbytes",)] / value for case, value in time.items() if case[3] == "nf4-triton"]
    label = "QLoRA step, small models (2048x5632, 4 layers; 4096x14336, 2 layers): host-bound"
    expected[label] = ([f"{min(speedups):.2f}", f"{max(speedups):.2f}"], [f"all {len(speedups)} cases"])
    small = [ratio for flavour in (1, 2) for (model_name, name), ratio in fsdp_speedups(flavour).items()
             if "@" not in model_name]  # bench.model's models: no tokens spelled in the name
    expected["FSDP QLoRA step, two H100s, small models: host-bound"] = (
        [f"{min(small):.2f}", f"{max(small):.2f}"], ["FSDP1 and FSDP2", "both of its runs"])
    return expected


def fsdp_speedups(flavour):
    """{(model, bitsandbytes run): its step time over the drop-in's} of bench/bench.fsdp_qlora.py's committed run."""
    fsdp = rows(os.path.join(H100, f"fsdp{flavour}.csv"))
    assert {(row["gpu"], row["world_size"]) for row in fsdp} == {("NVIDIA H100 80GB HBM3", "2")}  # "two H100s"
    step = {(row["model"], row["implementation"]): float(row["median_step_ms"]) for row in fsdp}
    return {(model_name, name): value / step[model_name, "nf4-triton"] for (model_name, name), value in step.items()
            if name.startswith("bitsandbytes")}


def serve(dtype, layers="", folder=H100):
    """{(kind, tokens, implementation): row} of bench.serve's CSV for ``dtype`` in ``folder`` (``layers``:
    "_32layers" for the whole model's run), and bitsandbytes' time over each row's ("x" speedups)."""
    found = {(row["kind"], row["tokens"], row["implementation"]): row
             for row in rows(os.path.join(folder, f"serve_{dtype}{layers}.csv"))}
    speedup = {key: float(found[key[:2] + ("bitsandbytes",)]["median_ms"]) / float(row["median_ms"])
               for key, row in found.items()
               if key[0] in ("decode", "decode floor", "decode compiled", "prefill", "qlora-step", "qlora-step-checkpointed")}
    return found, speedup


DECODE = [f"{batch}x128+128" for batch in (1, 8, 32, 64)]
PREFILL = ["1x128", "1x512", "8x512", "1x2048"]
FLOOR = "floor (bytes once)"  # bench.contenders.MATMUL_FLOOR
MERGED = "nf4-triton (merged)"  # bench.serve.MERGED


def merged_speedup(found, kind, tokens):
    """bitsandbytes' step time over the merged drop-in's in the rows of ``kind`` (their own rounds)."""
    return float(found[kind, tokens, "bitsandbytes"]["median_ms"]) / float(found[kind, tokens, MERGED]["median_ms"])


def test_serving_headline_is_the_results():
    """The first table: bf16 ratios and tokens/s of the drop-in, decode (its floor, compiled, merged) and prefill
    with all 32 layers, the QLoRA steps with 8; fp16 within 0.04x of them, the floor's included."""
    first = tables(readme())[0]
    assert first[0] == ["bf16 (fp16 within 0.04x)", "drop-in over bitsandbytes' own layers"]
    found, speedup = serve("bf16", "_32layers")
    _, fp16 = serve("fp16", "_32layers")
    assert {row["model"] for row in found.values()} == {"4096x14336 x32 layers"}
    trained, train_speedup = serve("bf16")
    _, train_fp16 = serve("fp16")
    ours = "nf4-triton"
    labels = [row[0] for row in first[1:]]
    assert [label.split(",")[:2] for label in labels[:6]] == [
        ["decode", " 32 layers"], ["decode floor", " 32 layers"], ["decode compiled", " 32 layers"],
        ["decode merged", " 32 layers"], ["prefill", " 32 layers"], ["QLoRA step 4x1024", " 8 layers"]]
    decode, floor, compiled, merged, prefill, train, fsdp = (row[1] for row in first[1:])
    found_fp16 = serve("fp16", "_32layers")[0]
    for cell, kind in zip(merged.split("; ")[:2], ("decode merged", "decode merged compiled")):
        ratios = [merged_speedup(found, kind, t) for t in DECODE]
        assert decimals(cell) == [f"{ratio:.2f}" for ratio in ratios]
        assert re.findall(r"\((.*) tokens/s\)", cell)[0] == " / ".join(
            f"{float(found[kind, t, MERGED]['tokens_per_s']):.0f}" for t in DECODE)
        assert all(abs(merged_speedup(found_fp16, kind, t) - ratio) <= 0.04 for t, ratio in zip(DECODE, ratios))
    merged_prefill = [merged_speedup(found, "prefill merged", t) for t in PREFILL]
    assert decimals(merged.split("; ")[2]) == [f"{ratio:.2f}" for ratio in merged_prefill]
    assert all(abs(merged_speedup(found_fp16, "prefill merged", t) - ratio) <= 0.04 for t, ratio in zip(PREFILL, merged_prefill))
    assert decimals(decode) == [f"{speedup['decode', t, ours]:.2f}" for t in DECODE]
    assert decimals(compiled)[:4] == [f"{speedup['decode compiled', t, ours]:.2f}" for t in DECODE]
    assert compiled.endswith(f"the floor at batch 1: {speedup['decode compiled', DECODE[0], FLOOR]:.2f}x")
    for cell, kind, name in ((decode, "decode", ours), (floor, "decode floor", FLOOR), (compiled, "decode compiled", ours)):
        assert re.findall(r"\((.*) tokens/s\)", cell)[0] == " / ".join(
            f"{float(found[kind, t, name]['tokens_per_s']):.0f}" for t in DECODE)
    assert decimals(floor) == [f"{speedup['decode floor', t, FLOOR]:.2f}" for t in DECODE]
    assert decimals(prefill) == [f"{speedup['prefill', t, ours]:.2f}" for t in PREFILL]
    training = ("qlora-step", "qlora-step-checkpointed")
    assert decimals(train) == [f"{train_speedup[kind, '4x1024', ours]:.2f}" for kind in training]
    assert all(abs(fp16[key] - value) <= 0.04 + 1e-9 for key, value in speedup.items() if key[2] in (ours, FLOOR))
    assert all(abs(train_fp16[kind, "4x1024", ours] - train_speedup[kind, "4x1024", ours]) <= 0.04 for kind in training)
    assert all(trained[kind, "4x1024", ours]["loss_equal_bitsandbytes"] == "True" for kind in training)
    real = "4096x14336x8@2x2048"
    assert first[7][0] == ("FSDP QLoRA step on two H100s, the same 8 layers, 2x2048 tokens a rank, 20 interleaved steps "
                           "(not graphs), FSDP2 / FSDP1")
    assert decimals(fsdp) == [f"{fsdp_speedups(flavour)[real, 'bitsandbytes']:.2f}" for flavour in (2, 1)]
    # "within bitsandbytes' own run-to-run spread": the drop-in's losses no further from bitsandbytes' first run
    for flavour in (1, 2):
        measured = {row["implementation"]: float(row["loss_max_diff"])
                    for row in rows(os.path.join(H100, f"fsdp{flavour}.csv"), model=real)}
        assert measured["nf4-triton"] <= measured["bitsandbytes (again)"], (flavour, measured)


@pytest.mark.parametrize("header, layers", [("case", ""), ("case, 32 layers", "_32layers")])
def test_serving_table_is_the_results(header, layers):
    """The serving tables, 8 layers with the QLoRA steps and all 32 layers without: every cell from the CSV."""
    (table,) = [table for table in tables(readme()) if table[0][:2] == [header, "bitsandbytes"]]
    found, speedup = serve("bf16", layers)
    names = ["bitsandbytes", "nf4-triton", "nf4-triton (no fused matmul)"]
    cases = [("decode", t) for t in DECODE] + [("prefill", t) for t in PREFILL]
    if not layers:
        cases += [("qlora-step", "4x1024"), ("qlora-step-checkpointed", "4x1024")]
    assert len(table) - 1 == len(cases)
    for (kind, tokens), row in zip(cases, table[1:]):
        for name, cell in zip(names, row[1:]):
            if not cell:
                continue
            measured = found[kind, tokens, name]
            numbers = re.findall(r"\d+(?:\.\d+)?", cell.replace(", ", " "))
            if kind == "decode":
                assert numbers[0] == f"{float(measured['tokens_per_s']):.0f}", (kind, tokens, name)
            else:
                value = float(measured["median_ms"])
                assert numbers[0] == (f"{value:.1f}" if value >= 10 else f"{value:.2f}"), (kind, tokens, name)
            if name != "bitsandbytes":
                assert f"{speedup[kind, tokens, name]:.2f}x" in cell, (kind, tokens, name)
            if "MiB" in cell:
                assert f"{float(measured['peak_mib']):.0f} MiB" in cell



def test_h200_paragraph_is_the_results():
    """The H200's figures under the first table: serving merged with all 32 layers, the QLoRA step with 8, from its CSVs."""
    h200 = os.path.join(ROOT, "results", "nvidia-h200")
    found = {dtype: serve(dtype, "_32layers", h200)[0] for dtype in ("bf16", "fp16")}
    trained = {dtype: serve(dtype, "", h200) for dtype in ("bf16", "fp16")}
    versions = {(row["gpu"], row["torch_version"], row["triton_version"], row["bitsandbytes_version"],
                 row["transformers_version"])
                for table in list(found.values()) + [table for table, _ in trained.values()] for row in table.values()}
    assert len(versions) == 1
    opening = "On one {} (torch {}, Triton {}, bitsandbytes {}, transformers {})".format(*versions.pop())
    assert {row["model"] for table in found.values() for row in table.values()} == {"4096x14336 x32 layers"}
    assert {row["model"] for table, _ in trained.values() for row in table.values()} == {"4096x14336 x8 layers"}

    def ratios(dtype, kind, batches):
        return " / ".join(f"{merged_speedup(found[dtype], kind, tokens):.2f}x" for tokens in batches)

    def step(dtype):  # the merged drop-in's batch-1 compiled step against bitsandbytes', ms
        return " against ".join(f"{float(found[dtype]['decode merged compiled', DECODE[0], name]['median_ms']):.3f}"
                                for name in (MERGED, "bitsandbytes"))

    def training(dtype):
        table, speedup = trained[dtype]
        kinds = ("qlora-step", "qlora-step-checkpointed")
        assert all(table[kind, "4x1024", "nf4-triton"][equal] == "True" for kind in kinds
                   for equal in ("loss_equal_bitsandbytes", "lora_grads_equal_bitsandbytes"))
        return " / ".join(f"{speedup[kind, '4x1024', 'nf4-triton']:.2f}x" for kind in kinds)

    compiled, graphs, prefill = "decode merged compiled", "decode merged", "prefill merged"
    text = " ".join(readme().split())
    text = text[text.index("On one NVIDIA H200"):text.index("of the step less.")]
    for fragment in (
            opening,
            f"**{ratios('bf16', compiled, DECODE[:1])}** at batch 1 in bf16 ({step('bf16')} ms a step)",
            f"**{ratios('fp16', compiled, DECODE[:1])}** in fp16 ({step('fp16')})",
            f"at batch 8 / 32 / 64 **{ratios('bf16', compiled, DECODE[1:2])}** / {ratios('bf16', compiled, DECODE[2:])} "
            f"in bf16 and {ratios('fp16', compiled, DECODE[1:])} in fp16",
            f"{ratios('bf16', graphs, DECODE)} at batch 1 / 8 / 32 / 64 in bf16 and {ratios('fp16', graphs, DECODE)} in fp16",
            f"prefill {ratios('bf16', prefill, PREFILL[:1])} at 1x128 and {ratios('bf16', prefill, PREFILL[1:2])} at 1x512",
            f"{training('bf16')} in bf16 and {training('fp16')} in fp16, loss and LoRA gradients equal"):
        assert fragment in text, fragment


def test_h200_matmul_sentence_is_the_results():
    """The H200's fused matmul: one row of 4096x14336 against bitsandbytes' GEMV, and 256 rows of 14336x4096 routed to
    dequantize + cuBLAS against the fused tile, bf16, from its matmul.csv."""
    measured = {(row["shape"], row["rows"], row["implementation"]): row
                for row in rows(os.path.join(ROOT, "results", "nvidia-h200", "matmul.csv"), dtype="bf16")}

    def us(shape, m, name):
        return f"{float(measured[shape, m, name]['median_us']):.1f}"

    assert measured["14336x4096", "256", "nf4_linear (routed)"]["route"] == "dequantize"
    text = " ".join(readme().split())
    for fragment in (f"4096x14336 in bf16 in {us('4096x14336', '1', 'nf4_linear (routed)')} us (bitsandbytes' GEMV "
                     f"{us('4096x14336', '1', 'bitsandbytes')})",
                     f"{us('14336x4096', '256', 'nf4_linear (routed)')} us at 256 rows of 14336x4096 in bf16 against the tile's "
                     f"{us('14336x4096', '256', 'fused kernel')}"):
        assert fragment in text, fragment


def test_notebook_matmul_sentence_is_its_output():
    """The fused kernel's times the README quotes from the L4 notebook's committed matmul table (bf16, 4096x14336)."""
    import json

    with open(os.path.join(ROOT, "nf4_dequant_L4.ipynb"), encoding="utf-8") as handle:
        outputs = ["".join(output.get("text", [])) for cell in json.load(handle)["cells"]
                   for output in cell.get("outputs", [])]
    (table,) = [text for text in outputs if text.startswith("4096x14336 (in x out), bf16: GPU time per call")]
    lines = table.splitlines()
    names = lines[1].replace("dequantize + F.linear", "dequantize").replace("fused kernel", "fused").split()
    column = 1 + names.index("fused")  # each row starts with its M
    fused = {line.split()[0]: line.split()[column] for line in lines[3:] if line.split() and line.split()[0].isdigit()}
    rows = ("1", "8", "16", "32", "64", "128")
    expected = (f"gives the fused kernel {' / '.join(fused[m] for m in rows)} us at {' / '.join(rows)} rows of "
                "4096x14336 in bf16")
    assert expected in " ".join(readme().split()), expected


def test_h200_unsloth_sentence_is_the_results():
    """The H200's runs with Unsloth imported (8 layers): every ratio of Unsloth and of the drop-in over bitsandbytes,
    bf16 / fp16 where they differ, from its CSVs."""
    h200 = os.path.join(ROOT, "results", "nvidia-h200")
    speedups = [serve(dtype, "_unsloth", h200)[1] for dtype in ("bf16", "fp16")]

    def ratio(kind, tokens, name):
        bf16, fp16 = (f"{speedup[kind, tokens, name]:.2f}x" for speedup in speedups)
        return bf16 if bf16 == fp16 else f"{bf16} / {fp16}"

    def figures(name):
        decode = [ratio("decode", tokens, name) for tokens in DECODE]
        return (f"decode {decode[0]}{' at batch 1' if name == 'unsloth' else ''}, {decode[1]}"
                f"{' at 8' if name == 'unsloth' else ''}, {decode[2]}{' at 32' if name == 'unsloth' else ''}, "
                f"{decode[3]}{' at 64' if name == 'unsloth' else ''}; prefill 1x128 {ratio('prefill', PREFILL[0], name)}; "
                f"QLoRA {ratio('qlora-step', '4x1024', name)}, with checkpointing "
                f"{ratio('qlora-step-checkpointed', '4x1024', name)}.")

    text = " ".join(readme().split())
    text = text[text.index("On the H200 (`nvidia-h200/serve_*_unsloth.csv`"):text.index("- **Targets**")]
    for fragment in (f"Unsloth: {figures('unsloth')}", f"The drop-in in the same runs: {figures('nf4-triton')}"):
        assert fragment in text, fragment


def test_compiled_table_is_the_results():
    """The compiled decode table (bf16, all 32 layers): every cell from the CSV, the floor where it ran."""
    (table,) = [table for table in tables(readme()) if table[0][0] == "decode, 32 layers, compiled"]
    assert table[0][1:] == ["bitsandbytes", "drop-in", FLOOR]
    found, speedup = serve("bf16", "_32layers")
    assert len(table) - 1 == len(DECODE)
    for tokens, row in zip(DECODE, table[1:]):
        for name, cell in zip(["bitsandbytes", "nf4-triton", FLOOR], row[1:]):
            key = ("decode compiled", tokens, name)
            assert bool(cell) == (key in found), key
            if cell:
                assert re.findall(r"\d+", cell)[0] == f"{float(found[key]['tokens_per_s']):.0f}", key
                assert name == "bitsandbytes" or f"({speedup[key]:.2f}x)" in cell, key


def test_headline_table_is_the_results():
    text = readme()
    first = tables(text)[1]
    numbers = headline_numbers()
    labels = [row[0] for row in first[1:]]
    for row in first[1:]:
        label = row[0]
        if label == "bits":
            assert not decimals(" ".join(row)), "a measured number here needs its file in results/ and a line in this test"
            continue
        assert label in numbers, f"README row {label!r}: no file in results/ gives it (rows this test knows: {list(numbers)})"
        expected_decimals, words = numbers[label]
        assert decimals(" ".join(row[1:])) == expected_decimals, label
        assert all(word in " ".join(row[1:]) for word in words), (label, words)
    assert set(numbers) <= set(labels), set(numbers) - set(labels)
    # The versions named above the table are the ones the CSV rows carry.
    meta = rows(os.path.join(H100, "bench.csv"), kind="harness")[0]
    intro = " ".join(text[:text.index("| |")].split())
    assert (f"{meta['gpu']} (torch {meta['torch_version']}, Triton {meta['triton_version']}, bitsandbytes "
            f"{meta['bitsandbytes_version']}, unsloth {meta['unsloth_version']}") in intro


def test_model_table_is_the_results():
    (table,) = [table for table in tables(readme()) if table[0][:3] == ["model", "dtype", "case"]]
    kinds = {"prefill": "prefill", "QLoRA step": "qlora-step", "QLoRA step, checkpointing": "qlora-step-checkpointed"}
    measured = {}
    for row in rows(os.path.join(H100, "model.csv")):
        if row["kind"] != "crossover":
            measured[row["model"], row["dtype"], row["kind"], row["tokens"], row["implementation"]] = row
    assert len(table) - 1 == len(measured) // 3  # every case once, three contenders each
    for model, dtype, case, bnb_ms, ours_ms, unsloth_ms, gpu_ms, peak in table[1:]:
        kind, _, tokens = case.rpartition(" ") if case.startswith("prefill") or case.endswith("4x512") else (case, "", "4x512")
        bnb, ours, unsloth = (measured[model, dtype, kinds[kind], tokens, name]
                              for name in ("bitsandbytes", "nf4-triton", "unsloth-fused"))
        base = float(bnb["median_ms"])
        assert [bnb_ms, ours_ms, unsloth_ms, gpu_ms, peak] == [
            f"{base:.2f}",
            f"{float(ours['median_ms']):.2f} ({base / float(ours['median_ms']):.2f}x)",
            f"{float(unsloth['median_ms']):.2f} ({base / float(unsloth['median_ms']):.2f}x)",
            f"{float(bnb['gpu_ms']):.2f} / {float(ours['gpu_ms']):.2f}",
            f"{float(bnb['peak_mib']):.0f} / {float(ours['peak_mib']):.0f}"], (model, dtype, case)


def test_the_parser_sees_every_table_and_number():
    """The parsing itself: a table of two rows, its separator skipped, and decimals found in order."""
    assert tables("text\n| a | b |\n|---|---|\n| 1.25 x | 3 (4.50x) |\nafter") == [[["a", "b"], ["1.25 x", "3 (4.50x)"]]]
    assert decimals("4.55 us, 76.9 % | 2025 path, 1.87x") == ["4.55", "76.9", "1.87"]


def test_install_lines_agree():
    """requirements.txt is pyproject.toml's dependencies and `test` extra; the README's CPU line pins the
    torch that CI installs; `.[test]` brings what the README's test commands run."""
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as handle:
        project = tomllib.load(handle)["project"]
    with open(os.path.join(ROOT, "requirements.txt")) as handle:
        listed = [line.strip() for line in handle if line.strip() and not line.startswith("#")]
    assert sorted(listed) == sorted(project["dependencies"] + project["optional-dependencies"]["test"])
    assert {"pytest", "ruff"} <= set(project["optional-dependencies"]["test"])
    with open(os.path.join(ROOT, ".ci", "run")) as handle:
        (ci_torch,) = re.findall(r"pip install --quiet (torch==\S+)", handle.read())
    (cpu_line,) = [line for line in readme().splitlines() if "download.pytorch.org/whl/cpu" in line]
    assert cpu_line.startswith(f"pip install {ci_torch} --index-url ") and "pip install ." in cpu_line
    assert "pip install '.[test]'" in readme()
