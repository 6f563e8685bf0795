import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import bench.weights  # found through the path set above

HAS_CUDA = torch.cuda.is_available()

bench.weights.quiet_bitsandbytes_cpu_notice()


def pytest_addoption(parser):
    parser.addoption("--long", action="store_true",
                     help="on a GPU, also the long tail: the full fuzz, 10,000-call memory, more than 2**31 elements, "
                          "threads, the ahead-of-time compiles and the notebooks' smoke runs (the CPU always runs the last two)")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu(n=1): needs n CUDA GPUs (skipped with fewer); the one way to mark GPU tests")
    config.addinivalue_line("markers", "long: on a GPU, the long tail, run with --long (a CPU runs what it can of it)")


def pytest_collection_modifyitems(config, items):
    gpus = torch.cuda.device_count() if HAS_CUDA else 0
    for item in items:
        marker = item.get_closest_marker("gpu")
        needed = (marker.args[0] if marker.args else 1) if marker else 0
        if needed > gpus:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU" if needed == 1 else f"needs {needed} GPUs"))
        elif HAS_CUDA and "long" in item.keywords and not config.getoption("--long"):
            item.add_marker(pytest.mark.skip(reason="the long tail: run with --long"))


@pytest.fixture(scope="session")
def device():
    """Where the kernel runs: the GPU when there is one, else CPU tensors through the interpreter."""
    return "cuda" if HAS_CUDA else "cpu"
