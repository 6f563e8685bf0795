"""Section ``forms``: host time per call of every documented way to dequantize a Linear4bit and of
bitsandbytes' own, calls issued back to back, rounds interleaved. Rows ``forms`` (seconds)."""

import statistics

import torch

import bench.results
import bench.timing
import bench.weights
from nf4_triton import kernel

FORMS_SHAPE = (2048, 5632)  # out x in: a projection of the small end-to-end model


def call_forms(layer, device=None):
    """Every documented way to dequantize a Linear4bit, and bitsandbytes' own, by name; with
    ``device``, the same calls made while that device is current."""
    import bitsandbytes.functional as F

    weight = layer.weight
    forms = {
        "dequantize_nf4(layer)": lambda: kernel.dequantize_nf4(layer),
        "dequantize_nf4(params4bit)": lambda: kernel.dequantize_nf4(layer.weight),
        "dequantize_nf4(params4bit, state)": lambda: kernel.dequantize_nf4(layer.weight, weight.quant_state),
        "dequantize_nf4(packed, state)": lambda: kernel.dequantize_nf4(weight.data, weight.quant_state),
        "your_dequantize_nf4(layer)": lambda: kernel.your_dequantize_nf4(layer),
        "bitsandbytes dequantize_4bit(packed, state)": lambda: F.dequantize_4bit(weight.data, weight.quant_state),
    }
    if device is None:
        return forms

    def on(fn):
        def call():
            with torch.cuda.device(device):
                return fn()
        return call

    return {f"{name} [cuda:{device} current]": on(fn) for name, fn in forms.items()}


def run(rounds, meta, log, calls=2000):
    """Host time per call of each call form, issued back to back (the GPU's queue never drains:
    this is the time a model's forward pays per layer on the host), rounds interleaved."""
    import bitsandbytes as bnb

    rows = []
    for dtype_name, dtype in bench.weights.DTYPES.items():
        torch.manual_seed(0)
        layer = bnb.nn.Linear4bit(FORMS_SHAPE[1], FORMS_SHAPE[0], bias=False, compute_dtype=dtype,
                                  quant_type="nf4").cuda()
        layer.weight.quant_state.dtype = dtype
        forms = call_forms(layer)
        if torch.cuda.device_count() > 1:
            forms.update(call_forms(layer, device=1))
        expected = bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state)
        for name, fn in forms.items():
            if not torch.equal(fn(), expected):
                raise AssertionError(f"forms: {name} is not bit-exact")
        samples = {name: [] for name in forms}
        for round_index in range(rounds):
            for name in list(forms) if round_index % 2 == 0 else reversed(forms):
                samples[name].append(bench.timing.host_time_per_call(forms[name], calls))
        shape = f"{FORMS_SHAPE[0]}x{FORMS_SHAPE[1]}"
        rows += [bench.results.seconds_row(meta, "forms", shape, dtype_name, name, times) for name, times in samples.items()]
        log(f"forms {dtype_name} {shape}, host us per call: " + ", ".join(
            f"{name} {statistics.median(times) * 1e6:.1f}" for name, times in samples.items()))
    return rows
