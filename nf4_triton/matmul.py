"""The fused NF4 matmul's entry points: ``y = x @ dequantize_nf4(W).T (+ bias)`` straight from bitsandbytes' bytes.

A call is validated, its device's facts read and its route chosen once (``routes.choose_route``: the fused kernel
of a configuration's family, dequantize + cuBLAS, or bitsandbytes' own kernel), then launched (``fused.py``). The
fused kernels decode each weight with the dequantization's own exact arithmetic (``kernel.py``: fp32 ``code * scale``
without FMA, one cast to the activations' dtype) and multiply it with x's tile: no 16-bit weight is ever written,
and the only difference from dequantize + ``F.linear`` is the order of the fp32 sums.

``nf4_linear_group`` computes the projections a layer reads from one input (q, k and v; gate and up) in one launch.
Inside ``torch.compile`` both are ``torch.library`` operators (``nf4_triton::linear``, ``nf4_triton::linear_group``).
"""

import copy
import dataclasses
import typing

import torch
import torch.nn.functional as F

from nf4_triton import kernel, quantstate
from nf4_triton.fastpath import INTERPRET, device_facts
from nf4_triton.fused import gluon_supported, largest_divisor, launch_fused
from nf4_triton.quantstate import require
from nf4_triton.routes import CONFIGS, GLUON_CONFIGS, TL_ROUTES, Route, TlConfig, choose_route

__all__ = ["nf4_linear", "nf4_linear_group", "group_plan", "group_config", "GroupPlan", "GROUP_MAX_ROWS", "linear_group",
           "linear_by_route", "linear_unchecked", "check_call", "route_taken", "decoded_weight", "device_route"]


def device_route(device, rows, in_features, out_features, routes=None):
    """(``choose_route`` for a call on ``device`` from its ``device_facts``, the device's compute capability)."""
    capability, _, dram_gbps = device_facts(device)
    return choose_route(capability, rows, in_features, out_features, routes, dram_gbps), capability


def _fused_supported(blocksize, k, x, capability):
    """Whether the fused kernel reads this layout (whole int32 words within one block per row; a
    packed view off a 4-byte boundary is copied at launch) on a GPU of ``capability``: sm_75 has no bf16
    tensor-core product, and Triton before 3.4 fails to compile its fp16 dot there. Elsewhere
    nf4_linear dequantizes."""
    if blocksize < 8 or k % blocksize:
        return False
    return INTERPRET or tuple(capability) >= (8, 0) or (x.dtype is not torch.bfloat16 and SM75_COMPILES)


SM75_COMPILES = kernel.TRITON_COMPILES_SHARED_TABLES  # both from Triton 3.4 (3.3.1 aborts in its LLVM lowering)


def nf4_linear(x, weight, quant_state=None, bias=None):
    """``x @ W.T (+ bias)`` for a bitsandbytes 4-bit weight W of shape (out, in), computed by the
    route ``choose_route`` gives (the fused kernel, dequantize + cuBLAS, or bitsandbytes' own
    kernel at one row on the small layers of the GPUs it was measured on).

    ``weight``: a ``Linear4bit``, its ``Params4bit``, or the packed tensor with its ``QuantState``
    (NF4 or FP4, nested or flat absmax, any packed storage dtype). ``x``: (..., in) in fp16, bf16
    or fp32; the result is (..., out) in x's dtype. The weight is decoded as ``dequantize_nf4``
    decodes it, rounded once to x's dtype; only the order of the fp32 sums differs from
    ``F.linear(x, W)``. ``bias``: (out,) in x's dtype, or None (a module's own bias is not taken).
    """
    packed, qs, out_features, in_features = _validated(x, weight, quant_state, bias)
    rows = x.numel() // in_features if in_features else 0
    route, capability = device_route(x.device, rows, in_features, out_features)
    return linear_unchecked(x, packed, qs, bias, route, out_features, in_features, capability)  # checked above


def _validated(x, weight, quant_state, bias, caller="nf4_linear"):
    """(packed, quant_state, out_features, in_features) of ``nf4_linear``'s arguments, or a ValueError
    naming what is wrong."""
    packed, qs = quantstate.resolve(weight, quant_state)
    require(isinstance(x, torch.Tensor), f"{caller}: x must be a tensor, got {type(x).__name__}")
    require(isinstance(packed, torch.Tensor),
            f"{caller}: weight must be a tensor, Params4bit or Linear4bit, got {type(weight).__name__}")
    require(qs is not None, f"{caller}: no quant_state given and the weight carries none")
    require(hasattr(qs, "shape") and hasattr(qs, "absmax"),
            f"{caller}: quant_state must be a bitsandbytes 4-bit QuantState, got {type(qs).__name__}")
    require(packed.device.type != "meta", f"{caller}: the weight is a meta tensor: it has no bytes to read")
    shape = qs.shape
    require(isinstance(shape, (tuple, list, torch.Size)) and len(shape) == 2,
            f"{caller}: the quant_state's shape must be (out, in), got {shape!r}")
    out_features, in_features = (int(dim) for dim in shape)
    check_call(x, bias, out_features, in_features, caller)
    require(x.device == packed.device, f"{caller}: x is on {x.device} but the weight is on {packed.device}")
    return packed, qs, out_features, in_features


def check_call(x, bias, out_features, in_features, caller):
    """x's dtype and features, and the bias' shape, dtype and device, against a weight (out, in)."""
    require(x.dtype in quantstate.OUTPUT_DTYPES, f"{caller}: x must be float16, bfloat16 or float32, got {x.dtype}")
    require(x.dim() >= 1 and x.shape[-1] == in_features, f"{caller}: x has {x.shape[-1] if x.dim() else 0} features in "
                                                         f"its last dimension, the weight takes {in_features}")
    if bias is not None:
        require(isinstance(bias, torch.Tensor) and bias.shape == (out_features,),
                f"{caller}: bias must be a tensor of shape ({out_features},), got {getattr(bias, 'shape', bias)!r}")
        require(bias.dtype == x.dtype, f"{caller}: bias must be {x.dtype} like x, got {bias.dtype}")
        require(bias.device == x.device, f"{caller}: bias is on {bias.device} but x is on {x.device}")


def nf4_linear_group(x, weights):
    """``[nf4_linear(x, weight) for weight in weights]`` (no bias), in one launch of the fused kernel
    where ``group_plan`` allows it: the projections a layer reads from one input, such as q, k and v
    or gate and up. Each output equals that weight's alone through the same tile; the tile is the
    route's for the rows of all (NOTES.md item 88)."""
    # a count or a type name, never a repr: that reads the layers back from the GPU (a sync, an error under capture)
    is_list = isinstance(weights, (list, tuple))
    got = len(weights) if is_list else f"a {type(weights).__name__}"
    require(is_list and 1 <= got <= 3, f"nf4_linear_group: weights must be a list of 1 to 3 layers, got {got}")
    states = [_validated(x, weight, None, None, "nf4_linear_group")[:2] for weight in weights]
    lead, in_features = x.shape[:-1], x.shape[-1]
    x2d = x.reshape(-1, in_features)
    plan = group_plan(x2d, states)
    if plan is None:
        return [nf4_linear(x, weight) for weight in weights]
    return [y.reshape(*lead, y.shape[1]) for y in linear_group(x2d, states, plan)]


class GroupPlan(typing.NamedTuple):
    """One launch over several weights: its tile, each weight's ``quantstate.check_state`` layout, the GPU's
    compute capability."""
    config: typing.Any
    layouts: list
    capability: tuple


# The most rows of x a group launch takes: merged, a decoder layer's linears take 11 to 22 us less from 1 to 64 rows,
# and not at 128 (items 88, 90)
GROUP_MAX_ROWS = 64


def group_plan(x2d, states):
    """The GroupPlan of one launch over several weights [(packed, quant_state)] read by ``x2d``, or None
    where x has more than ``GROUP_MAX_ROWS`` rows, that launch is not mma.py's route for their rows
    together, their formats or input features differ, or a weight but the last has rows the tile does
    not divide; split-K folded."""
    if len(states) < 2 or not 0 < x2d.shape[0] <= GROUP_MAX_ROWS or x2d.numel() == 0 or not x2d.is_cuda or INTERPRET:
        return None
    layouts, formats = [], []
    for packed, qs in states:
        if len(qs.shape) != 2 or int(qs.shape[1]) != x2d.shape[1]:
            return None
        layouts.append(quantstate.checked_state(packed, qs))
        formats.append(layouts[-1][1:4] + (qs.quant_type, layouts[-1][4][1].dtype, packed.device))
    rows = [int(qs.shape[0]) for _, qs in states]
    route, capability = device_route(x2d.device, x2d.shape[0], x2d.shape[1], sum(rows))
    config = route.config
    if (route.path != "fused" or not isinstance(config, GLUON_CONFIGS) or len(set(formats)) != 1
            or formats[0][-1] != x2d.device or not _fused_supported(formats[0][0], x2d.shape[1], x2d, capability)
            or not gluon_supported(x2d, x2d.shape[1], formats[0][0], config, capability)
            or any(count % config.block_n for count in rows[:-1])):
        return None
    return GroupPlan(group_config(config, x2d.shape[1]), layouts, capability)


def group_config(config, in_features):
    """A route's ``config`` as one launch over several weights takes it: split-K folded, since no second kernel adds
    the partial sums. Built with the route, not here: a traced forward calls this (``routes._Config.folded``)."""
    return config.folded() if largest_divisor(in_features // config.block_k, config.split_k) > 1 else config


def linear_group(x2d, states, plan):
    """The outputs (rows, out_j) of ``x2d`` against each weight [(packed, quant_state)], one launch as
    ``plan`` (from ``group_plan``) says."""
    x2d = _rows_contiguous(x2d)
    _, blocksize, nested, blocksize2, _ = plan.layouts[0]
    rows = [int(qs.shape[0]) for _, qs in states]
    fp4 = states[0][1].quant_type == "fp4"
    packed = [quantstate.packed_bytes(p) for p, _ in states]
    tables = [layout[4] for layout in plan.layouts]
    if torch.compiler.is_compiling():
        return torch.ops.nf4_triton.linear_group(x2d, packed, *(list(column) for column in zip(*tables)), rows,
                                                 blocksize, blocksize2, nested, fp4, *_config_values(plan.config))
    return _launch_group(x2d, packed, tables, rows, blocksize, blocksize2, nested, fp4, plan.config, plan.capability)


def _rows_contiguous(x2d):
    """x2d itself where its rows are whole and unit-strided (what the kernels read), else a contiguous copy."""
    if x2d.stride(-1) != 1 or (x2d.shape[0] > 1 and x2d.stride(0) < x2d.shape[1]):
        return x2d.contiguous()
    return x2d


def _launch_linear(x2d, packed, tables, bias, out_features, blocksize, blocksize2, nested, fp4, config, capability):
    """Allocate one weight's output and launch the fused kernel into it."""
    y = torch.empty((x2d.shape[0], out_features), dtype=x2d.dtype, device=x2d.device)
    return launch_fused(x2d, packed, tables, bias, y, n=out_features, k=x2d.shape[1], blocksize=blocksize,
                        blocksize2=blocksize2, nested=nested, fp4=fp4, config=config, capability=capability)


def _launch_group(x2d, packed, tables, rows, blocksize, blocksize2, nested, fp4, config, capability):
    """Allocate each weight's output and launch the fused kernel over all of them."""
    outs = [torch.empty((x2d.shape[0], count), dtype=x2d.dtype, device=x2d.device) for count in rows]
    launch_fused(x2d, packed[0], tables[0], None, outs[0], n=sum(rows), k=x2d.shape[1], blocksize=blocksize,
                 blocksize2=blocksize2, nested=nested, fp4=fp4, config=config, capability=capability,
                 members=tuple(zip(packed[1:], tables[1:], outs[1:])))
    return outs


def linear_by_route(x, packed, qs, bias, route):
    """``nf4_linear`` through the given Route (tests and benchmarks force each one; the drop-in's
    call, its layer checked). x's dtype and features and the bias are checked here, the weight's
    layout where the fused kernel reads it. A non-contiguous bias is read contiguous; x or a bias
    that requires grad, with grad enabled, takes dequantize + F.linear (autograd) instead of the
    fused kernel; so does bf16 x under Triton's interpreter, whose tl.dot of bf16 is wrong (3.9)."""
    require(isinstance(route, Route), f"linear_by_route: route must be a routes.Route, got {type(route).__name__}")
    out_features, in_features = (int(dim) for dim in qs.shape)
    check_call(x, bias, out_features, in_features, "linear_by_route")
    return linear_unchecked(x, packed, qs, bias, route, out_features, in_features, device_facts(x.device)[0])


def linear_unchecked(x, packed, qs, bias, route, out_features, in_features, capability):
    """``linear_by_route`` for arguments its caller checked as it does (x's dtype and features, the bias'
    shape, dtype and device, a Route) on a GPU of ``capability``: ``nf4_linear`` and the drop-in, 6 us a call less."""
    path = route.path
    if path == "bitsandbytes" and (INTERPRET or torch.compiler.is_compiling()):
        path = "dequantize"  # its kernels run on CUDA tensors, and outside a compiled graph
    if in_features == 0 or (path == "fused" and torch.is_grad_enabled() and (
            x.requires_grad or (bias is not None and bias.requires_grad))):
        path = "dequantize"
    if path != "dequantize":
        lead = x.shape[:-1]
        x2d = _rows_contiguous(x.reshape(-1, in_features))
    if path == "fused":
        _, blocksize, nested, blocksize2, tables = quantstate.checked_state(packed, qs)
        if x2d.numel() == 0 or out_features == 0 or not _fused_supported(blocksize, in_features, x2d, capability):
            path = "dequantize"
        elif (taken := route_taken(x2d, out_features, blocksize, route, capability)) is not route:
            return linear_unchecked(x, packed, qs, bias, taken, out_features, in_features, capability)
        elif INTERPRET and x2d.dtype is torch.bfloat16 and (not isinstance(route.config, TlConfig) or route.config.dot):
            path = "dequantize"
    if path == "bitsandbytes":
        import bitsandbytes

        return bitsandbytes.matmul_4bit(x2d, packed, quant_state=qs, bias=bias).reshape(*lead, out_features)
    if path == "dequantize":
        return F.linear(x, decoded_weight(packed, qs, x.dtype), bias)
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()  # the kernels read it with unit stride
    if torch.compiler.is_compiling():
        absmax, code, absmax2, code2, offset = tables
        y = torch.ops.nf4_triton.linear(x2d, quantstate.packed_bytes(packed), absmax, code, absmax2, code2, offset, bias,
                                        out_features, blocksize, blocksize2, nested, qs.quant_type == "fp4",
                                        *_config_values(route.config))
        return y.reshape(*lead, out_features)
    y = _launch_linear(x2d, quantstate.packed_bytes(packed), tables, bias, out_features, blocksize, blocksize2, nested,
                       qs.quant_type == "fp4", route.config, capability)
    return y.reshape(*lead, out_features)


def route_taken(x2d, out_features, blocksize, route, capability):
    """The route a call of x2d (rows, in) takes on a GPU of ``capability``: ``route``, or where it is a Gluon
    kernel's and that kernel cannot run the call, the ``tl`` table's route for the same call (which may be
    bitsandbytes'). Not the fallbacks to dequantize of ``linear_by_route`` (an empty call, a layout the fused kernels
    do not read, bitsandbytes under the interpreter or torch.compile)."""
    if (route.path == "fused" and isinstance(route.config, GLUON_CONFIGS)
            and not gluon_supported(x2d, x2d.shape[1], blocksize, route.config, capability)):
        return device_route(x2d.device, x2d.shape[0], x2d.shape[1], out_features, TL_ROUTES)[0]
    return route


def decoded_weight(packed, qs, dtype):
    """W (out, in) in ``dtype``, each value rounded once from its fp32 decode."""
    if qs.dtype is not dtype:
        qs = copy.copy(qs)  # the caller's state is not touched
        qs.dtype = torch.float32
    weight = kernel.dequantize_nf4(packed, qs)
    if packed.dim() > 0 and packed.shape[0] == 1:
        weight = weight.t()  # dequantize returns a one-row packed weight transposed (bitsandbytes' rule)
    return weight.to(dtype)


# --------------------------------------------------------------------------------------------
# torch.compile: the fused kernel as a torch.library operator
# --------------------------------------------------------------------------------------------
def _linear_op(
    x: torch.Tensor,
    packed: torch.Tensor,
    absmax: torch.Tensor,
    code: torch.Tensor,
    absmax2: torch.Tensor,
    code2: torch.Tensor,
    offset: torch.Tensor,
    bias: typing.Optional[torch.Tensor],
    out_features: int,
    blocksize: int,
    blocksize2: int,
    nested: bool,
    fp4: bool,
    family: str,
    config: list[int],
) -> torch.Tensor:
    """The operator's body: ``linear_by_route``'s launch (inputs validated by ``nf4_linear``)."""
    return _launch_linear(x, packed, (absmax, code, absmax2, code2, offset), bias, out_features, blocksize, blocksize2,
                          nested, fp4, _config_of(family, config), device_facts(x.device)[0])


def _config_values(config):
    """(family name, field values as ints): a configuration as a torch.library operator takes it."""
    return type(config).__name__, [int(value) for value in dataclasses.astuple(config)]


def _config_of(family, values):
    """The configuration of ``_config_values`` (bool fields travel as 0 or 1)."""
    kind = CONFIGS[family]
    return kind(*(bool(value) if field.type in (bool, "bool") else value
                  for field, value in zip(dataclasses.fields(kind), values)))


def _linear_op_fake(x, packed, absmax, code, absmax2, code2, offset, bias, out_features, blocksize, blocksize2,
                    nested, fp4, family, config):
    return x.new_empty((x.shape[0], out_features))


_linear_custom_op = torch.library.custom_op("nf4_triton::linear", _linear_op, mutates_args=())
_linear_custom_op.register_fake(_linear_op_fake)


def _linear_group_op(
    x: torch.Tensor,
    packed: list[torch.Tensor],
    absmax: list[torch.Tensor],
    code: list[torch.Tensor],
    absmax2: list[torch.Tensor],
    code2: list[torch.Tensor],
    offset: list[torch.Tensor],
    out_features: list[int],
    blocksize: int,
    blocksize2: int,
    nested: bool,
    fp4: bool,
    family: str,
    config: list[int],
) -> list[torch.Tensor]:
    """``linear_group``'s launch as an operator (inputs validated by ``group_plan``)."""
    return _launch_group(x, packed, list(zip(absmax, code, absmax2, code2, offset)), out_features, blocksize,
                         blocksize2, nested, fp4, _config_of(family, config), device_facts(x.device)[0])


def _linear_group_op_fake(x, packed, absmax, code, absmax2, code2, offset, out_features, blocksize, blocksize2,
                          nested, fp4, family, config):
    return [x.new_empty((x.shape[0], count)) for count in out_features]


_linear_group_custom_op = torch.library.custom_op("nf4_triton::linear_group", _linear_group_op, mutates_args=())
_linear_group_custom_op.register_fake(_linear_group_op_fake)
