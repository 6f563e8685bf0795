"""Route a model's bitsandbytes 4-bit layers through the fused dequantization kernel.

    from nf4_triton import dropin
    dropin.enable(model)   # every bitsandbytes.nn.Linear4bit, also the base layers of PEFT LoRA
    dropin.disable(model)  # bitsandbytes' own forward again

Per module: the layer's ``forward`` is replaced on the instance, never on bitsandbytes' class (or,
behind an Accelerate hook, the ``_old_forward`` the hook calls), and the weight and quant state are
never written. Only a layer whose forward is bitsandbytes' own is routed: a subclass that overrides
it keeps its forward. The routed forward pickles and deep-copies with its module.

With a gradient, forward computes ``x @ W.t() (+ bias)`` with W dequantized by the kernel, or, where
bitsandbytes' own rule takes its fused 4-bit matmul for those rows, calls that op as bitsandbytes'
forward does; backward dequantizes W again rather than keeping it alive between the two (as
bitsandbytes does) and sums the bias' gradient as bitsandbytes' backward does. With the same W these
are bitsandbytes' own arithmetic, so outputs and input and bias gradients are its bits at every row
count.

Inference (no gradient) on a GPU takes ``matmul.choose_route``'s path for its row count: the fused
NF4 matmul where it is the fastest (on the H100 from 1 to 256 rows, to 128 or 256 rows by the
layer's size; NOTES.md items 77, 82, 83). It decodes W to the same values; only
the order of the fp32 sums differs from bitsandbytes', so logits there agree to the last bits, not
bit for bit (NOTES.md item 73).
``enable(model, merge=True)`` also computes the projections a module reads from one input (``SIBLINGS``:
q, k and v; gate and up) in one launch where ``matmul.group_plan`` allows: the first one's call
computes all, and each other takes its own when it is called with that same x (any other x computes
its own). NOTES.md items 88 and 89.
``enable(model, fused=False)`` keeps bitsandbytes' arithmetic everywhere. Where bitsandbytes
computes an inference input with its own fused 4-bit matmul (its GEMV at one row, its small-batch
kernel, chosen by its own per-GPU rule) and the route is not the fused kernel, that op is kept,
called with the arguments bitsandbytes' forward passes it (the same bits), without that forward's
Python.
"""

import functools
import types

import torch
import torch.nn.functional as F

from nf4_triton import fastpath, kernel, matmul, quantstate

__all__ = ["enable", "disable", "is_enabled", "siblings_of", "Siblings", "SIBLINGS", "fused_route", "bitsandbytes_forward",
           "bitsandbytes_rule", "bitsandbytes_fuses", "bitsandbytes_fused_matmul"]

# Where a routed forward sits on a module: `forward`, or `_old_forward`, the forward that Accelerate's
# hooks (device_map, offloading) save and call, so that a hook stays outside.
_SLOTS = ("forward", "_old_forward")


def _linear4bit_type():
    import bitsandbytes as bnb

    return bnb.nn.Linear4bit


# The projections a module computes from one input, by their attribute names (Llama, Mistral, Qwen,
# Gemma and their PEFT wrappers): ``enable(model, merge=True)`` launches each set once.
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def enable(model, dequantize=None, fused=True, merge=False):
    """Route every ``bitsandbytes.nn.Linear4bit`` in ``model`` (itself included) whose forward is
    bitsandbytes' own through the kernel; return how many layers are routed now. Calling it again
    routes them as that call says. ``dequantize(packed, quant_state)``: another dequantization to
    route through (benchmarks). ``fused``: inference rows through the fused matmul where its route
    picks it; False keeps bitsandbytes' bits everywhere. ``merge`` (with ``fused``): ``SIBLINGS`` in
    one launch each."""
    linear4bit = _linear4bit_type()
    dequantize = dequantize or kernel.dequantize_nf4
    routed = []
    for module in model.modules():
        # A routed layer is routed again: through the dequantize this call names, as its caller expects.
        slot = _routed_slot(module) or (_own_forward_slot(module) if isinstance(module, linear4bit) else None)
        if slot is None:
            continue
        _leave_group(module)
        # A partial of a module-level function, not a bound method of a name the class lacks: it
        # pickles (torch.save of the model) and deep-copies with its module.
        setattr(module, slot, functools.partial(_routed_forward, module, dequantize, fused, None))
        routed.append(module)
    if merge and fused:
        for module in model.modules():
            for names in SIBLINGS:
                layers = [_base_layer(getattr(module, name, None)) for name in names]
                if all(layer is not None and is_enabled(layer) for layer in layers):
                    siblings = Siblings(layers)
                    for index, layer in enumerate(layers):
                        setattr(layer, _routed_slot(layer),
                                functools.partial(_routed_forward, layer, dequantize, fused, (siblings, index)))
    return len(routed)


def _leave_group(module):
    """A routed layer about to be routed again or given back leaves its group: the group launches no more."""
    siblings = siblings_of(module)
    if siblings is not None:
        siblings[0].valid = False
        siblings[0].held = None


def siblings_of(module):
    """(``Siblings``, the layer's index) where ``enable(model, merge=True)`` merged this routed layer, else None."""
    slot = _routed_slot(module)
    return module.__dict__[slot].args[3] if slot else None


def _base_layer(child):
    """The Linear4bit a child computes through: itself, or a PEFT LoRA layer's base layer; else None."""
    if child is not None and not isinstance(child, _linear4bit_type()):
        child = getattr(child, "base_layer", None)
    return child if isinstance(child, _linear4bit_type()) else None


class Siblings:
    """Projections of one module merged: their layers, and the outputs the first one's call computed for
    the others, until each takes its own."""

    MOST_MISSES = 2  # launches in a row whose outputs went untaken (cross-attention): then no more launches

    def __init__(self, layers):
        self.layers = layers
        # (the input, its fingerprint, the outputs computed from it, None where taken): one attribute, read
        # once, so that a call on another thread never pairs one call's input with another's outputs
        self.held = None
        self.misses = 0  # launches in a row whose outputs were dropped before every member took its own
        self.valid = True  # every member still routed with this group (``enable`` and ``disable`` clear it)

    def launches(self):
        """Whether the first member's call may launch the group."""
        return self.valid and self.misses < self.MOST_MISSES

    def take(self, index, x):
        """Member ``index``'s output computed from this very ``x`` as it is now (``_fingerprint``), or None.
        Another input, or this one changed since, drops what is held: no later call can take it."""
        held = self.held
        if held is None:
            return None
        if held[0] is not x or held[1] != _fingerprint(x):
            self.held = None
            self.misses += 1
            return None
        if held[2][index] is None:
            return None
        outputs = held[2][:index] + (None,) + held[2][index + 1:]
        if all(output is None for output in outputs):
            self.held = None
            self.misses = 0
        else:
            self.held = (x, held[1], outputs)
        return held[2][index]

    def hold(self, x, outputs):
        if self.held is not None:  # the last launch's outputs, some never taken
            self.misses += 1
        self.held = (x, _fingerprint(x), (None,) + tuple(outputs[1:]))

    def __getstate__(self):  # a copy or a pickle holds no activations
        return dict(self.__dict__, held=None)


def _fingerprint(x):
    """What shows that x is still the input a group computed from: its version counter, which every change in
    place bumps, and its data pointer, storage offset, shape and strides, which ``x.data = other`` and
    ``x.set_(...)`` move without it. None inside a compiled graph, where the version is a value of the graph
    and a fake tensor has no address (identity alone serves there); an inference tensor keeps no version
    (None in its place). A write through another tensor over the same memory (``x.data.mul_``, a ``set_``
    or ``numpy()`` alias) changes none of these: README, "Merged projections"."""
    if torch.compiler.is_compiling():
        return None
    try:
        return (None if x.is_inference() else x._version, x.data_ptr(), x.storage_offset(), x.shape, x.stride())
    except RuntimeError:  # no storage to point at (a wrapper subclass): a fingerprint no later call matches
        return object()


def _own_forward_slot(module):
    """The slot holding a Linear4bit's forward where that forward is bitsandbytes' own, else None: a
    subclass's or a user's forward computes something else, and a drop-in must not drop it."""
    if type(module).forward is not _linear4bit_type().forward:
        return None
    slot = "_old_forward" if "_old_forward" in module.__dict__ else "forward"
    current = module.__dict__.get(slot)
    if current is None or (getattr(current, "__func__", None) is type(module).forward
                           and getattr(current, "__self__", None) is module):
        return slot
    return None


def _routed_slot(module):
    """The slot holding this module's routed forward, or None."""
    for slot in _SLOTS:
        current = module.__dict__.get(slot)
        if isinstance(current, functools.partial) and current.func is _routed_forward:
            return slot
    return None


def disable(model):
    """Give every routed layer in ``model`` bitsandbytes' forward back, leaving any Accelerate hook
    added or removed since ``enable`` as it is now; return how many."""
    restored = 0
    for module in model.modules():
        slot = _routed_slot(module)
        _leave_group(module)
        if slot == "forward":
            del module.__dict__["forward"]
        elif slot == "_old_forward":  # behind a hook, which calls it
            module._old_forward = types.MethodType(type(module).forward, module)
        else:
            continue
        restored += 1
    return restored


def is_enabled(module):
    """Whether ``module`` is routed (its forward, or the one its Accelerate hook calls)."""
    return _routed_slot(module) is not None


def bitsandbytes_forward(module, x, *args, **kwargs):
    """bitsandbytes' own forward (the class's: only a Linear4bit whose forward is it is routed)."""
    return type(module).forward(module, x, *args, **kwargs)


@functools.cache
def bitsandbytes_rule():
    """bitsandbytes' choice between its fused 4-bit matmul and dequantize + matmul: (largest row
    count it fuses, f(device index, dtype, rows, out features, in features), the fused op), or None
    where this bitsandbytes has no such rule (its GEMV then serves one row)."""
    try:
        from bitsandbytes.backends.cuda import ops

        return ops._gemm_4bit_custom_max_m, ops._gemm_4bit_use_custom_fn, torch.ops.bitsandbytes.gemm_4bit.default
    except (ImportError, AttributeError):
        return None


def bitsandbytes_fuses(x, dtype, quant_state):
    """Whether bitsandbytes computes ``x`` (no gradient, computed in ``dtype``) with its fused
    4-bit matmul rather than by dequantizing: its own rule, calibrated per GPU against its
    dequantize + matmul."""
    if not x.is_cuda or x.dim() == 0:
        return False
    k = x.shape[-1]
    m = x.numel() // k if k else 0
    rule = bitsandbytes_rule()
    if rule is None:
        return m == 1
    max_rows, fused, _ = rule
    if m > max_rows or k % quant_state.blocksize:
        return False
    return fused(x.device.index, dtype, m, quant_state.shape[0], k)


def _bitsandbytes_op_with_grad(x, quant_state):
    """Whether the forward with a gradient calls bitsandbytes' fused 4-bit op, as its ``MatMul4Bit`` does
    where the op's rule takes the fused kernel: eagerly where ``bitsandbytes_fuses`` (elsewhere the drop-in's
    dequantize gives the op's bits); in a compiled graph, whose rows the op sees only when it runs, wherever
    the rule may fuse (its most rows, a whole number of blocks along K), the op choosing for itself."""
    if not torch.compiler.is_compiling():
        return bitsandbytes_fuses(x, x.dtype, quant_state)
    if not x.is_cuda or x.dim() == 0 or x.shape[-1] % quant_state.blocksize:
        return False
    rule = bitsandbytes_rule()
    return rule is not None and x.numel() // x.shape[-1] <= rule[0]


def _quant_state(module):
    """A Linear4bit's quant state: its weight's, or where FSDP's flat parameters replaced the
    Params4bit with a plain view of its bytes, the module's (bitsandbytes keeps it there too; its own
    forward wraps the view again, we only read it)."""
    quant_state = getattr(module.weight, "quant_state", None)
    return quant_state if quant_state is not None else getattr(module, "quant_state", None)


def _routed_forward(module, dequantize, fused_matmul, siblings, x, *args, **kwargs):
    """Linear4bit.forward with the weight dequantized by ``dequantize``, or inference rows through
    the fused matmul (see the module docstring); ``siblings``: (``Siblings``, this layer's index)
    where merged. The checks that hand a call back to bitsandbytes come first: they cost every
    one-token call."""
    weight = module.weight
    quant_state = _quant_state(module)
    # bitsandbytes' CPU layout: its forward repacks a CPU weight in place for its AVX512-BF16 kernel
    # on its first inference call, a format only that forward reads, so it computes such a layer; and
    # CPU tensors where Triton's interpreter is off (a GPU host), which no kernel here can run.
    if quant_state is None or args or kwargs or (x.is_cpu and (
            not fastpath.INTERPRET or getattr(quant_state, "packing_format_for_cpu", False))):
        return bitsandbytes_forward(module, x, *args, **kwargs)
    if not module.compute_type_is_set:  # what bitsandbytes' forward does on its first call
        module.set_compute_type(x)
        module.compute_type_is_set = True
    dtype = module.compute_dtype or x.dtype
    bias = module.bias
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad))
    if siblings is not None and not needs_grad:
        group, index = siblings
        y = group.take(index, x)
        if y is None and index == 0 and group.launches():
            outputs = _merged_outputs(group, x, dtype)
            if outputs is not None:
                group.hold(x, outputs)
                y = outputs[0]
        if y is not None:
            return y
    routed = fused_route(x, quant_state) if fused_matmul and not needs_grad and quant_state.dtype is dtype else None
    fused = (routed is None and not needs_grad and not torch.compiler.is_compiling()
             and bitsandbytes_fuses(x, dtype, quant_state))
    if quant_state.dtype is not dtype and not fused:  # bitsandbytes dequantizes straight to x's dtype: one rounding
        return bitsandbytes_forward(module, x)
    compute_x = x if x.dtype is dtype else x.to(dtype)
    if bias is not None and bias.dtype is not dtype:
        bias = bias.to(dtype)
    packed, quant_state = quantstate.resolve(weight, quant_state)
    if routed is not None:
        out_features, in_features = (int(dim) for dim in quant_state.shape)
        if bias is not None:  # bitsandbytes' one-row kernel reads a bias of 7 for 1024 outputs without a word
            matmul.check_call(compute_x, bias, out_features, in_features, type(module).__name__)
        # x's features and device and the state's dtype checked above (fused_route), a bias here
        route, capability = routed
        y = matmul.linear_unchecked(compute_x, packed, quant_state, bias, route, out_features, in_features, capability)
    elif fused:
        y = bitsandbytes_fused_matmul(compute_x, packed, quant_state, bias)
        if y is None:
            return bitsandbytes_forward(module, x)
    elif needs_grad:
        y = _DequantizedLinear.apply(compute_x, packed, quant_state, bias, dequantize)
    else:  # no graph to record: the autograd Function's bookkeeping would be host time alone
        y = F.linear(compute_x, _weight(dequantize, packed, quant_state), bias)
    return y if y.dtype is x.dtype else y.to(x.dtype)


def _merged_outputs(group, x, dtype):
    """Every member's output from ``x`` in one launch (``matmul.group_plan``), in x's dtype, or None:
    a member with a bias, another compute dtype or a quant state not in it, or no such launch."""
    if x.dim() == 0 or x.numel() == 0 or x.numel() > matmul.GROUP_MAX_ROWS * x.shape[-1]:
        return None  # the layer's own call says what is wrong; a prefill: no group launch (matmul.group_plan)
    states = []
    for layer in group.layers:
        quant_state = _quant_state(layer)
        if (quant_state is None or layer.bias is not None or (layer.compute_dtype or x.dtype) is not dtype
                or quant_state.dtype is not dtype):
            return None
        states.append(quantstate.resolve(layer.weight, quant_state))
    x2d = (x if x.dtype is dtype else x.to(dtype)).reshape(-1, x.shape[-1])
    plan = matmul.group_plan(x2d, states)
    if plan is None:
        return None
    outputs = matmul.linear_group(x2d, states, plan)
    return [y.reshape(*x.shape[:-1], y.shape[1]).to(x.dtype) for y in outputs]


def fused_route(x, quant_state):
    """(the fused matmul's Route, the GPU's compute capability) for ``x`` against the layer's weight where
    ``routes.choose_route`` picks the fused kernel on x's GPU, else None (CPU tensors: the interpreter is for tests)."""
    if not x.is_cuda or x.dim() == 0 or len(quant_state.shape) != 2:
        return None
    out_features, in_features = (int(dim) for dim in quant_state.shape)
    if x.shape[-1] != in_features or in_features == 0:
        return None
    route, capability = matmul.device_route(x.device, x.numel() // in_features, in_features, out_features)
    return (route, capability) if route.path == "fused" else None


def _weight(dequantize, packed, quant_state):
    """The layer's W, (out, in): a dequantization returns a packed weight of one row transposed
    (bitsandbytes' rule), and a tiny layer's packed weight can have one row."""
    weight = dequantize(packed, quant_state)
    return weight.t() if packed.shape[0] == 1 else weight


def bitsandbytes_fused_matmul(x, packed, quant_state, bias):
    """bitsandbytes' fused 4-bit matmul op with the arguments its ``matmul_4bit`` passes for an
    input without gradient (so the same bits), skipping its Linear4bit forward's Python; None
    where that forward must run (no such op, an empty input, a layout it refuses)."""
    rule = bitsandbytes_rule()
    if rule is None or x.numel() == 0 or len(quant_state.shape) != 2 or x.shape[-1] != quant_state.shape[1]:
        return None
    op, packed = rule[2], packed.view(-1, 1)
    if not quant_state.nested:
        return op(x, packed, quant_state.shape, quant_state.absmax, quant_state.blocksize, quant_state.quant_type,
                  bias=bias)
    if quant_state.state2.blocksize != 256:
        return None
    return op(x, packed, quant_state.shape, quant_state.state2.absmax, quant_state.blocksize, quant_state.quant_type,
              bias=bias, absmax_8bit=quant_state.absmax, absmax_code=quant_state.state2.code,
              absmax_offset=quant_state.offset)


class _DequantizedLinear(torch.autograd.Function):
    """bitsandbytes' ``MatMul4Bit`` with W dequantized by the drop-in's ``dequantize``: forward through
    bitsandbytes' fused op where its rule takes it for these rows, else ``F.linear(x, W, bias)``; backward
    ``grad @ W`` (W dequantized again) and the bias' gradient summed over dim 0 in its dtype, the rest of the
    leading dimensions left to autograd, as bitsandbytes' backward does."""

    @staticmethod
    def forward(ctx, x, packed, quant_state, bias, dequantize):
        # Held as attributes, not saved tensors: saved-tensor hooks (activation offloading) would
        # copy the packed weight every step.
        ctx.packed, ctx.quant_state, ctx.dequantize = packed, quant_state, dequantize
        ctx.bias_dtype = None if bias is None else bias.dtype
        if _bitsandbytes_op_with_grad(x, quant_state):
            y = bitsandbytes_fused_matmul(x, packed, quant_state, bias)
            if y is not None:
                return y
        return F.linear(x, _weight(dequantize, packed, quant_state), bias)

    @staticmethod
    def backward(ctx, grad_output):
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            weight = _weight(ctx.dequantize, ctx.packed, ctx.quant_state)
            grad_x = torch.matmul(grad_output, weight.to(grad_output.dtype))
        if ctx.needs_input_grad[3]:
            # bitsandbytes sums dim 0 alone (in the bias' dtype); autograd reduces what is left to the bias'
            # shape, so a 3-D or 4-D input's sum is bitsandbytes' to the bit. A 1-D input's gradient is the bias'.
            grad_bias = grad_output.sum(0, dtype=ctx.bias_dtype) if grad_output.dim() > 1 else grad_output
        return grad_x, None, None, grad_bias, None
