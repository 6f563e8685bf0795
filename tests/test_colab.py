"""The notebooks' Colab install cell, run exactly as written in a Colab-like environment built in a
fresh virtual environment: Colab's torch, Triton and transformers must come out unchanged, Unsloth's
declared requirements must hold (`pip check` names nothing but the expected lines), and the
project, bitsandbytes and Unsloth's package must import as far as a CPU allows.

Minutes and about 4 GB of downloads (torch's CUDA build with its libraries), so that test runs only
with NF4_COLAB_SIM=1 (CI sets it). The stack modelled is Colab's GPU runtime as googlecolab/backend-info
published it in August 2026: Python 3.13 (where this machine has it), torch 2.11.0 (Triton 3.6.0), torchvision 0.26.0,
transformers 5.15.0, peft 0.20.0, numpy 2.1; plus datasets 4.0.0, which an earlier runtime carried
and Unsloth excludes."""

import contextlib
import glob
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLAB_STACK = ["torch==2.11.0", "torchvision==0.26.0", "transformers==5.15.0", "peft==0.20.0", "numpy==2.1.3",
               "datasets==4.0.0", "accelerate", "pandas", "matplotlib", "ipywidgets", "tqdm"]
HELD = ("torch", "triton", "transformers", "torchvision")


def project_files():
    """What `pip install .` packs: pyproject.toml, the README and the package pyproject.toml names."""
    return {"pyproject.toml", "README.md", "nf4_triton"}


# What `pip check` may still name after the install cell: Unsloth's certifi pin is newer than the
# package index serves (the cell installs it without dependencies for that reason), and Unsloth
# declares xformers, which it does not import on this path.
EXPECTED_CHECK_LINES = (r"^unsloth([-_]zoo)? 2026\.10\.9 has requirement certifi>=2026\.10\.19, but you have certifi ",
                        r"^unsloth 2026\.10\.9 requires xformers, which is not installed\.$")

colab_sim = pytest.mark.skipif(os.environ.get("NF4_COLAB_SIM") != "1",
                               reason="builds a Colab-like environment (minutes, GBs): set NF4_COLAB_SIM=1")


def install_cell(name):
    """The source of a notebook's install cell (the code cell that defines IN_COLAB)."""
    with open(os.path.join(ROOT, name)) as file:
        cells = json.load(file)["cells"]
    (source,) = ["".join(cell["source"]) for cell in cells
                 if cell["cell_type"] == "code" and "IN_COLAB = " in "".join(cell["source"])]
    return source


def run(command, **kwargs):
    result = subprocess.run(command, capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, f"{command[:4]}...: {result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout


def versions(python):
    code = ("from importlib.metadata import version\n"
            f"print(dict((name, version(name)) for name in {HELD!r}))")
    return run([python, "-c", code]).strip()


def colab_python():
    """Python 3.13 as Colab has it, where this machine has one that runs (a pyenv shim may not);
    else the Python running the tests."""
    candidates = [shutil.which("python3.13")] + sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.13*/bin/python3.13")))
    for candidate in filter(None, candidates):
        if subprocess.run([candidate, "-c", "import venv"], capture_output=True).returncode == 0:
            return candidate
    return sys.executable


def test_both_notebooks_install_the_same():
    assert install_cell("nf4_dequant_T4.ipynb") == install_cell("nf4_dequant_L4.ipynb")


@contextlib.contextmanager
def scratch_folder():
    """A folder for the Colab-like environment (about 6 GB with its CUDA libraries), removed afterwards."""
    folder = pathlib.Path(tempfile.mkdtemp(prefix="nf4-colab-sim-"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder)


def test_the_environment_is_removed_afterwards():
    with scratch_folder() as folder:
        (folder / "colab" / "bin").mkdir(parents=True)
    assert not folder.exists()


@colab_sim
def test_install_cell_on_a_colab_like_stack():
    with scratch_folder() as folder:
        install_and_import(folder)


def install_and_import(folder):
    """Colab's stack in a venv under `folder`, the install cell run there, then the project installed and imported."""
    base = colab_python()
    venv = folder / "colab"
    run([base, "-m", "venv", str(venv)])
    python = str(venv / "bin" / "python")
    run([python, "-m", "pip", "install", "-q", "--upgrade", "pip"])
    run([python, "-m", "pip", "install", "-q"] + COLAB_STACK, timeout=1800)
    before = versions(python)
    print("Colab-like stack:", run([python, "-c", "import sys; print('Python', sys.version.split()[0])"]).strip(), before)

    # The cell as written, in a process where `google.colab` is imported, as in Colab.
    script = folder / "install_cell.py"
    script.write_text("import sys, types\nsys.modules['google.colab'] = types.ModuleType('google.colab')\n"
                      + install_cell("nf4_dequant_T4.ipynb"))
    output = run([python, str(script)], cwd=folder, timeout=1800)
    assert "held: torch==" in output

    assert versions(python) == before
    check = subprocess.run([python, "-m", "pip", "check"], capture_output=True, text=True).stdout
    unexpected = [line for line in check.splitlines()
                  if line.strip() and not any(re.search(pattern, line) for pattern in EXPECTED_CHECK_LINES)]
    assert not unexpected, check

    # The project installed with pip, then imported with what it needs; Unsloth's package is there
    # (importing it needs a GPU).
    project = folder / "project"  # built from a copy: the build leaves files beside the sources
    files = project_files()
    shutil.copytree(ROOT, project, ignore=lambda source, names: [n for n in names if n not in files]
                    if source == ROOT else [n for n in names if n == "__pycache__"])
    run([python, "-m", "pip", "install", "-q", "--no-deps", str(project)], timeout=600)
    run([python, "-c", "import bitsandbytes, importlib.util, nf4_triton, nf4_triton.kernel; "
                       "assert importlib.util.find_spec('unsloth') and importlib.util.find_spec('unsloth_zoo'); "
                       "assert importlib.util.find_spec('bench') is None; print(nf4_triton.kernel.INTERPRET)"], cwd=folder)
