"""The drop-in (dropin.enable): bitsandbytes' Linear4bit layers computed through the kernel.
Everywhere: against F.linear / matmul on the expected weight (bitsandbytes' own dequantizing
arithmetic). On a GPU also against bitsandbytes' own forward and backward."""

import copy
import io

import pytest
import torch
import torch.nn.functional as F

from helpers import (
    assert_bit_exact,
    assert_unchanged,
    bit_exact,
    expected_values,
    failures_in_threads,
    in_a_fresh_process,
    linear4bit,
    quantize,
    snapshot,
)
from nf4_triton import dropin, fastpath, kernel, matmul, routes
from reference import linear_error_bound, linear_reference

DTYPES = [torch.float16, torch.bfloat16]
# Rows above bitsandbytes' fused-kernel range (1536): inference there is dequantize + matmul, so
# the drop-in computes it and F.linear on the expected weight is bitsandbytes' own arithmetic.
ROWS = 1600


class TwoLayers(torch.nn.Module):
    """An MLP of two Linear4bit layers (odd sizes) with a plain Linear between, as in a model."""

    def __init__(self, device, dtype, bias=False):
        super().__init__()
        self.up, _, _ = linear4bit((96, 64), dtype=dtype, device=device, bias=bias, seed=1)
        self.mix = torch.nn.Linear(96, 96, dtype=dtype, device=device)
        self.down, _, _ = linear4bit((64, 96), dtype=dtype, device=device, bias=bias, seed=2)

    def forward(self, x):
        return self.down(F.silu(self.mix(self.up(x))))


def expected_weight(layer):
    return expected_values(layer.weight.data, layer.weight.quant_state)


def counted(calls):
    """The kernel's dequantize, appending to ``calls`` each time the drop-in uses it."""
    def dequantize(packed, state):
        calls.append(1)
        return kernel.dequantize_nf4(packed, state)

    return dequantize


def test_enable_and_disable(device):
    model = TwoLayers(device, torch.bfloat16)
    before = [snapshot(layer.weight.data, layer.weight.quant_state) for layer in (model.up, model.down)]
    class_forward = type(model.up).forward
    assert dropin.enable(model) == 2
    assert dropin.enable(model) == 2  # again: nothing changes
    assert dropin.is_enabled(model.up) and dropin.is_enabled(model.down)
    assert "forward" in vars(model.up) and type(model.up).forward is class_forward
    assert dropin.disable(model) == 2
    assert dropin.disable(model) == 0
    assert "forward" not in vars(model.up) and not dropin.is_enabled(model.up)
    for layer, saved in zip((model.up, model.down), before):
        assert_unchanged(layer.weight.data, layer.weight.quant_state, saved)


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_and_backward(dtype, bias, device):
    """Forward F.linear(x, W, bias) (bitsandbytes' fused op where its rule takes these rows), input gradient
    matmul(grad, W), bias gradient summed over dim 0 and then the rest, as bitsandbytes and autograd sum it:
    bit-exact with W bitsandbytes' weight, and the weights and states untouched."""
    layer, packed, state = linear4bit((96, 64), dtype=dtype, device=device, bias=bias, seed=3)
    saved = snapshot(packed, state)
    weight = expected_weight(layer)
    x = torch.randn(3, 5, 64, dtype=dtype, device=device, requires_grad=True)
    grad = torch.randn(3, 5, 96, dtype=dtype, device=device)
    dropin.enable(layer)
    out = layer(x)
    with torch.no_grad():
        fused = dropin.bitsandbytes_fuses(x, dtype, state)
        expected = (dropin.bitsandbytes_fused_matmul(x, packed, state, layer.bias) if fused
                    else F.linear(x, weight, layer.bias))
    assert_bit_exact(out, expected)
    out.backward(grad)
    assert_bit_exact(x.grad, torch.matmul(grad, weight))
    if bias:
        assert_bit_exact(layer.bias.grad, grad.sum(0).sum(0))
    assert_unchanged(packed, state, saved)


def assert_fused_result(y, x, layer, route):
    """The drop-in's fused inference result: nf4_linear's own through the same route, bit for bit,
    and within the contract's bound of the exact product (tests/test_matmul.py)."""
    assert_bit_exact(y, matmul.linear_by_route(x, layer.weight.data, layer.weight.quant_state, None, route))
    weight = expected_weight(layer)
    error = (y.cpu().double() - linear_reference(x, weight)).abs()
    assert (error <= linear_error_bound(y, x, weight)).all()


def test_inference_rows_through_the_fused_matmul(device, monkeypatch):
    """Where the route is the fused matmul (forced here, so that the CPU's interpreter runs it in
    fp16), inference computes through it; with a gradient, and with fused=False, bitsandbytes'
    arithmetic stays."""
    route = routes.Route(16, "fused", routes.TlConfig(16, 16, 64, lookup=0))
    monkeypatch.setattr(dropin, "fused_route", lambda x, state: (route, fastpath.device_facts(x.device)[0]))
    layer, _, _ = linear4bit((96, 64), dtype=torch.float16, device=device, seed=7)
    weight = expected_weight(layer)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(7)).half().to(device)
    with torch.no_grad():
        expected = layer(x)  # bitsandbytes' forward: on a GPU, its fused kernel at 3 rows
    dropin.enable(layer)
    with torch.no_grad():
        assert_fused_result(layer(x), x, layer, route)
    assert_bit_exact(layer(x.clone().requires_grad_()), F.linear(x, weight))
    dropin.enable(layer, fused=False)
    with torch.no_grad():
        assert_bit_exact(layer(x), expected)


def test_no_weight_kept_between_forward_and_backward(device):
    """Backward dequantizes again: forward's weight is not saved for it."""
    layer, _, _ = linear4bit((96, 64), device=device, seed=4)
    calls = []
    dropin.enable(layer, dequantize=lambda *args: calls.append(1) or kernel.dequantize_nf4(*args))
    x = torch.randn(4, 64, dtype=torch.bfloat16, device=device, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: pytest.fail(f"saved {tuple(t.shape)}"), lambda t: t):
        out = layer(x)
    out.sum().backward()
    assert len(calls) == 2


def test_model_gradients_with_checkpointing(device):
    """Gradient checkpointing recomputes the forward in backward: same gradients, bit-exact."""
    model = TwoLayers(device, torch.bfloat16)
    dropin.enable(model)
    x = torch.randn(2, 7, 64, dtype=torch.bfloat16, device=device)
    grads = []
    for checkpointed in (False, True):
        model.zero_grad()
        inputs = x.clone().requires_grad_()
        out = (torch.utils.checkpoint.checkpoint(model, inputs, use_reentrant=False) if checkpointed
               else model(inputs))
        out.float().square().sum().backward()
        grads.append((out, inputs.grad, model.mix.weight.grad))
    for plain, checkpointed in zip(*grads):
        assert_bit_exact(checkpointed, plain)


def test_model_equals_unrouted_arithmetic(device):
    """The routed model equals the same model with every Linear4bit replaced by F.linear on its
    expected weight (what bitsandbytes computes where it dequantizes)."""
    model = TwoLayers(device, torch.bfloat16, bias=True)
    dense = copy.deepcopy(model)
    for name in ("up", "down"):
        layer = getattr(model, name)
        linear = torch.nn.Linear(layer.in_features, layer.out_features, dtype=torch.bfloat16, device=device)
        linear.weight.data, linear.bias.data = expected_weight(layer), layer.bias.data.clone()
        setattr(dense, name, linear)
    x = torch.randn(2, ROWS // 2, 64, dtype=torch.bfloat16, device=device)
    dropin.enable(model)
    assert_bit_exact(model(x), dense(x))


def test_other_weight_dtype_keeps_bitsandbytes(device):
    """A state whose dtype is not the compute dtype: bitsandbytes dequantizes straight to the
    compute dtype (one rounding), so its own forward is kept."""
    layer, _, state = linear4bit((96, 64), dtype=torch.float32, device=device, seed=5)
    layer.compute_dtype = torch.bfloat16
    x = torch.randn(4, 64, dtype=torch.bfloat16, device=device)
    expected = layer(x)
    calls = []
    dropin.enable(layer, dequantize=counted(calls))
    assert_bit_exact(layer(x), expected)
    assert calls == []


def test_state_kept_on_the_module(device):
    """FSDP replaces a Params4bit with a plain view of its bytes, without its quant state;
    bitsandbytes keeps the state on the module too. The drop-in reads it there, writes nothing."""
    layer, packed, state = linear4bit((96, 64), device=device, seed=6)
    x = torch.randn(ROWS, 64, dtype=torch.bfloat16, device=device)
    expected = F.linear(x, expected_weight(layer))
    view = packed.reshape(-1).view(torch.bfloat16).reshape(-1, 1)  # quant_storage=bfloat16, as FSDP QLoRA stores it
    del layer.weight
    layer.weight = view
    layer.quant_state = state
    dropin.enable(layer)
    assert_bit_exact(layer(x), expected)
    assert layer.weight is view and not hasattr(view, "quant_state")


def test_no_state_anywhere_goes_to_bitsandbytes(device, monkeypatch):
    layer, _, _ = linear4bit((96, 64), device=device, seed=6)
    layer.weight.quant_state = None
    dropin.enable(layer)
    seen = []
    monkeypatch.setattr(dropin, "bitsandbytes_forward", lambda module, x: seen.append(1) or x)
    layer(torch.randn(4, 64, dtype=torch.bfloat16, device=device))
    assert seen == [1]


def test_accelerate_hook_stays_outside(device):
    """Accelerate's hooks (device_map) call the forward they saved as `_old_forward`: that one is
    routed and the hook kept; disable puts it back."""
    layer, _, _ = linear4bit((96, 64), device=device, seed=7)
    seen = []
    saved = layer.forward
    layer._old_forward = saved
    layer.forward = lambda x: seen.append(1) or layer._old_forward(x)
    hook = layer.forward
    dropin.enable(layer)
    assert layer.forward is hook and dropin.is_enabled(layer)
    x = torch.randn(ROWS, 64, dtype=torch.bfloat16, device=device)
    assert_bit_exact(layer(x), F.linear(x, expected_weight(layer)))
    assert seen == [1]
    dropin.disable(layer)
    assert layer.forward is hook and layer._old_forward == saved


def test_peft_lora_base_layers(device):
    """PEFT LoRA wraps each Linear4bit: the base layers are routed, the adapters untouched, and
    the adapters' gradients equal those of the unrouted arithmetic."""
    peft = pytest.importorskip("peft")
    model = TwoLayers(device, torch.bfloat16)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["up", "down"], init_lora_weights=False)
    model = peft.get_peft_model(model, config)
    assert dropin.enable(model) == 2
    x = torch.randn(2, ROWS // 2, 64, dtype=torch.bfloat16, device=device)
    out = model(x)
    out.float().square().sum().backward()
    routed = [p.grad.clone() for name, p in model.named_parameters() if "lora_" in name]
    assert routed and all(g.abs().sum() > 0 for g in routed)
    model.zero_grad()
    dropin.disable(model)
    base = model.base_model.model
    for name in ("up", "down"):  # the base layer's bitsandbytes arithmetic written out
        layer = getattr(base, name).base_layer
        layer.forward = (lambda w: lambda inputs: F.linear(inputs, w))(expected_weight(layer))
    expected_out = model(x)
    expected_out.float().square().sum().backward()
    assert_bit_exact(out, expected_out)
    for got, expected in zip(routed, [p.grad for name, p in model.named_parameters() if "lora_" in name]):
        assert_bit_exact(got, expected)


def test_compiled_forward_and_backward_without_graph_break(device):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = TwoLayers(device, torch.bfloat16)
    dropin.enable(model)
    x = torch.randn(2, ROWS // 2, 64, dtype=torch.bfloat16, device=device)

    def step(inputs):
        inputs = inputs.clone().requires_grad_()
        out = model(inputs)
        out.float().square().sum().backward()
        return out, inputs.grad

    expected = step(x)
    compiled = torch.compile(model, fullgraph=True)
    inputs = x.clone().requires_grad_()
    out = compiled(inputs)
    out.float().square().sum().backward()
    assert not counters["graph_break"]
    assert_bit_exact(out, expected[0])
    torch.testing.assert_close(inputs.grad, expected[1], rtol=0, atol=0)


# ---- a model's life: Accelerate's hooks, saving, which layers are routed ---------------------
@pytest.fixture
def accelerate_hooks():
    return pytest.importorskip("accelerate.hooks")


def counting_hook(accelerate_hooks):
    """An Accelerate hook whose ``calls`` counts the forwards it wraps."""

    class CountingHook(accelerate_hooks.ModelHook):
        calls = 0

        def pre_forward(self, module, *args, **kwargs):
            self.calls += 1
            return args, kwargs

    return CountingHook()


def layer_and_input(device, seed):
    """A layer, an input above bitsandbytes' fused-kernel rows (the drop-in dequantizes), and
    bitsandbytes' own output for it."""
    layer, _, _ = linear4bit((96, 64), device=device, seed=seed)
    x = torch.randn(ROWS, 64, dtype=torch.bfloat16, device=device)
    return layer, x, layer(x)


def test_hook_removed_after_enable_then_disable(device, accelerate_hooks):
    """A hook present at enable and removed before disable (PEFT's offloaded loading, transformers'
    dequantize): the layer stays routed without it, and disable gives bitsandbytes' forward back."""
    layer, x, bitsandbytes_out = layer_and_input(device, seed=60)
    calls = []
    accelerate_hooks.add_hook_to_module(layer, counting_hook(accelerate_hooks))
    dropin.enable(layer, dequantize=counted(calls))
    accelerate_hooks.remove_hook_from_module(layer)
    assert dropin.is_enabled(layer)
    assert_bit_exact(layer(x), F.linear(x, expected_weight(layer)))
    assert dropin.disable(layer) == 1
    assert not dropin.is_enabled(layer) and "forward" not in vars(layer)
    assert_bit_exact(layer(x), bitsandbytes_out)
    assert len(calls) == 1


def test_hook_added_after_enable_survives_disable(device, accelerate_hooks):
    """A hook added to a routed layer wraps the routed forward; disable keeps the hook (it goes on
    running around bitsandbytes' forward) and the hook can still be removed."""
    layer, x, bitsandbytes_out = layer_and_input(device, seed=61)
    calls, hook = [], counting_hook(accelerate_hooks)
    dropin.enable(layer, dequantize=counted(calls))
    accelerate_hooks.add_hook_to_module(layer, hook)
    assert_bit_exact(layer(x), F.linear(x, expected_weight(layer)))
    assert (len(calls), hook.calls) == (1, 1)
    assert dropin.disable(layer) == 1 and not dropin.is_enabled(layer)
    assert_bit_exact(layer(x), bitsandbytes_out)
    assert (len(calls), hook.calls) == (1, 2)
    accelerate_hooks.remove_hook_from_module(layer)
    assert "forward" not in vars(layer) or vars(layer)["forward"] == type(layer).forward.__get__(layer)
    assert_bit_exact(layer(x), bitsandbytes_out)
    assert hook.calls == 2


def saved_and_loaded(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("duplicate", [saved_and_loaded, copy.deepcopy], ids=["torch.save", "deepcopy"])
def test_routed_model_saved_or_copied(duplicate, device):
    """A routed model saved and loaded (or deep-copied): the copy is routed, computes with its own
    weights (the original's rewritten afterwards changes nothing) and is disabled on its own."""
    model = TwoLayers(device, torch.bfloat16)
    x = torch.randn(2, ROWS // 2, 64, dtype=torch.bfloat16, device=device)
    dropin.enable(model)
    expected = model(x)
    duplicated = duplicate(model)
    model.up.weight.data.copy_(linear4bit((96, 64), device=device, seed=69)[1])
    assert not bit_exact(model(x), expected)
    assert dropin.is_enabled(duplicated.up) and dropin.is_enabled(duplicated.down)
    assert_bit_exact(duplicated(x), expected)
    assert dropin.disable(duplicated) == 2 and dropin.is_enabled(model.down)


def test_subclass_with_its_own_forward_is_left_alone(device):
    """A Linear4bit subclass that overrides forward computes something else: it is not routed
    (its forward is kept); one that keeps bitsandbytes' forward is."""
    import bitsandbytes as bnb

    class HalvedLinear4bit(bnb.nn.Linear4bit):
        def forward(self, x):
            return super().forward(x) * 0.5

    class NamedLinear4bit(bnb.nn.Linear4bit):
        pass

    halved, x, _ = layer_and_input(device, seed=62)
    halved.__class__ = HalvedLinear4bit  # the same layer with the subclass's forward
    named, _, _ = linear4bit((96, 64), device=device, seed=63)
    named.__class__ = NamedLinear4bit
    halved_out = halved(x)
    model = torch.nn.ModuleDict({"halved": halved, "named": named})
    calls = []
    assert dropin.enable(model, dequantize=counted(calls)) == 1
    assert not dropin.is_enabled(halved) and dropin.is_enabled(named)
    assert_bit_exact(halved(x), halved_out)
    assert calls == []
    assert_bit_exact(named(x), F.linear(x, expected_weight(named)))
    assert calls == [1]


@pytest.mark.parametrize("shape, storage", [((1, 2), torch.uint8), ((2, 4), torch.float32)],
                         ids=["Linear4bit(2, 1) uint8", "Linear4bit(4, 2) float32"])
def test_layer_whose_packed_weight_has_one_row(shape, storage, device):
    """A packed weight of one row comes back transposed (bitsandbytes' rule): the drop-in still
    computes x @ W.t() with W of the layer's (out, in) shape, forward and backward."""
    import bitsandbytes as bnb

    packed, state = quantize(shape, dtype=torch.bfloat16, storage=storage, device=device, seed=64)
    assert packed.shape[0] == 1
    layer = bnb.nn.Linear4bit(shape[1], shape[0], bias=False, compute_dtype=torch.bfloat16, quant_type="nf4",
                              quant_storage=storage, device=device)
    layer.weight = bnb.nn.Params4bit(packed, requires_grad=False, quant_state=state, bnb_quantized=True, module=layer)
    weight = expected_values(packed, state).t()
    assert weight.shape == shape
    dropin.enable(layer)
    x = torch.randn(ROWS, shape[1], dtype=torch.bfloat16, device=device, requires_grad=True)
    out = layer(x)
    assert_bit_exact(out, F.linear(x, weight))
    grad = torch.randn_like(out)
    out.backward(grad)
    assert_bit_exact(x.grad, torch.matmul(grad, weight))
    with torch.no_grad():
        assert_bit_exact(layer(x), F.linear(x, weight))


def cpu_repacked_layer(seed):
    """A CPU layer in the layout bitsandbytes' forward repacks it to on its first inference call on
    a CPU with AVX512-BF16 (done here by bitsandbytes' own conversion, on any CPU)."""
    from bitsandbytes.functional import _convert_weight_packed_for_cpu

    layer, packed, state = linear4bit((96, 64), seed=seed)
    layer.weight.data, layer.weight.quant_state = _convert_weight_packed_for_cpu(packed, state)
    return layer


def test_cpu_repacked_layer_goes_to_bitsandbytes(monkeypatch):
    """A layer in bitsandbytes' CPU layout is computed by bitsandbytes' forward, which reads it."""
    layer = cpu_repacked_layer(seed=65)
    calls, handed = [], []
    dropin.enable(layer, dequantize=counted(calls))
    monkeypatch.setattr(dropin, "bitsandbytes_forward", lambda module, x: handed.append(module) or x)
    with torch.no_grad():
        layer(torch.randn(4, 64, dtype=torch.bfloat16))
    assert handed == [layer] and calls == []


def test_cpu_tensors_without_the_interpreter_go_to_bitsandbytes(monkeypatch):
    """On a GPU host Triton's interpreter is off: a layer on the CPU, merged or not, computes through
    bitsandbytes' own forward, never a kernel that cannot run CPU tensors."""
    monkeypatch.setattr(fastpath, "INTERPRET", False)
    model = Projections("cpu", torch.bfloat16)
    calls, handed = [], []
    dropin.enable(model, dequantize=counted(calls), merge=True)
    monkeypatch.setattr(dropin, "bitsandbytes_forward", lambda module, x: handed.append(module) or x[..., :1])
    with torch.no_grad():
        model(torch.randn(2, 512, dtype=torch.bfloat16))
    assert len(handed) == 6 and calls == []


def test_cpu_repacked_weight_named_by_dequantize():
    with pytest.raises(ValueError, match="bitsandbytes' CPU layout"):
        kernel.dequantize_nf4(cpu_repacked_layer(seed=66))


def test_layer_repacked_by_bitsandbytes_on_this_cpu():
    """The repack as it happens: bitsandbytes' first inference forward on a CPU with AVX512-BF16.
    After it, the routed layer gives what bitsandbytes' forward gives."""
    layer, _, _ = linear4bit((96, 64), seed=67)
    if not layer.support_avx512bf16_for_cpu:
        pytest.skip("bitsandbytes repacks for its CPU kernel only on CPUs with AVX512-BF16")
    layer.eval()
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = layer(x)
        assert layer.weight.quant_state.packing_format_for_cpu
        calls = []
        dropin.enable(layer, dequantize=counted(calls))
        assert_bit_exact(layer(x), expected)
    assert calls == []


def test_enable_again_with_another_dequantize(device):
    """enable on a routed model routes through the dequantize named now (the kernel when none)."""
    layer, x, bitsandbytes_out = layer_and_input(device, seed=68)
    first, second = [], []
    expected = F.linear(x, expected_weight(layer))
    assert dropin.enable(layer, dequantize=counted(first)) == 1
    assert_bit_exact(layer(x), expected)
    assert dropin.enable(layer, dequantize=counted(second)) == 1
    assert_bit_exact(layer(x), expected)
    assert (len(first), len(second)) == (1, 1)
    assert dropin.enable(layer) == 1
    assert_bit_exact(layer(x), expected)
    assert (len(first), len(second)) == (1, 1)
    assert dropin.disable(layer) == 1
    assert_bit_exact(layer(x), bitsandbytes_out)


# ---- GPU: against bitsandbytes' own forward and backward --------------------------------------
def bitsandbytes_layer(shape, dtype, bias):
    import bitsandbytes as bnb

    torch.manual_seed(shape[0])
    layer = bnb.nn.Linear4bit(shape[1], shape[0], bias=bias, compute_dtype=dtype, quant_type="nf4")
    layer.weight = bnb.nn.Params4bit(torch.randn(shape).to(dtype), requires_grad=False, quant_type="nf4",
                                     compress_statistics=True)
    layer = layer.cuda()
    if bias:
        layer.bias.data = layer.bias.data.to(dtype)
    return layer


@pytest.mark.gpu
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_training_step_equals_bitsandbytes(dtype, bias):
    """Above bitsandbytes' fused-kernel rows (1536) it dequantizes too: output and input gradient
    bit-exact with its own forward and backward."""
    layer = bitsandbytes_layer((640, 384), dtype, bias)
    x = torch.randn(2, 1000, 384, dtype=dtype, device="cuda")
    grad = torch.randn(2, 1000, 640, dtype=dtype, device="cuda")
    results = []
    for routed in (False, True):
        dropin.enable(layer) if routed else dropin.disable(layer)
        inputs = x.clone().requires_grad_()
        out = layer(inputs)
        out.backward(grad)
        results.append((out, inputs.grad))
    for expected, got in zip(*results):
        assert_bit_exact(got, expected)


def bitsandbytes_step(layer, x, grad, routed):
    """(output, x's gradient, the bias' gradient) of one step through ``layer``, bitsandbytes' own or the drop-in's."""
    dropin.enable(layer) if routed else dropin.disable(layer)
    if layer.bias is not None:
        layer.bias.grad = None
    inputs = x.clone().requires_grad_()
    out = layer(inputs)
    out.backward(grad)
    return out, inputs.grad, None if layer.bias is None else layer.bias.grad


@pytest.mark.parametrize("lead", [(6,), (2, 5), (4, 3, 2)], ids=["2-d", "3-d", "4-d"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_step_with_bias_equals_bitsandbytes(dtype, lead, device):
    """Output, input and bias gradients bit for bit bitsandbytes' for 2-D to 4-D inputs: its backward sums the
    bias' gradient over dim 0 in the bias' dtype and autograd the rest (summed at once over all rows, a 3-D
    bf16 input's differed by 0.031)."""
    layer, _, _ = linear4bit((48, 64), dtype=dtype, device=device, bias=True, seed=7)
    layer.bias.requires_grad_()
    generator = torch.Generator().manual_seed(len(lead))
    x = torch.randn(*lead, 64, generator=generator).to(dtype).to(device)
    grad = torch.randn(*lead, 48, generator=generator).to(dtype).to(device)
    expected, got = (bitsandbytes_step(layer, x, grad, routed) for routed in (False, True))
    for actual, want in zip(got, expected, strict=True):
        assert_bit_exact(actual, want)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1024, 512), (4096, 4096)], ids=str)
@pytest.mark.parametrize("rows", [1, 4, 16])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_step_where_bitsandbytes_fuses(dtype, rows, shape):
    """With a gradient at the rows bitsandbytes' rule may fuse, output and gradients are its own bits: its
    forward calls its fused op there, and so does the drop-in's."""
    layer = bitsandbytes_layer(shape, dtype, True)
    layer.bias.requires_grad_()
    x = torch.randn(rows, shape[1], dtype=dtype, device="cuda")
    grad = torch.randn(rows, shape[0], dtype=dtype, device="cuda")
    expected, got = (bitsandbytes_step(layer, x, grad, routed) for routed in (False, True))
    for actual, want in zip(got, expected, strict=True):
        assert_bit_exact(actual, want)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16])
def test_gpu_compiled_step_where_bitsandbytes_fuses(rows):
    """Compiled whole with a gradient at a few rows: bitsandbytes' op is called inside the graph, so output and
    input gradient are bitsandbytes' eager bits."""
    from torch._dynamo.utils import counters

    dtype = torch.bfloat16
    layer = bitsandbytes_layer((1024, 512), dtype, False)
    x = torch.randn(rows, 512, dtype=dtype, device="cuda")
    grad = torch.randn(rows, 1024, dtype=dtype, device="cuda")
    expected = bitsandbytes_step(layer, x, grad, False)
    dropin.enable(layer)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(layer, fullgraph=True)
    inputs = x.clone().requires_grad_()
    out = compiled(inputs)
    out.backward(grad)
    assert not counters["graph_break"]
    assert_bit_exact(out, expected[0])
    assert_bit_exact(inputs.grad, expected[1])


@pytest.mark.gpu
def test_gpu_threads_on_one_stream_through_unmerged_projections():
    """q, k and v of a decoder's sizes routed unmerged, two threads on the default stream at 16 rows (split-K
    routes whose sums a second kernel adds): every output its own input's (157 of 900 were not)."""
    dtype = torch.bfloat16
    layers = [linear4bit((rows, 4096), dtype=dtype, device="cuda", seed=rows)[0] for rows in (4096, 1024, 1024)]
    for layer in layers:
        dropin.enable(layer)
    xs = [torch.randn(16, 4096, dtype=dtype, device="cuda") for _ in range(2)]

    def projections(x):
        return [layer(x) for layer in layers]

    with torch.no_grad():
        expected = [projections(x) for x in xs]
        results = [[] for _ in xs]

        def work(i):
            for _ in range(100):
                results[i].append(projections(xs[i]))

        failures = failures_in_threads(work, len(xs))
        torch.cuda.synchronize()
    assert not failures, failures
    wrong = sum(not torch.equal(y, want) for calls, wants in zip(results, expected) for ys in calls
                for y, want in zip(ys, wants))
    assert wrong == 0, f"{wrong} of {3 * sum(map(len, results))} outputs are not their own input's"


@pytest.mark.gpu
def test_gpu_merged_handoff_after_the_data_is_swapped(monkeypatch):
    """Merged, q's call computes k and v from x; ``x.data = other`` before k's call: k computes from the new
    data, not the old product."""
    model = Projections("cuda", torch.bfloat16)
    dropin.enable(model, merge=True)
    x = torch.randn(3, 512, dtype=torch.bfloat16, device="cuda")
    other = torch.randn(3, 512, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        expected = model.k_proj(other.clone())
        model.q_proj(x)
        x.data = other
        got = model.k_proj(x)
    assert_bit_exact(got, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 3, 16, 200, 2000])
def test_inference_equals_bitsandbytes(rows):
    """Inference with ``fused=False``: where bitsandbytes uses its fused kernel its forward is kept
    (same bits); where it dequantizes, ours gives its bits."""
    layer = bitsandbytes_layer((1024, 512), torch.bfloat16, False)
    x = torch.randn(rows, 512, dtype=torch.bfloat16, device="cuda")
    calls = []
    with torch.inference_mode():
        expected = layer(x)
        dropin.enable(layer, dequantize=counted(calls), fused=False)
        fused = dropin.bitsandbytes_fuses(x, torch.bfloat16, layer.weight.quant_state)
        got = layer(x)
    assert_bit_exact(got, expected)
    assert calls == ([] if fused else [1])
    if rows >= 2000:
        assert not fused


@pytest.mark.gpu
def test_gpu_a_bias_of_another_shape_is_named():
    """A bias the fused kernel cannot read (its shape not the layer's outputs) is named, not read past
    (bitsandbytes' own one-row forward takes it without an error)."""
    layer = bitsandbytes_layer((1024, 512), torch.bfloat16, True)
    layer.bias = torch.nn.Parameter(torch.zeros(7, dtype=torch.bfloat16, device="cuda"))
    x = torch.randn(1, 512, dtype=torch.bfloat16, device="cuda")
    dropin.enable(layer)
    with torch.no_grad():
        assert dropin.fused_route(x, layer.weight.quant_state) is not None  # one row: the fused route
        with pytest.raises(ValueError, match=r"Linear4bit: bias must be a tensor of shape \(1024,\), got torch.Size\(\[7\]\)"):
            layer(x)


@pytest.mark.gpu
def test_first_call_compiled():
    """A process's first routed call made inside torch.compile: the device's facts are not cached yet, so
    Dynamo traces their lookup (the properties, the DRAM peak) in the forward; one graph, the eager call's bits,
    a call the fused route takes."""
    in_a_fresh_process("""
import torch
from torch._dynamo.utils import counters
from nf4_triton import dropin
from helpers import assert_bit_exact, linear4bit
layer, packed, state = linear4bit((1024, 512), dtype=torch.bfloat16, device="cuda")
x = torch.randn(1, 512, dtype=torch.bfloat16, device="cuda")
dropin.enable(layer)
with torch.no_grad():
    compiled = torch.compile(layer, fullgraph=True)(x)
    assert not counters["graph_break"], counters["graph_break"]
    assert dropin.fused_route(x, state) is not None
    assert_bit_exact(compiled, layer(x))
""")


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [3, 8, 16, 200])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_inference_takes_the_route(rows, dtype):
    """Inference on this GPU, by default: the fused matmul where its route picks it (the same
    bits as nf4_linear's, within the contract's bound), eager and in one compiled graph; bitsandbytes'
    bits elsewhere."""
    from torch._dynamo.utils import counters

    layer = bitsandbytes_layer((1024, 512), dtype, False)
    x = torch.randn(rows, 512, dtype=dtype, device="cuda")
    with torch.inference_mode():
        expected = layer(x)
        dropin.enable(layer)
        got = layer(x)
    routed = dropin.fused_route(x, layer.weight.quant_state)
    if routed is None:
        assert_bit_exact(got, expected)
        return
    assert_fused_result(got, x, layer, routed[0])
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        compiled = torch.compile(layer, fullgraph=True)(x)
    assert not counters["graph_break"]
    assert_bit_exact(compiled, got)


@pytest.mark.parametrize("nested", [True, False], ids=["nested", "flat"])
def test_fused_op_gets_bitsandbytes_arguments(nested, device, monkeypatch):
    """The drop-in's call of bitsandbytes' fused op gives what bitsandbytes' matmul_4bit gives
    (that op also runs on the CPU, so the argument mapping is checked everywhere)."""
    import bitsandbytes as bnb

    op = torch.ops.bitsandbytes.gemm_4bit.default
    monkeypatch.setattr(dropin, "bitsandbytes_rule", lambda: (1536, lambda *args: True, op))
    layer, _, state = linear4bit((96, 64), device=device, seed=8)
    if not nested:
        packed, state = quantize((96, 64), dtype=torch.bfloat16, nested=False, device=device, seed=8)
        layer.weight = bnb.nn.Params4bit(packed, requires_grad=False, quant_state=state, bnb_quantized=True,
                                         module=layer)
    x = torch.randn(3, 64, dtype=torch.bfloat16, device=device)
    bias = torch.randn(96, dtype=torch.bfloat16, device=device)
    with torch.no_grad():
        got = dropin.bitsandbytes_fused_matmul(x, layer.weight.data, state, bias)
        expected = bnb.matmul_4bit(x, layer.weight, quant_state=state, bias=bias)
    assert_bit_exact(got, expected)


# ---- projections merged into one launch (enable(model, merge=True)) --------------------------
class Projections(torch.nn.Module):
    """q, k and v and gate and up read one input, o reads another: named as in Llama."""

    def __init__(self, device, dtype, seed=40):
        super().__init__()
        for offset, (name, out_features) in enumerate((("q_proj", 256), ("k_proj", 128), ("v_proj", 128),
                                                       ("o_proj", 512), ("gate_proj", 384), ("up_proj", 384))):
            setattr(self, name, linear4bit((out_features, 512), dtype=dtype, device=device, seed=seed + offset)[0])

    def forward(self, x):  # no arithmetic between them: compiled, each output is what the layer gives
        mixed = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], -1)
        return torch.cat([mixed, self.o_proj(mixed), self.gate_proj(x), self.up_proj(x)], -1)


def test_merge_groups_the_projections(device):
    """q, k and v share one group and gate and up another, in order; o stands alone; enabling again
    without merge, or disabling, drops the groups. Wherever no launch merges (the CPU), outputs are
    the unmerged drop-in's."""
    model = Projections(device, torch.bfloat16)
    x = torch.randn(3, 512, dtype=torch.bfloat16, device=device)
    assert dropin.enable(model) == 6
    with torch.no_grad():
        unmerged = model(x)
    assert dropin.enable(model, merge=True) == 6
    attention = [dropin.siblings_of(getattr(model, name)) for name in ("q_proj", "k_proj", "v_proj")]
    mlp = [dropin.siblings_of(getattr(model, name)) for name in ("gate_proj", "up_proj")]
    assert [index for _, index in attention] == [0, 1, 2] and [index for _, index in mlp] == [0, 1]
    assert len({id(group) for group, _ in attention}) == 1 and len({id(group) for group, _ in mlp}) == 1
    assert attention[0][0].layers == [model.q_proj, model.k_proj, model.v_proj]
    assert dropin.siblings_of(model.o_proj) is None
    if device == "cpu":
        with torch.no_grad():
            assert_bit_exact(model(x), unmerged)
    dropin.enable(model)
    assert all(dropin.siblings_of(layer) is None for layer in model.children())
    assert dropin.disable(model) == 6


def test_merge_finds_peft_base_layers(device):
    """Under PEFT LoRA the base layers of q, k and v are the group's members."""
    peft = pytest.importorskip("peft")
    model = Projections(device, torch.bfloat16)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj"])
    model = peft.get_peft_model(model, config)
    dropin.enable(model, merge=True)
    base = model.base_model.model
    group, index = dropin.siblings_of(base.q_proj.base_layer)
    assert index == 0 and group.layers == [base.q_proj.base_layer, base.k_proj.base_layer, base.v_proj.base_layer]


def test_siblings_hand_out_only_what_their_input_computed():
    """A held output goes to its own member, once, and only for the very input it was computed from;
    a call with another input drops what is held."""
    group = dropin.Siblings([None, None, None])
    x, other = torch.ones(2), torch.ones(2)
    outputs = [torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)]
    group.hold(x, outputs)
    assert group.take(0, x) is None  # the first member's own call returned it already
    assert group.take(1, x) is outputs[1] and group.take(1, x) is None
    assert group.take(2, x) is outputs[2]
    assert group.held is None  # nothing held once all are taken
    group.hold(x, outputs)
    assert group.take(1, other) is None and group.held is None  # equal values, another tensor: dropped
    assert group.take(2, x) is None


def test_siblings_hand_out_nothing_after_a_change_in_place():
    """An input changed in place after the first member's call (its version bumped) is another input: the
    later members compute their own, and nothing stale is kept."""
    group = dropin.Siblings([None, None, None])
    x = torch.ones(2)
    outputs = [torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)]
    group.hold(x, outputs)
    assert group.take(1, x) is outputs[1]
    x.add_(1)
    assert group.take(2, x) is None and group.held is None
    group.hold(x, outputs)
    x.mul_(1)  # same values, still a change in place
    assert group.take(1, x) is None


def test_siblings_hand_out_nothing_after_the_data_is_swapped():
    """``x.data = other`` and ``x.set_(...)`` leave x's version as it is: the data pointer, offset, shape and
    strides still show the change, and the later members compute their own."""
    outputs = [torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)]
    for change in (lambda x: setattr(x, "data", torch.full((2,), 5.0)),
                   lambda x: x.set_(torch.full((3,), 5.0)),
                   lambda x: setattr(x, "data", x.data.new_empty((4,)).as_strided((2,), (2,)))):
        group = dropin.Siblings([None, None, None])
        x = torch.ones(2)
        group.hold(x, outputs)
        assert group.take(1, x) is outputs[1]
        change(x)
        assert group.take(2, x) is None and group.held is None


def test_siblings_hand_out_inference_tensors():
    """An inference tensor keeps no version counter: the handoff still works by identity alone."""
    group = dropin.Siblings([None, None])
    with torch.inference_mode():
        x = torch.ones(2)
        outputs = [torch.zeros(1), torch.ones(1)]
        group.hold(x, outputs)
        assert group.take(1, x) is outputs[1] and group.held is None


def test_siblings_stop_launching_for_untaken_outputs():
    """Cross-attention (k and v read another input than q): each launch's outputs are dropped untaken,
    and after ``MOST_MISSES`` such launches in a row the group launches no more; a launch fully taken
    resets the count."""
    group = dropin.Siblings([None, None, None])
    outputs = [torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)]
    x, encoded = torch.ones(2), torch.ones(2)
    group.hold(x, outputs)
    assert group.take(1, x) is outputs[1] and group.take(2, x) is outputs[2] and group.misses == 0
    for misses in range(1, group.MOST_MISSES + 1):
        assert group.launches()
        group.hold(x, outputs)
        assert group.take(1, encoded) is None and group.held is None and group.misses == misses
    assert not group.launches()


def test_siblings_copy_and_pickle_without_activations():
    """A deep copy or a pickle of a group holds nothing, even an input that requires grad (deepcopy
    refuses a non-leaf one)."""
    group = dropin.Siblings([None, None])
    x = torch.ones(2, requires_grad=True) * 2
    group.hold(x, [torch.zeros(1), torch.ones(1)])
    assert copy.deepcopy(group).held is None
    buffer = io.BytesIO()
    torch.save(group, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=False).held is None and group.held is not None


def test_group_stops_when_a_member_leaves():
    """A member routed again alone, or given back, ends its group: the others compute their own."""
    model = Projections("cpu", torch.bfloat16)
    dropin.enable(model, merge=True)
    attention, _ = dropin.siblings_of(model.q_proj)
    mlp, _ = dropin.siblings_of(model.gate_proj)
    assert attention.launches() and mlp.launches()
    dropin.enable(model.k_proj)
    assert not attention.launches() and mlp.launches() and dropin.siblings_of(model.k_proj) is None
    dropin.disable(model.up_proj)
    assert not mlp.launches()
    dropin.enable(model, merge=True)
    assert dropin.siblings_of(model.q_proj)[0].launches() and dropin.siblings_of(model.gate_proj)[0].launches()


def test_merged_scalar_input_fails_as_the_layer_does():
    """A 0-dim input gets the layer's own error, not one from the group launch's shape arithmetic."""
    model = Projections("cpu", torch.bfloat16)
    dropin.enable(model)
    with pytest.raises(Exception) as unmerged:
        model.q_proj(torch.tensor(1.0, dtype=torch.bfloat16))
    dropin.enable(model, merge=True)
    with pytest.raises(type(unmerged.value)) as merged:
        model.q_proj(torch.tensor(1.0, dtype=torch.bfloat16))
    assert str(merged.value) == str(unmerged.value)


class CrossOrSelf(torch.nn.Module):
    """One attention module for self- and cross-attention, a graph break between q and k when compiled."""

    def __init__(self, device):
        super().__init__()
        self.projections = Projections(device, torch.bfloat16)

    def forward(self, x, kv):
        q = self.projections.q_proj(x)
        torch._dynamo.graph_break()
        return q, self.projections.k_proj(kv), self.projections.v_proj(kv)


def launch_each(monkeypatch, launches):
    """The group launch stood in for by each member's F.linear (the CPU has no group launch), counted."""
    def linear_group(x2d, states, plan):
        launches.append(1)
        return [F.linear(x2d, expected_values(packed, state).to(x2d.dtype)) for packed, state in states]

    monkeypatch.setattr(matmul, "group_plan", lambda x2d, states: "one launch")
    monkeypatch.setattr(matmul, "linear_group", linear_group)


def test_merged_forward_compiles_whole(monkeypatch, device):
    """The merged forward, handoff and all, in one compiled graph: no break, two group launches traced,
    each output the eager merged forward's (the same stand-in launches; o through the drop-in)."""
    from torch._dynamo.utils import counters

    launches = []
    launch_each(monkeypatch, launches)
    model = Projections(device, torch.bfloat16)
    dropin.enable(model, merge=True)
    x = torch.randn(3, 512, dtype=torch.bfloat16, device=device)
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        compiled = torch.compile(model, backend="eager", fullgraph=True)(x)
        assert not counters["graph_break"] and len(launches) == 2
        assert_bit_exact(compiled, model(x))
        assert len(launches) == 4
        members = {"q_proj": 0, "k_proj": 256, "v_proj": 384, "gate_proj": 1024, "up_proj": 1408}
        for name, start in members.items():
            layer = getattr(model, name)
            assert_bit_exact(compiled[:, start:start + layer.out_features].contiguous(),
                             F.linear(x, expected_weight(layer).to(x.dtype)))


def test_merged_handoff_across_a_graph_break(monkeypatch, device):
    """Compiled with a graph break between the first member and the others, inputs alternating between
    q's own (self-attention) and another (cross-attention): each member's output is its own input's, as
    the eager forward gives it (and on the CPU, where the stand-in launch and a member's own call compute
    alike, the layer's own product)."""
    launch_each(monkeypatch, [])
    model = CrossOrSelf(device)
    dropin.enable(model, merge=True)
    layers = [model.projections.k_proj, model.projections.v_proj]
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager")
    with torch.no_grad():
        for step in range(9):
            x = torch.randn(2, 512, dtype=torch.bfloat16, device=device)
            kv = torch.randn(2, 512, dtype=torch.bfloat16, device=device) if step % 3 == 0 else x
            _, k, v = compiled(x, kv)
            _, eager_k, eager_v = model(x, kv)
            for got, eager, layer in zip((k, v), (eager_k, eager_v), layers):
                assert_bit_exact(got, eager)
                if device == "cpu":
                    assert_bit_exact(got, F.linear(kv, expected_weight(layer).to(kv.dtype)))


def member_alone(layer, x, config):
    """A member's output through the fused kernel alone with the group's tile."""
    return matmul.linear_by_route(x, layer.weight.data, layer.weight.quant_state, None,
                                  routes.Route(x.numel() // x.shape[-1], "fused", config))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_no_group_past_its_rows(dtype, monkeypatch):
    """From ``GROUP_MAX_ROWS + 1`` rows on (a prefill) a merged model launches no group: each layer its own."""
    model = Projections("cuda", dtype)
    dropin.enable(model, merge=True)
    launches = []
    group_launch = matmul.linear_group
    monkeypatch.setattr(matmul, "linear_group", lambda *args: launches.append(1) or group_launch(*args))
    x = torch.randn(matmul.GROUP_MAX_ROWS + 1, 512, dtype=dtype, device="cuda")
    with torch.no_grad():
        merged = model(x)
        dropin.enable(model)
        assert_bit_exact(merged, model(x))
    assert not launches


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 3, 16, 33, 64])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_merged_projections_equal_each_alone(rows, dtype, monkeypatch):
    """With merge, q, k and v (and gate and up) come from one launch each, eager and in one compiled
    graph, each bit for bit what it gives alone through the same tile; an input other than the one
    the first member computed from, or that one changed in place since, computes its own."""
    from torch._dynamo.utils import counters

    model = Projections("cuda", dtype)
    dropin.enable(model, merge=True)
    launches = []
    group_launch = matmul.linear_group
    monkeypatch.setattr(matmul, "linear_group", lambda *args: launches.append(1) or group_launch(*args))
    x = torch.randn(rows, 512, dtype=dtype, device="cuda")
    x2d = x.reshape(-1, 512)
    with torch.no_grad():
        got = {name: getattr(model, name)(x) for name in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")}
        assert len(launches) == 2
        for names in dropin.SIBLINGS:
            layers = [getattr(model, name) for name in names]
            plan = matmul.group_plan(x2d, [(layer.weight.data, layer.weight.quant_state) for layer in layers])
            assert plan is not None
            config = plan.config
            for name, layer in zip(names, layers):
                assert_bit_exact(got[name], member_alone(layer, x, config))
        other = torch.randn_like(x)
        model.q_proj(x)
        assert_bit_exact(model.k_proj(other), model.k_proj.forward.func(model.k_proj, kernel.dequantize_nf4, True,
                                                                      None, other))
        changed = x.clone()
        model.q_proj(changed)
        changed.mul_(2)  # in place between the members' calls: k computes from the input as it is now
        assert_bit_exact(model.k_proj(changed), model.k_proj.forward.func(model.k_proj, kernel.dequantize_nf4, True,
                                                                        None, changed))
        dropin.enable(model, merge=True)  # the two misses above stopped the group's launches
        eager = model(x)
        assert len(launches) == 6
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(model, fullgraph=True)(x)
    assert not counters["graph_break"] and len(launches) == 8  # the graph merges them too
    assert_bit_exact(compiled, eager)


def test_siblings_hand_out_in_one_compiled_graph():
    """The handoff traces whole (a compiled server's decoder layer): no graph break, each member's output
    its own, nothing held after the last take (so no guard on a stale tensor)."""
    from torch._dynamo.utils import counters

    group = dropin.Siblings([None, None, None])

    def layer(x):
        outputs = [x + 1, x * 2, x - 3]
        group.hold(x, outputs)
        return outputs[0], group.take(1, x), group.take(2, x)

    torch._dynamo.reset()
    counters.clear()
    x = torch.randn(4)
    got = torch.compile(layer, fullgraph=True)(x)
    assert not counters["graph_break"] and group.held is None
    for value, expected in zip(got, layer(x)):
        assert torch.equal(value, expected)
