"""Every launch that ``nf4_linear`` and ``nf4_linear_group`` make over the route tables, captured on the CPU: for
each call, the path it takes and each kernel launch's kernel, grid, arguments and options, as JSON lines. Two runs
that print the same lines show a change left what the calls launch as it was.

    python -m tools.launches > before.jsonl; ...; python -m tools.launches > after.jsonl; diff before.jsonl after.jsonl

Nothing is launched: the kernels are replaced by recorders, the device's facts by each GPU's, and the tensors are
empty CPU tensors of the layers' real sizes.
"""

import importlib
import json
import os
import sys

import bitsandbytes.functional
import torch
import torch.nn.functional

# (in, out): Llama-3-8B's q/o, k/v, gate/up, down, q|k|v and gate|up merged; a 70B model's layers
LAYERS = [(4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096), (4096, 6144), (4096, 28672), (8192, 8192),
          (8192, 28672), (28672, 8192), (4096, 11008), (1024, 4096)]
ROWS = [1, 2, 3, 4, 5, 8, 12, 16, 24, 32, 48, 64, 96, 128, 129, 192, 256, 512]
# (name, compute capability, L2 bytes, peak DRAM GB/s, whether mma.py's kernel runs)
GPUS = [("H100", (9, 0), 50 << 20, 3352, True), ("H200", (9, 0), 60 << 20, 4813, True),
        ("A100", (8, 0), 40 << 20, 1555, True), ("L4", (8, 9), 48 << 20, 300, True), ("T4", (7, 5), 4 << 20, 320, False),
        ("H100 without Gluon", (9, 0), 50 << 20, 3352, False)]
GROUPS = [(4096, (4096, 1024, 1024)), (4096, (14336, 14336)), (8192, (8192, 1024, 1024))]

LAUNCHED = []
ROLES = {}


def describe(value):
    if isinstance(value, torch.Tensor):
        return ROLES.get(value.data_ptr(), f"new {value.dtype} {tuple(value.shape)}")
    return value if isinstance(value, (int, float, bool, str, type(None))) else repr(value)


class Recorder:
    """Stands in for a jitted kernel: ``kernel[grid](*args, **options)`` records the launch."""

    def __init__(self, name, jitted):
        self.name, self.arg_names = name, jitted.arg_names

    def __getitem__(self, grid):
        def launch(*args, **options):
            LAUNCHED.append(dict(kernel=self.name, grid=list(grid), args=[describe(arg) for arg in args],
                                 options={key: describe(value) for key, value in sorted(options.items())}))
        return launch


def patch(gpu):
    """The process as on ``gpu``: its facts, whether mma.py's kernel runs, no stream capture, kernels recorded."""
    _, capability, l2_bytes, dram_gbps, gluon = gpu
    facts = lambda device=None: (capability, l2_bytes, dram_gbps)
    kernel, fused = (sys.modules[f"nf4_triton.{name}"] for name in ("kernel", "fused"))
    for module in [module for name, module in sys.modules.items() if name.startswith("nf4_triton.")]:
        if hasattr(module, "device_facts"):
            module.device_facts = facts
        for name, value in list(vars(module).items()):
            if hasattr(value, "arg_names") and hasattr(value, "fn") and not isinstance(value, Recorder):
                setattr(module, name, Recorder(name, value))
    fused.gluon_runs_on = lambda cap, gluon=gluon: gluon and tuple(cap) >= (8, 0)
    torch.cuda.is_current_stream_capturing = lambda: False
    fused.fold_counters = lambda device, tiles, capturing: torch.zeros(4096, dtype=torch.int32) if tiles <= 4096 else None
    kernel.dequantize_nf4 = lambda packed, state, **_: (LAUNCHED.append(dict(path="dequantize", dtype=str(state.dtype)))
                                                        or torch.empty(tuple(state.shape), dtype=state.dtype))
    torch.nn.functional.linear = lambda x, w, b=None: torch.empty(*x.shape[:-1], w.shape[0], dtype=x.dtype)
    import bitsandbytes
    bitsandbytes.matmul_4bit = lambda x, packed, quant_state, bias=None: (
        LAUNCHED.append(dict(path="bitsandbytes")) or torch.empty(x.shape[0], quant_state.shape[0], dtype=x.dtype))


def weight(in_features, out_features, dtype):
    """An NF4 weight (double-quantized absmax) of real sizes, its tensors empty, and their roles named."""
    n = in_features * out_features
    packed = torch.empty(n // 2, 1, dtype=torch.uint8)
    state2 = bitsandbytes.functional.QuantState(absmax=torch.empty(-(-n // (64 * 256))), code=torch.empty(256),
                                                blocksize=256, dtype=torch.float32)
    state = bitsandbytes.functional.QuantState(absmax=torch.empty(n // 64, dtype=torch.uint8), shape=(out_features, in_features),
                                               code=torch.empty(16), blocksize=64, quant_type="nf4", dtype=dtype,
                                               offset=torch.empty(()), state2=state2)
    return packed, state


def name_roles(prefix, packed, state):
    for role, tensor in (("packed", packed), ("absmax", state.absmax), ("code", state.code), ("offset", state.offset),
                         ("absmax2", state.state2.absmax), ("code2", state.state2.code)):
        ROLES[tensor.data_ptr()] = f"{prefix}{role}"


def capture(label, x, call):
    """Print what ``call`` launches for the input ``x``; tensors are named by their roles, a new one by its shape."""
    LAUNCHED.clear()
    ROLES[x.data_ptr()] = "x"
    call()
    del ROLES[x.data_ptr()]  # its memory may be the next call's output
    print(json.dumps(dict(point=label, launches=list(LAUNCHED))), flush=True)


def main():
    os.environ["TRITON_INTERPRET"] = "0"  # the compiled kernels' definitions, as on a GPU
    os.environ["NF4_TRITON_PLANS"] = "0"  # every launch through Triton's own path (here: the recorders)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    matmul = importlib.import_module("nf4_triton.matmul")
    for gpu in GPUS:
        patch(gpu)
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for in_features, out_features in LAYERS:
                ROLES.clear()
                packed, state = weight(in_features, out_features, dtype)
                name_roles("", packed, state)
                for rows in ROWS:
                    x = torch.empty(rows, in_features, dtype=dtype)
                    capture([gpu[0], str(dtype), in_features, out_features, rows], x,
                            lambda: matmul.nf4_linear(x, packed, state))
            if dtype is torch.float32:
                continue
            for in_features, outs in GROUPS:
                ROLES.clear()
                layers = [weight(in_features, count, dtype) for count in outs]
                for index, (packed, state) in enumerate(layers):
                    name_roles(f"member {index} ", packed, state)
                    packed.quant_state = state  # a weight that carries its state, as a Params4bit does
                layers = [packed for packed, _ in layers]
                for rows in ROWS:
                    x = torch.empty(rows, in_features, dtype=dtype)
                    is_cuda = torch.Tensor.is_cuda
                    torch.Tensor.is_cuda = property(lambda self: True)  # group_plan's own device check
                    try:
                        capture([gpu[0], str(dtype), "group", in_features, list(outs), rows], x,
                                lambda: matmul.nf4_linear_group(x, layers))
                    finally:
                        torch.Tensor.is_cuda = is_cuda


if __name__ == "__main__":
    main()
