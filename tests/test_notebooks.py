"""The two notebooks: what `tools/notebooks.py` writes from its one template (outputs aside), carrying the
repository's modules byte for byte, every section present, and Run all working end to end in smoke mode
(small shapes; through the interpreter when there is no GPU) alone in an empty folder."""

import os
import re
import shutil
import tempfile

import pytest

nbformat = pytest.importorskip("nbformat")
from tools import notebooks

ROOT = notebooks.ROOT
SECTIONS = ["## 1. Setup", "## 2. The format, derived", "## 3. The kernel", "## 4. Correctness", "## 5. Timing",
            "## 6. Launch-parameter sweep", "## 7. The fused matmul", "## 8. Explorer", "## 9. torch.compile",
            "## 10. Writeup"]


def load(name):
    notebook = nbformat.read(os.path.join(ROOT, name), as_version=4)
    nbformat.validate(notebook)
    return notebook


def embedded_files(notebook):
    """{file name: text} of the notebook's `%%writefile` cells."""
    files = {}
    for cell in notebook.cells:
        if cell.cell_type == "code" and cell.source.startswith(notebooks.WRITEFILE):
            first_line, _, text = cell.source.partition("\n")
            files[first_line[len(notebooks.WRITEFILE):]] = text
    return files


def repository_file(name):
    with open(os.path.join(ROOT, name), encoding="utf-8", newline="") as handle:
        return handle.read()


def output_text(notebook):
    return "\n".join(output.get("text", "") for cell in notebook.cells if cell.cell_type == "code"
                     for output in cell.outputs)


def test_committed_notebooks_are_what_the_generator_writes():
    """One template for both: a hand edit, a drifted copy or a changed module fails here."""
    assert notebooks.stale() == [], "run `python -m tools.notebooks` and commit both notebooks"


@pytest.mark.parametrize("name", notebooks.NOTEBOOKS)
def test_embedded_modules_are_the_repository_files(name):
    notebook = load(name)
    files = embedded_files(notebook)
    assert list(files) == notebooks.notebook_files()  # the package, kernel.py, the benchmark modules it imports
    for file, text in files.items():
        assert text == repository_file(file), f"{file} embedded in {name} differs from the repository's"
    heading = next(cell for cell in notebook.cells if cell.get("id") == notebooks.PROJECT_FILES_ID)
    assert heading.source.startswith("### Project files, generated from the repository; do not edit\n")
    assert notebook.metadata.colab.collapsed_sections == [heading.metadata.id]  # Colab shows it collapsed


def test_readable_outputs():
    """A text progress bar keeps its last state, a stream's pieces join, a widget view goes."""
    outputs = [nbformat.v4.new_output("stream", name="stderr", text="\rbar:   0%|  | 0/3"),
               nbformat.v4.new_output("stream", name="stderr", text="\rbar:  33%|# | 1/3\rbar: 100%|##| 3/3\n"),
               nbformat.v4.new_output("display_data", data={"application/vnd.jupyter.widget-view+json": {},
                                                            "text/plain": "VBox(children=...)"}),
               nbformat.v4.new_output("stream", name="stdout", text="done\n")]
    assert [(output.output_type, output.get("text")) for output in notebooks.readable_outputs(outputs)] == [
        ("stream", "bar: 100%|##| 3/3\n"), ("stream", "done\n")]


@pytest.mark.parametrize("name", notebooks.NOTEBOOKS)
def test_structure(name):
    notebook = load(name)
    markdown = "\n".join(cell.source for cell in notebook.cells if cell.cell_type == "markdown")
    positions = [markdown.find(section) for section in SECTIONS]
    assert -1 not in positions and positions == sorted(positions), positions
    code = [cell.source for cell in notebook.cells
            if cell.cell_type == "code" and not cell.source.startswith(notebooks.WRITEFILE)]
    assert not any(re.search(r"@triton\.jit|tl\.load|tl\.store", source) for source in code)  # the kernel lives in kernel.py
    assert any("from nf4_triton import kernel" in source for source in code)
    assert os.path.getsize(os.path.join(ROOT, name)) < 2 * 2**20


def run_until_modules(notebook, folder):
    """Runs the cells up to the one that says where each module comes from; returns its output."""
    ids = [cell.id for cell in notebook.cells]
    notebook.cells = notebook.cells[:ids.index("modules") + 1]
    return output_text(notebooks.execute(notebook, str(folder), timeout=60))


def test_next_to_a_clone_the_repository_files_are_used():
    notebook = notebooks.build("nf4_dequant_T4.ipynb", notebooks.module_sources(notebooks.notebook_files()))
    text = run_until_modules(notebook, ROOT)
    for path in notebooks.notebook_files():
        assert f"{path}: {os.path.join(ROOT, path)} (the same as the copy above)" in text, text


def test_a_different_package_next_to_the_notebook_wins_and_is_kept(tmp_path):
    """A package folder next to the notebook (a clone's, edited) is the one imported; bench/ still from the copies."""
    shutil.copytree(os.path.join(ROOT, "nf4_triton"), tmp_path / "nf4_triton", ignore=shutil.ignore_patterns("__pycache__"))
    changed = repository_file("nf4_triton/dropin.py") + "# changed by hand\n"
    (tmp_path / "nf4_triton" / "dropin.py").write_text(changed)
    notebook = notebooks.build("nf4_dequant_L4.ipynb", notebooks.module_sources(notebooks.notebook_files()))
    text = run_until_modules(notebook, tmp_path)
    assert f"nf4_triton/dropin.py: {tmp_path / 'nf4_triton' / 'dropin.py'} (differs from the copy above)" in text, text
    assert f"nf4_triton/kernel.py: {tmp_path / 'nf4_triton' / 'kernel.py'} (the same as the copy above)" in text, text
    assert "bench/timing.py: the copy above" in text
    assert (tmp_path / "nf4_triton" / "dropin.py").read_text() == changed


@pytest.mark.parametrize("name", notebooks.NOTEBOOKS)
def test_committed_outputs_show_the_gpu_and_every_chart_as_a_picture(name):
    """The committed outputs, from a Run all on a GPU: the first names that GPU, and every chart is a PNG (at least
    four: the kernels' roofline, the launch sweep, the fused matmul, the explorer's default view), none a figure's
    text."""
    notebook = load(name)
    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]
    assert outputs and outputs[0].get("text", "").startswith("This run: NVIDIA "), outputs[:1]
    pngs = sum("image/png" in output.get("data", {}) for output in outputs)
    texts = [output.get("text", "") + str(output.get("data", {}).get("text/plain", "")) for output in outputs]
    assert pngs >= 4 and not any("<Figure size" in text for text in texts), pngs


@pytest.mark.long  # on a GPU (CI runs both on the CPU)
@pytest.mark.parametrize("name", notebooks.NOTEBOOKS)
def test_run_all_in_smoke_mode_alone(name, tmp_path, monkeypatch):
    """Opened alone: an empty folder holding only the notebook; its modules come from its own cells."""
    pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    shutil.copy(os.path.join(ROOT, name), tmp_path)
    notebook = nbformat.read(tmp_path / name, as_version=4)
    monkeypatch.setenv("NF4_NOTEBOOK_SMOKE", "1")
    # A whole smoke run takes about 10 s here, so 60 s per cell turns any stall into a failure within a minute.
    text = output_text(notebooks.execute(notebook, str(tmp_path), timeout=60))
    for path in notebooks.notebook_files():
        assert f"{path}: the copy above" in text
    first = next(cell for cell in notebook.cells if cell.cell_type == "code" and cell.outputs).outputs[0]
    assert first.text.startswith("This run: no CUDA GPU (smoke mode) | torch "), first.text  # what ran it, first
    assert "<Figure size" not in text  # every chart a picture
    assert "smoke mode: True" in text
    assert "hand decode == bitsandbytes, bit for bit: True" in text
    assert "graph breaks: 0" in text
    assert "compiled dequantize == eager, bit for bit: True" in text
    assert "fused kernel against dequantize + F.linear: largest |difference|" in text  # the cell asserts its bound
    matmul_chart = next(cell for cell in notebook.cells if cell.id == "matmul").outputs[-1]
    assert "image/png" in matmul_chart.data
    writeup = next(cell for cell in notebook.cells if cell.id == "writeup-table").outputs[0].data["text/markdown"]
    assert "| works in torch.compile (+1) | 0 graph breaks; compiled output equal to eager bit for bit: True" in writeup
    # What the %%writefile cells wrote is what they hold, byte for byte.
    folder_cell = next(cell for cell in notebook.cells if cell.id == "project-files-folder")
    (folder,) = re.findall(r"nf4-triton-[0-9a-f]{12}", folder_cell.source)
    for file, text in embedded_files(notebook).items():
        with open(os.path.join(tempfile.gettempdir(), folder, file), encoding="utf-8", newline="") as handle:
            assert handle.read() == text, file
