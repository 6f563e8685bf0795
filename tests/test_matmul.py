"""The fused NF4 matmul: every route and kernel shape against an fp64 reference of dequantize +
matmul, known-bad products the check must reject, the accepted weight forms, errors, torch.compile.

The contract: the weight decoded exactly as ``dequantize_nf4`` decodes it, rounded once to x's
dtype; fp32 sums; one rounding of the result. So |y - exact| stays within one unit in the last
place of y plus K * 2**-24 of the sum of absolute products (``reference.linear_error_bound``).
Without CUDA the kernels run through Triton's interpreter, whose tl.dot is wrong for bf16 operands
(Triton 3.9): the CPU runs the tensor-core shape in fp16 and fp32, bf16 only in the FMA shape.
"""

import copy
import gc
import itertools
import weakref

import pytest
import torch

from helpers import assert_unchanged, failures_in_threads, linear4bit, quantize, snapshot
from nf4_triton import fastpath, fused, kernel, matmul, mma_layouts, quantstate, routes
from nf4_triton.routes import GLUON_CONFIGS, KSliceConfig, MmaConfig, TlConfig, WgmmaConfig
from reference import dequantize_reference, linear_error_bound, linear_reference

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
# Kernel shapes: the FMA row, tensor-core tiles with and without split-K, a deeper and a wider one.
CONFIGS = [TlConfig(1, 16, 64, dot=False, lookup=0), TlConfig(1, 32, 128, split_k=3, dot=False, lookup=1),
           TlConfig(1, 16, 64, split_k=2, dot=False), TlConfig(16, 16, 64, lookup=0), TlConfig(16, 32, 128, split_k=2, lookup=1),
           TlConfig(32, 16, 256, split_k=4, num_stages=3), TlConfig(16, 16, 64), TlConfig(64, 16, 64, num_stages=3)]
# (out, in) small and odd: a partial last tile of rows, K not a multiple of the tile, one block of K.
SHAPES = [(17, 192), (40, 64), (1, 320), (32, 256)]


def dtypes_for(config):
    if HAS_CUDA:
        return [torch.float16, torch.bfloat16]
    return [torch.float16, torch.float32] if config.dot else [torch.float16, torch.bfloat16]


def decoded(packed, state, dtype):
    """The weight as the contract decodes it: bitsandbytes' arithmetic in fp32, rounded once to dtype."""
    fp32_state = copy.copy(state)
    fp32_state.dtype = torch.float32
    return dequantize_reference(packed, fp32_state).to(dtype)


def assert_within_bound(y, x, weight, bias=None):
    exact = linear_reference(x, weight, bias)
    error = (y.detach().cpu().double() - exact).abs()
    bound = linear_error_bound(y, x, weight, bias)
    assert torch.isfinite(y).all()
    assert (error <= bound).all(), f"max error {error.max().item():.3g}, worst margin {(error - bound).max().item():.3g}"


def assert_contract(y, x, packed, state, bias=None):
    """nf4_linear's result: bitsandbytes' own where the route the call takes is bitsandbytes' (the tl
    table's at one or two rows on the H100, where mma.py's tile does not fit the call), else within
    the bound of the exact decode."""
    rows, (out_features, in_features) = x.numel() // x.shape[-1], state.shape
    route, capability = matmul.device_route(x.device, rows, in_features, out_features)
    if matmul.route_taken(x.reshape(-1, in_features), out_features, state.blocksize, route,
                          capability).path == "bitsandbytes":
        import bitsandbytes

        assert torch.equal(y, bitsandbytes.matmul_4bit(x, packed, quant_state=state, bias=bias))
    else:
        assert_within_bound(y.reshape(-1, out_features), x.reshape(-1, in_features), decoded(packed, state, x.dtype),
                            bias)


def launch(x, packed, state, config, bias=None):
    n, k = state.shape
    _, blocksize, nested, blocksize2, tables = quantstate.check_state(packed, state)
    y = torch.full((x.shape[0], n), float("nan"), dtype=x.dtype, device=x.device)  # poisoned: every element written
    fused.launch_fused(x, packed.view(torch.uint8), tables, bias, y, n=n, k=k, blocksize=blocksize,
                       blocksize2=blocksize2, nested=nested, fp4=state.quant_type == "fp4", config=config,
                       capability=fastpath.device_facts(x.device)[0])
    return y


@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_kernel_shapes_within_bound(config, shape):
    for dtype, rows in itertools.product(dtypes_for(config), (1, 5) if config.dot else (1, 2)):
        packed, state = quantize(shape, dtype=dtype, device=DEVICE, seed=rows + shape[0])
        generator = torch.Generator().manual_seed(rows)
        x = torch.randn(rows, shape[1], generator=generator).to(dtype).to(DEVICE)
        bias = torch.randn(shape[0], generator=generator).to(dtype).to(DEVICE)
        y = launch(x, packed, state, config, bias)
        assert_within_bound(y, x, decoded(packed, state, dtype), bias)


@pytest.mark.parametrize("known_bad", ["swap_nibbles", "drop_offset", "fp16_sums"])
def test_bound_rejects_known_bad_products(known_bad):
    """The check fails a product whose weight has one classic decode mistake, or whose sums run in
    16 bits: proof that it can fail."""
    packed, state = quantize((24, 512), dtype=torch.float16, seed=3)
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(1)).half()
    weight = decoded(packed, state, torch.float16)
    if known_bad == "fp16_sums":
        partial = (x.float()[:, None, :] * weight.float()[None, :, :]).half()
        y = torch.zeros(4, 24, dtype=torch.float16)
        for k in range(512):
            y = y + partial[:, :, k]
    else:
        fp32_state = copy.copy(state)
        fp32_state.dtype = torch.float32
        bad = dequantize_reference(packed, fp32_state, **{known_bad: True}).half()
        y = (x.double() @ bad.double().T).half()
    with pytest.raises(AssertionError):
        assert_within_bound(y, x, weight)


FORMS = {
    "nf4 nested": {},
    "nf4 flat absmax": {"nested": False},
    "fp4": {"quant_type": "fp4"},
    "blocksize 128": {"blocksize": 128},
    "blocksize 32": {"blocksize": 32},
    "bf16 storage": {"storage": torch.bfloat16},
    "fp32 storage": {"storage": torch.float32},
}


@pytest.mark.parametrize("form", FORMS, ids=str)
@pytest.mark.parametrize("lead", [(3,), (2, 2), (1,)], ids=str)
def test_nf4_linear_formats(form, lead):
    dtype = torch.float16
    packed, state = quantize((24, 256), dtype=dtype, device=DEVICE, seed=5, **FORMS[form])
    x = torch.randn(*lead, 256, generator=torch.Generator().manual_seed(2)).half().to(DEVICE)
    y = matmul.nf4_linear(x, packed, state)
    assert y.shape == (*lead, 24) and y.dtype == dtype
    assert_contract(y, x, packed, state)


@pytest.mark.parametrize("rows", [1, 3, 16, 40])
def test_nf4_linear_module_forms_and_routes(rows):
    """A Linear4bit, its Params4bit and (packed, state) give the same result by every route the
    call can take (the rows decide: fused at a few, dequantize + matmul at more)."""
    layer, packed, state = linear4bit((40, 128), dtype=torch.float16, device=DEVICE, bias=True)
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows)).half().to(DEVICE)
    before = snapshot(packed, state)
    x_before = x.clone()
    results = [matmul.nf4_linear(x, form, bias=layer.bias.data) for form in (layer, layer.weight)]
    results.append(matmul.nf4_linear(x, packed, state, bias=layer.bias.data))
    assert all(torch.equal(results[0], other) for other in results[1:])
    assert_contract(results[0], x, packed, state, layer.bias.data)
    assert_unchanged(packed, state, before)
    assert torch.equal(x, x_before)


def test_nf4_linear_decodes_to_x_dtype():
    """A state whose dtype differs from x's: the weight is rounded once, straight to x's dtype."""
    packed, state = quantize((24, 128), dtype=torch.float16, device=DEVICE, seed=7)
    x = torch.randn(20, 128, generator=torch.Generator().manual_seed(3)).to(DEVICE)  # fp32, many rows
    y = matmul.nf4_linear(x, packed, state)
    assert y.dtype == torch.float32 and state.dtype == torch.float16
    assert_within_bound(y, x, decoded(packed, state, torch.float32))


@pytest.mark.parametrize("case", ["features", "dtype", "bias shape", "bias dtype", "no state", "state shape",
                                  "not a state", "another weight's state", "bytes converted", "meta weight"])
def test_nf4_linear_errors_name_the_problem(case):
    packed, state = quantize((24, 128), dtype=torch.float16, device=DEVICE, seed=1)
    x = torch.randn(2, 128).half().to(DEVICE)
    args, kwargs, words = (x, packed, state), {}, ""
    if case == "features":
        args, words = (torch.randn(2, 96).half().to(DEVICE), packed, state), "features"
    elif case == "dtype":
        args, words = (x.to(torch.int32), packed, state), "float16, bfloat16 or float32"
    elif case == "bias shape":
        kwargs, words = {"bias": torch.zeros(23, dtype=torch.float16, device=DEVICE)}, "bias must be a tensor of shape"
    elif case == "bias dtype":
        kwargs, words = {"bias": torch.zeros(24, device=DEVICE)}, "bias must be torch.float16"
    elif case == "no state":
        args, words = (x, packed, None), "no quant_state"
    elif case == "state shape":
        state.shape = (24 * 128,)
        words = r"shape must be \(out, in\)"
    elif case == "not a state":
        args, words = (x, packed, object()), "must be a bitsandbytes 4-bit QuantState"
    elif case == "another weight's state":  # twice the bytes: read as this shape, half of them would be ignored
        larger, _ = quantize((48, 128), dtype=torch.float16, device=DEVICE, seed=1)
        args, words = (x, larger, state), "holds 1536"
    elif case == "bytes converted":  # values converted, not the bytes viewed: 4 bytes a packed byte
        args, words = (x, packed.float(), state), "converted rather than viewed"
    elif case == "meta weight":
        args, words = (x.to("meta"), packed.to("meta"), state), "meta tensor"
    with pytest.raises(ValueError, match=words):
        matmul.nf4_linear(*args, **kwargs)


@pytest.mark.parametrize("case", ["route", "x dtype", "short bias"])
def test_linear_by_route_checks_its_call(case):
    """The forced routes check x and the bias too: a short bias would be read past its end."""
    packed, state = quantize((24, 128), dtype=torch.float16, device=DEVICE, seed=1)
    x = torch.randn(2, 128).half().to(DEVICE)
    route, bias, words = routes.Route(8, "fused", TlConfig(16, 16, 64, lookup=0)), None, ""
    if case == "route":
        route, words = None, "route must be a routes.Route"
    elif case == "x dtype":
        x, route, words = x.to(torch.int32), routes.Route(8, "dequantize"), "float16, bfloat16 or float32"
    elif case == "short bias":
        bias, words = torch.zeros(32, dtype=torch.float16, device=DEVICE)[:23], "bias must be a tensor of shape"
    with pytest.raises(ValueError, match=words):
        matmul.linear_by_route(x, packed, state, bias, route)


@pytest.mark.parametrize("build, words", [
    (lambda: KSliceConfig(8, 16, 128, accumulators=3), "accumulators must be 1 or 2"),
    (lambda: KSliceConfig(8, 16, 128, warps=1), "warps must be a power of two >= 2"),
    (lambda: MmaConfig(8, 48, 256), "block_n must be 16 x 4 warps"),
    (lambda: MmaConfig(8, 64, 96, words=4), "block_k must be 32 x 4 words"),
    (lambda: MmaConfig(4, 64, 256), "block_m must be a power of two >= 8"),
    (lambda: WgmmaConfig(64, 128, 128, num_warps=2), "whole warp groups"),
    (lambda: WgmmaConfig(8, 64, 128), "at least a row per 4 lanes of 4 warps"),
    (lambda: WgmmaConfig(512, 64, 128), "at most 256"),
    (lambda: TlConfig(8, 32, 256), "tl.dot tiles take 16 rows or more"),
    (lambda: TlConfig(16, 32, 256, lookup=3), "lookup must be 0, 1 or 2"),
    (lambda: MmaConfig(16, 64, 256).replace(words=3), "words must be 2 or 4"),
])
def test_a_configuration_is_checked_when_built(build, words):
    """Each family refuses at construction what its kernel cannot launch (before, at launch), naming the field."""
    with pytest.raises(ValueError, match=words):
        build()


def test_a_group_launch_takes_its_configuration_inside_a_compiled_graph():
    """The drop-in's merged forward, traced, asks matmul.group_config for each route's launch configuration: it
    traces with no graph break (building a configuration there did not: torch 2.11's Dynamo cannot trace its hash, and
    after a recompile its validation's f-strings meet symbolic ints) and gives the eager call's configuration."""
    configs = sorted({route.config for table in routes.MATMUL_ROUTES.values() for route in table
                      if isinstance(route.config, GLUON_CONFIGS)}, key=repr)
    splits = [config for config in configs if config.split_k > 1]
    assert splits and len(splits) < len(configs)  # folded and left as they are, both
    torch._dynamo.reset()

    @torch.compile(fullgraph=True, backend="eager")
    def launched(x, config):
        taken = matmul.group_config(config, 4096)
        return x * taken.block_n + taken.split_k + int(getattr(taken, "fold", False))

    x = torch.ones(2)
    for config in splits[:3] + [config for config in configs if config.split_k == 1][:2]:
        taken = matmul.group_config(config, 4096)
        assert taken.split_k == config.split_k and getattr(taken, "fold", False) == (config.split_k > 1)
        assert torch.equal(launched(x, config), x * taken.block_n + taken.split_k + int(getattr(taken, "fold", False)))
    assert splits[0].folded() is splits[0].folded() == splits[0].replace(fold=True)  # built once, with the route


@pytest.mark.skipif(not mma_layouts.AVAILABLE, reason="the Gluon kernels need Triton 3.6 on")
def test_accumulators_reach_the_kernel():
    """gate|up merged's one-row route launches the K-slice kernel with two accumulators, the others with one."""
    from nf4_triton import mma_sync

    for shape, count in (((4096, 28672), 2), ((4096, 14336), 1)):
        config = routes.choose_route((9, 0), 1, *shape).config
        kernel_fn, constexprs = fused.gluon_kernel(config, shape[0] // config.block_k, 1, False, 2)
        assert kernel_fn is mma_sync.nf4_mma_kwarps_kernel and constexprs["ACCUMULATORS"] == count


@pytest.mark.parametrize("bias_form", ["strided", "expanded"])
def test_nf4_linear_reads_a_strided_bias(bias_form):
    """A bias view with a stride other than one is added element by element, not read as contiguous."""
    packed, state = quantize((24, 128), dtype=torch.float16, device=DEVICE, seed=2)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(4)).half().to(DEVICE)
    if bias_form == "strided":
        bias = torch.arange(48, dtype=torch.float16, device=DEVICE)[::2]
    else:
        bias = torch.full((1,), 7.0, dtype=torch.float16, device=DEVICE).expand(24)
    for config in (TlConfig(16, 16, 64, lookup=0), TlConfig(16, 16, 64, split_k=2, lookup=0)):  # bias in the kernel, in the sum
        y = matmul.linear_by_route(x, packed, state, bias, routes.Route(8, "fused", config))
        assert_within_bound(y, x, decoded(packed, state, torch.float16), bias)


@pytest.mark.parametrize("trusted", [False, True], ids=["checked", "known-bad-trusted"])
def test_a_kept_check_reads_the_tables_the_state_holds_now(trusted, monkeypatch):
    """The fused path keeps its check of a quant state (``quantstate.checked_state``): after a call, a
    table replaced in the state is read anew. Known-bad, a kept check served without ``StateFacts``
    launches with the old table and leaves the bound."""
    packed, state = quantize((24, 128), dtype=torch.float16, device=DEVICE, seed=5)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(6)).half().to(DEVICE)
    route = routes.Route(8, "fused", TlConfig(16, 16, 64, lookup=0))
    matmul.linear_by_route(x, packed, state, None, route)
    if trusted:
        monkeypatch.setattr(quantstate.StateFacts, "matches", lambda self, packed, qs: True)
    state.absmax = state.absmax.flip(0).contiguous()
    y = matmul.linear_by_route(x, packed, state, None, route)
    within = (y.double().cpu() - linear_reference(x, decoded(packed, state, torch.float16))).abs() <= (
        linear_error_bound(y, x, decoded(packed, state, torch.float16)))
    assert bool(within.all()) is not trusted


def test_a_kept_check_goes_with_its_state():
    """What the fused path keeps for a quant state is dropped when the state dies."""
    packed, state = quantize((24, 128), dtype=torch.float16, device=DEVICE, seed=7)
    x = torch.randn(1, 128).half().to(DEVICE)
    matmul.linear_by_route(x, packed, state, None, routes.Route(8, "fused", TlConfig(16, 16, 64, lookup=0)))
    kept = weakref.ref(quantstate.kept_check(state))
    assert kept().state_ref() is state
    del state
    gc.collect()
    assert kept() is None  # nothing holds it any more


def test_nf4_linear_keeps_the_gradient():
    """x that requires grad, with grad enabled: the result carries x's and the bias' gradients (dequantize +
    F.linear), where the fused kernel, which records no graph, would drop them."""
    packed, state = quantize((24, 128), dtype=torch.float16, device=DEVICE, seed=3)
    x = torch.randn(2, 128).half().to(DEVICE).requires_grad_()
    bias = torch.zeros(24, dtype=torch.float16, device=DEVICE, requires_grad=True)
    y = matmul.linear_by_route(x, packed, state, bias, routes.Route(8, "fused", TlConfig(16, 16, 64, lookup=0)))
    y.float().sum().backward()
    weight = decoded(packed, state, torch.float16)
    assert torch.equal(x.grad, torch.ones(2, 24, dtype=torch.float16, device=DEVICE) @ weight)
    assert torch.equal(bias.grad, torch.full((24,), 2.0, dtype=torch.float16, device=DEVICE))


def test_nf4_linear_without_input_features():
    """A weight of no input features gives what F.linear gives: the bias, or zeros."""
    packed, state = quantize((24, 0), dtype=torch.float16, device=DEVICE, seed=5)
    x = torch.randn(2, 0).half().to(DEVICE)
    assert torch.equal(matmul.nf4_linear(x, packed, state), torch.zeros(2, 24, dtype=torch.float16, device=DEVICE))


@pytest.mark.skipif(HAS_CUDA, reason="the interpreter's bf16 dot")
def test_interpreter_bf16_takes_no_dot():
    """Under the interpreter, whose tl.dot of bf16 operands is wrong (Triton 3.9), bf16 x on a tensor-core
    route is dequantized: within the bound, not the dot's garbage."""
    packed, state = quantize((24, 128), dtype=torch.bfloat16, device=DEVICE, seed=6)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(5)).bfloat16()
    y = matmul.linear_by_route(x, packed, state, None, routes.Route(8, "fused", TlConfig(16, 16, 64, lookup=0)))
    assert_within_bound(y, x, decoded(packed, state, torch.bfloat16))


def test_nf4_linear_group_names_itself():
    """Weights not given as a list (here a generator) get the group's own error."""
    packed, state = quantize((24, 128), dtype=torch.float16, device=DEVICE, seed=1)
    with pytest.raises(ValueError, match="nf4_linear_group: weights must be a list of 1 to 3 layers, got a generator"):
        matmul.nf4_linear_group(torch.randn(2, 128).half().to(DEVICE), (layer for layer in [(packed, state)]))


def test_routes_are_well_formed():
    for table in (*routes.MATMUL_ROUTES.values(), routes.DEFAULT_ROUTES, *routes.TL_ROUTES.values()):
        for route in table:
            assert route.path in ("fused", "dequantize", "bitsandbytes")
            assert (route.config is not None) == (route.path == "fused")
            assert route.config is None or isinstance(route.config, (TlConfig, *GLUON_CONFIGS))
            assert route.config is None or isinstance(route.config, KSliceConfig) or not getattr(route.config, "fold", 0) \
                or route.config.split_k > 1
    for table in routes.TL_ROUTES.values():  # the table for where the Gluon kernels cannot run
        assert not any(isinstance(route.config, GLUON_CONFIGS) for route in table)
    assert not any(isinstance(route.config, GLUON_CONFIGS) for route in routes.MATMUL_ROUTES[(7, 5)])
    for capability, table in routes.MATMUL_ROUTES.items():  # wgmma is sm_90's alone
        assert capability == (9, 0) or not any(isinstance(route.config, WgmmaConfig) for route in table)
    # the H100's tables at the measured points (bench/matmul.py --sweep)
    route = routes.choose_route
    assert isinstance(route((9, 0), 1, 4096, 14336).config, GLUON_CONFIGS) and route((9, 0), 3, 4096, 4096).config.split_k == 8
    assert route((9, 0), 1, 4096, 1024).config.split_k == 16 and route((9, 0), 2, 4096, 1024).config.split_k == 16
    assert all(isinstance(route((9, 0), m, *shape).config, GLUON_CONFIGS) for m, shape in ((8, (4096, 1024)),
                                                                                         (64, (4096, 4096))))
    # the long-K layers at split 16 from 1 to 8 rows, 32 at 1 and 2 rows of 28672x8192 (NOTES.md item 85); not 8192x8192
    assert [route((9, 0), m, 14336, 4096).config.split_k for m in (1, 4, 8, 16)] == [16, 16, 16, 8]
    assert [route((9, 0), m, 28672, 8192).config.split_k for m in (1, 2, 3, 8)] == [32, 32, 16, 16]
    assert route((9, 0), 1, 8192, 8192).config.split_k == 8 and route((9, 0), 8, 8192, 8192).config.split_k == 8
    # K slices across a program's warps at 1 and 2 rows where they divide K, from 4096 inputs (item 99): 4 warps of 512
    # columns on 4096x14336 and gate|up merged, 256 at two rows of gate|up; 8 warps of 128 on 4096x4096
    wide = route((9, 0), 1, 4096, 14336).config
    assert wide.warps == 4 and wide == route((9, 0), 2, 4096, 14336).config.replace(stream=True)
    assert route((9, 0), 1, 4096, 28672).config == wide.replace(accumulators=2)  # gate|up merged, one row (item 103)
    assert route((9, 0), 2, 4096, 28672).config == wide.replace(block_k=256)
    assert [route((9, 0), m, shape[0], shape[1]).config.accumulators for m, shape in (
        (1, (4096, 14336)), (2, (4096, 28672)), (1, (4096, 6144)), (1, (4096, 4096)))] == [1, 1, 1, 1]
    # the words streamed where it won (item 101): folded or read-back sums, not the one-row K slices of q|k|v or 4096x4096
    assert all(route((9, 0), m, 14336, 4096).config.stream for m in (1, 4, 8, 16))
    assert all(route((9, 0), m, 4096, 28672).config.stream for m in (1, 2, 4, 8, 16))
    assert not any(route((9, 0), m, *shape).config.stream for m, shape in ((1, (4096, 6144)), (1, (4096, 4096)),
                                                                          (2, (4096, 4096)), (32, (4096, 14336))))
    assert [getattr(route((9, 0), m, 4096, 4096).config, "warps", 1) for m in (1, 2, 3)] == [8, 8, 1]
    assert not isinstance(route((9, 0), 1, 14336, 4096).config, KSliceConfig)
    assert not isinstance(route((9, 0), 1, 8192, 2048).config, KSliceConfig)
    # elsewhere the loop unrolled at 1 to 2 rows (1 to 4 of 14336x4096), 512 columns a step where they divide K (item 87)
    unrolled = route((9, 0), 3, 4096, 14336).config.replace(block_k=512, unroll=4, stream=False)
    assert route((9, 0), 1, 4608, 14336).config == route((9, 0), 2, 4608, 14336).config == unrolled
    assert route((9, 0), 3, 4096, 14336).config.unroll == 1 and route((9, 0), 1, 8192, 28672).config.unroll == 1
    assert route((9, 0), 1, 4352, 14336).config == route((9, 0), 3, 4096, 14336).config  # 512 columns do not divide K
    assert route((9, 0), 1, 3584, 18944).config == route((9, 0), 3, 4096, 14336).config  # measured from K = 4096 only
    assert [route((9, 0), m, 14336, 4096).config.unroll for m in (1, 4, 8)] == [4, 4, 1]
    assert [route((9, 0), m, 14336, 4096).config.block_k for m in (1, 2, 3)] == [512, 512, 256]  # item 103
    assert route((9, 0), 1, 18944, 3584).config.block_k == 256  # there 512 columns would halve the split
    assert route((9, 0), 1, 28672, 8192).config == route((9, 0), 1, 28416, 8192).config.replace(block_k=512, unroll=4)
    assert route((9, 0), 1, 4096, 1024).config.num_warps == 8 and route((9, 0), 8, 4096, 1024).config.num_warps == 4
    # q|k|v merged from 24M weights, 4096 inputs and 6144 outputs: K slices at 1 and 2 rows (item 99), else 512
    # columns at split 8 at one row (item 90)
    assert route((9, 0), 1, 4096, 6144).config == wide.replace(stream=False)
    assert route((9, 0), 2, 4096, 6144).config == wide.replace(block_k=256)
    assert route((9, 0), 1, 4608, 6144).config == MmaConfig(8, 64, 512, split_k=8, words=4, stage_x=False, fold=True,
                                                            unroll=4)
    def wgmma(rows, *shape):
        return isinstance(route((9, 0), rows, *shape).config, WgmmaConfig)

    assert wgmma(32, 4096, 14336) and not wgmma(32, 14336, 4096)
    assert route((9, 0), 8, 4096, 14336).config.words == 4 and route((9, 0), 32, 4096, 14336).config.words == 2
    assert not route((9, 0), 4, 4096, 14336).config.stage_x and route((9, 0), 8, 4096, 14336).config.stage_x
    assert not route((9, 0), 2, 28672, 8192).config.stage_x and route((9, 0), 4, 28672, 8192).config.stage_x
    assert route((9, 0), 8, 4096, 4096).config.fold and not route((9, 0), 8, 4096, 14336).config.fold
    assert route((9, 0), 1, 14336, 4096).config.fold and not route((9, 0), 1, 28672, 8192).config.fold
    assert wgmma(64, 4096, 14336) and not wgmma(64, 4096, 1024)
    assert all(wgmma(128, *shape) for shape in ((4096, 14336), (14336, 4096), (4096, 4096), (4096, 1024), (8192, 28672),
                                                (28672, 8192)))
    assert wgmma(256, 14336, 4096) and route((9, 0), 256, 4096, 4096).path == "dequantize"
    assert route((9, 0), 512, 4096, 14336).path == "dequantize"
    assert route((9, 0), 1, 4096, 14336, routes.TL_ROUTES).path == "bitsandbytes"
    assert route((9, 0), 16, 4096, 14336, routes.TL_ROUTES).config.block_n == 64
    assert route((9, 0), 64, 4096, 4096, routes.TL_ROUTES).path == "dequantize"
    assert route((9, 0), 4096, 4096, 14336).path == "dequantize"


def test_fast_dram_dequantizes_from_129_rows():
    """sm_90 with a DRAM peak of FAST_DRAM_GBPS or more (the H200) takes the H100's routes up to 128 rows and
    dequantize + cuBLAS beyond, where the H100 takes wgmma's 256-row tiles (NOTES.md item 109)."""
    h200, h100 = 4814, 3352  # test_peak_dram_gbps's two devices
    shapes = [(4096, 14336), (14336, 4096), (8192, 28672), (28672, 8192), (4096, 4096), (4096, 1024), (8192, 8192)]
    for shape in shapes:
        for rows in (1, 2, 3, 8, 16, 17, 64, 100, 128):
            assert routes.choose_route((9, 0), rows, *shape, dram_gbps=h200) == routes.choose_route((9, 0), rows, *shape)
        for rows in (129, 200, 256, 512):
            assert routes.choose_route((9, 0), rows, *shape, dram_gbps=h200).path == "dequantize", (shape, rows)
    assert all(routes.choose_route((9, 0), 256, *shape, dram_gbps=h100).path == "fused" for shape in shapes[:4])
    assert routes.choose_route((9, 0), 256, 4096, 14336, dram_gbps=fastpath.FAST_DRAM_GBPS - 1).path == "fused"
    assert routes.choose_route((9, 0), 256, 4096, 14336, dram_gbps=fastpath.FAST_DRAM_GBPS).path == "dequantize"
    # the DRAM rule is sm_90's alone, and not the tl table's (which stops at 128 rows)
    assert routes.routes_for((8, 0), dram_gbps=h200) is routes.routes_for((8, 0))
    assert routes.routes_for((9, 0), routes.TL_ROUTES, h200) is routes.TL_ROUTES[(9, 0)]


@pytest.mark.parametrize("peak,path", [(4814, "dequantize"), (3352, "fused")], ids=["h200", "h100"])
def test_device_route_reads_the_dram_peak(monkeypatch, peak, path):
    """A call's route takes its device's DRAM peak, not its capability alone: 256 rows of 14336x4096 on sm_90."""
    monkeypatch.setattr(matmul, "device_facts", lambda device=None: ((9, 0), 50 << 20, peak))
    for device in (torch.device("cuda", 0), None):
        assert matmul.device_route(device, 256, 14336, 4096)[0].path == path


def test_mma_route_falls_back_to_the_tl_table():
    """Where mma.py's kernel cannot run (here: fp32 x, or the interpreter), an mma route computes
    through the tl table's route for the same call, within the same bound."""
    packed, state = quantize((40, 256), dtype=torch.float32, device=DEVICE, seed=6)
    x = torch.randn(5, 256).to(DEVICE)
    config = MmaConfig(8, 64, 256)
    assert not fused.gluon_supported(x, 256, 64, config, fastpath.device_facts(x.device)[0])
    y = matmul.linear_by_route(x, packed, state, None, routes.Route(8, "fused", config))
    assert_within_bound(y, x, decoded(packed, state, torch.float32))


def test_nf4_linear_in_torch_compile_one_graph():
    packed, state = quantize((24, 128), dtype=torch.float16, device=DEVICE, seed=4)
    x = torch.randn(3, 128).half().to(DEVICE)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: matmul.nf4_linear(x, packed, state), fullgraph=True)
    assert torch.equal(compiled(x), matmul.nf4_linear(x, packed, state))


@pytest.mark.long
@pytest.mark.parametrize("cc", [75, 80, 86, 89, 90])
def test_routes_compile_ahead_of_time(cc):
    """Every fused route's configuration compiles for the GPUs it names (K = 4096), with the decode's
    multiply in inline PTX and the product on tensor cores from sm_80 (wgmma where a warp group
    holds 64 weight rows on sm_90, else mma; on sm_75, which routes none, the tl tile's dot is FMA);
    mma.py's routes with shared memory for x's tile alone where they stage it, none where each warp
    reads its own fragments, the folded split-K sum's count in 4 bytes (the tile's space, where it has one),
    and a thread's words of a chunk in one vector load (16 bytes at 4 words, 8 at 2), as the JIT compiles a
    call with aligned tensors (unspecialized, every load is scalar); the K-slice tiles the one-row sweep
    times likewise, their slices' sums through shared memory; the words evict-first where a config streams them."""
    import json
    import os
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), "aot_compile_matmul.py")
    done = subprocess.run([sys.executable, script, str(cc)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert lines or (cc < 80 and not matmul.SM75_COMPILES), "no fused route compiled"
    for line in lines:
        assert line["asm_mul_ftz"] > 0, line
        config, family = line["config"], line["config"]["family"]
        if family != "TlConfig":  # a Gluon kernel: mma.sync or wgmma on fragments decoded in registers, codes by shuffle
            staged = family == "WgmmaConfig" or config.get("stage_x", False)
            x_tile_bytes = config["block_m"] * config["block_k"] * 2 if staged else 0
            count_bytes = 4 if config.get("fold") else 0  # fold: the tile's count, shared with every thread
            assert line["wgmma" if family == "WgmmaConfig" else "mma"] > 0 and line["shfl"] > 0, line
            if family == "KSliceConfig":  # the slices' sums added through shared memory, one fp32 tile a warp at most
                assert 0 < line["shared_bytes"] <= config["warps"] * config["block_n"] * config["block_m"] * 4, line
            else:
                assert line["shared_bytes"] == max(x_tile_bytes, count_bytes), line
            assert line["ld_v4" if config["words"] == 4 else "ld_v2"] > 0, line
            # stream: the words' vector loads evict-first in L1 and L2 (one policy register); no route's otherwise
            assert (line["ld_evict_first"] > 0) == config["stream"], line
        elif config["dot"]:  # a tensor-core tile from sm_80; below, Triton lowers tl.dot to FMA (no mma in the PTX)
            assert (line["wgmma"] + line["mma"] > 0) == (cc >= 80), line
    if cc == 90 and mma_layouts.AVAILABLE:  # sm_90's Gluon routes stream the words in both kernels, not in every route
        # (items 101, 102); before Triton 3.6 the tl table's routes, none of the Gluon kernels'
        streamed = {(line["config"]["family"] == "KSliceConfig", line["config"]["stream"]) for line in lines
                    if line["config"]["family"] != "TlConfig"}
        assert streamed == {(True, True), (True, False), (False, True), (False, False)}


def test_sass_loop_facts_count_the_k_loop():
    """aot_compile_matmul.loop_facts counts the innermost loop that holds a tensor-core instruction (not a loop
    without one, not the code around it) and falls back to the whole kernel where every step is unrolled."""
    import os

    before = os.environ.get("TRITON_INTERPRET")
    import aot_compile_matmul

    assert os.environ.get("TRITON_INTERPRET") == before  # imported, the script leaves the process's Triton alone

    sass = "\n".join(["Function:k", "--:-:-:-:1\tS2R R1, SR_TID.X;", "LBB0:", "--:-:-:-:2\tSHFL.IDX PT, R2, R3, R4, 0x1f;",
                      "--:-:-:-:4\t@P0 BRA LBB0;", "LBB1:", "01:-:-:-:5\tLDG.E.128 R4, desc[UR4][R2.64];",
                      "--:-:-:-:3\tFMUL R5, R5, R6;", "--:-:-:-:7\tHMMA.16816.F32 R8, R4, R6, R8;",
                      "--:-:-:-:b\t@!P1 BRA LBB1;", "--:-:-:-:1\tEXIT;"])
    assert aot_compile_matmul.loop_facts(sass) == {
        "scope": "loop", "instructions": 4, "stall_cycles": 5 + 3 + 7 + 11,
        "by_class": {"global load": 1, "fp32 math": 1, "mma": 1, "control": 1}}
    unrolled = aot_compile_matmul.loop_facts(sass.replace("@!P1 BRA LBB1;", "NOP;"))
    assert unrolled["scope"] == "kernel" and unrolled["instructions"] == 8 and unrolled["by_class"]["shuffle"] == 1


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_gpu_every_h100_route_within_bound(dtype):
    """Each sm_90 route's fused configuration, forced at small odd shapes, and bitsandbytes' path
    equal to its own matmul_4bit."""
    import bitsandbytes

    for route in routes.MATMUL_ROUTES[(9, 0)]:
        # the second shape's K whole slices of a K-slice tile (K = 320 takes the tl table's route there)
        k_slices = 1 if route.config is None else routes.columns_per_step(route.config)
        for shape, rows in (((72, 320), 3), ((136, max(1024, 2 * k_slices)), route.max_rows)):
            packed, state = quantize(shape, dtype=dtype, device="cuda", seed=rows)
            x = torch.randn(rows, shape[1], device="cuda", dtype=dtype)
            y = matmul.linear_by_route(x, packed, state, None, route)
            if route.path == "bitsandbytes":
                assert torch.equal(y, bitsandbytes.matmul_4bit(x, packed, quant_state=state))
            else:
                assert_within_bound(y, x, kernel.dequantize_nf4(packed, state).to(dtype))


# mma.py's tiles: (block_m, block_n, block_k, split_k, num_warps); one to four repeats of 16 rows a warp, 2 or 4
# words a thread and chunk, x staged in shared memory or read by each warp, the split-K sum in a second kernel or
# folded into the first; K slices across a program's warps (kwarps: one or two repeats, 2 or 4 words, 2 to 8 warps);
# the words evict-first (stream) in each kernel; two accumulators in the K-slice kernel.
MMA_CONFIGS = [MmaConfig(8, 64, 64), MmaConfig(16, 128, 128, split_k=2),
               MmaConfig(8, 128, 256, split_k=4, num_warps=8), MmaConfig(64, 128, 64, num_warps=2),
               MmaConfig(8, 64, 256, split_k=2, words=4), MmaConfig(16, 64, 128, words=4),
               MmaConfig(8, 64, 256, split_k=4, words=4, stage_x=False), MmaConfig(16, 64, 64, split_k=2, stage_x=False),
               MmaConfig(8, 64, 256, split_k=4, words=4, fold=True),
               MmaConfig(8, 64, 128, split_k=2, words=4, stage_x=False, fold=True),
               WgmmaConfig(16, 64, 128), WgmmaConfig(32, 128, 64, split_k=2, num_warps=8),
               WgmmaConfig(64, 128, 128, split_k=2, words=4),
               WgmmaConfig(128, 64, 64, split_k=2, fold=True, prefetch=True),
               MmaConfig(32, 64, 128, split_k=4, prefetch=True),
               KSliceConfig(8, 16, 128),
               KSliceConfig(16, 32, 64, warps=2, words=2),
               KSliceConfig(8, 16, 512, warps=8, unroll=4),
               MmaConfig(8, 64, 128, split_k=2, words=4, stage_x=False, fold=True, stream=True),
               KSliceConfig(8, 16, 256, unroll=4, stream=True),
               KSliceConfig(8, 16, 128, unroll=2, accumulators=2)]


@pytest.mark.gpu
@pytest.mark.parametrize("config", MMA_CONFIGS, ids=str)
@pytest.mark.parametrize("form", ["nf4 nested", "nf4 flat", "fp4 nested", "nf4 blocksize 128", "nf4 blocksize 32"])
def test_gpu_mma_weights_bit_exact(config, form):
    """mma.py's kernel: x = the identity picks each decoded weight out alone (its sum has one
    non-zero term), so the product equals dequantize_nf4's weight bit for bit, through the
    permuted K order, partial tiles of rows (N = 72, 200) and split-K; random x, with bias, within
    the bound. A weight decoded wrong in one place fails the first check."""
    if isinstance(config, WgmmaConfig) and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("wgmma is sm_90's")
    blocksize = int(form.split()[-1]) if "blocksize" in form else 64
    for dtype, out_features in itertools.product((torch.float16, torch.bfloat16), (72, 200)):
        in_features = 2 * routes.columns_per_step(config) * config.split_k
        packed, state = quantize((out_features, in_features), dtype=dtype, device="cuda", blocksize=blocksize,
                                 nested="flat" not in form, quant_type=form[:3], seed=out_features)
        x = torch.eye(in_features, device="cuda", dtype=dtype)
        assert fused.gluon_supported(x, in_features, blocksize, config, torch.cuda.get_device_capability())
        weight = kernel.dequantize_nf4(packed, state).to(dtype)
        assert torch.equal(launch(x, packed, state, config).T, weight)
        x = torch.randn(13, in_features, device="cuda", dtype=dtype)
        bias = torch.randn(out_features, device="cuda", dtype=dtype)
        assert_within_bound(launch(x, packed, state, config, bias), x, weight, bias)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_gpu_kwarps_group_equals_each_alone(rows):
    """K slices across a program's warps over q, k and v in one launch: each output bit for bit its weight's
    alone through the same tile, and within the bound of the exact decode."""
    dtype, config = torch.bfloat16, KSliceConfig(8, 16, 128)
    x = torch.randn(rows, 1024, device="cuda", dtype=dtype)
    weights = [quantize((count, 1024), dtype=dtype, device="cuda", seed=count) for count in (96, 48, 40)]
    outs = [torch.full((rows, count), float("nan"), dtype=dtype, device="cuda") for count in (96, 48, 40)]
    members = []
    for (packed_j, state), out in zip(weights, outs):
        _, blocksize, nested, blocksize2, tables_j = quantstate.check_state(packed_j, state)
        members.append((packed_j.view(torch.uint8), tables_j, out))
    fused.launch_fused(x, *members[0][:2], None, outs[0], n=184, k=1024, blocksize=blocksize, blocksize2=blocksize2,
                       nested=nested, fp4=False, config=config, capability=torch.cuda.get_device_capability(),
                       members=tuple(members[1:]))
    for got, (packed_j, state) in zip(outs, weights):
        assert torch.equal(got, launch(x, packed_j, state, config))
        assert_within_bound(got, x, kernel.dequantize_nf4(packed_j, state).to(dtype))


@pytest.mark.gpu
def test_gpu_folded_split_k_sum_owns_its_scratch():
    """The split-K sum folded into mma.py's kernel equals the reduction kernel's bit for bit, with bias: calls
    on two streams at once (each stream its own counters and partials), and a captured graph replayed while
    another stream runs the same layer eagerly (the captured launch's counters and partials its own)."""
    dtype, config = torch.bfloat16, MmaConfig(8, 64, 256, split_k=4, words=4, fold=True)
    packed, state = quantize((4096, 2048), dtype=dtype, device="cuda", seed=5)
    bias = torch.randn(4096, device="cuda", dtype=dtype)
    xs = [torch.randn(rows, 2048, device="cuda", dtype=dtype) for rows in (1, 3, 8, 8)]
    expected = [launch(x, packed, state, config.replace(fold=False), bias) for x in xs]
    torch.cuda.synchronize()  # x and the expected results written before the other streams read them
    streams = [torch.cuda.Stream() for _ in range(2)]
    for _ in range(20):
        outs = []
        for index, x in enumerate(xs):
            with torch.cuda.stream(streams[index % 2]):
                outs.append([launch(x, packed, state, config, bias) for _ in range(3)])
        torch.cuda.synchronize()
        assert all(torch.equal(y, want) for ys, want in zip(outs, expected) for y in ys)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        launch(xs[2], packed, state, config, bias)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = launch(xs[2], packed, state, config, bias)
    for _ in range(20):
        with torch.cuda.stream(side):
            eager = launch(xs[3], packed, state, config, bias)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, expected[2]) and torch.equal(eager, expected[3])


@pytest.mark.gpu
def test_gpu_graph_capture_replays_the_same():
    """nf4_linear and nf4_linear_group captured in one CUDA graph replay their eager outputs."""
    packed, state = quantize((4096, 1024), dtype=torch.bfloat16, device="cuda", seed=9)
    layers = [linear4bit((rows, 1024), device="cuda", seed=rows)[0] for rows in (512, 256)]
    x = torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16)
    eager = [matmul.nf4_linear(x, packed, state), *matmul.nf4_linear_group(x, layers)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        matmul.nf4_linear(x, packed, state)
        matmul.nf4_linear_group(x, layers)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = [matmul.nf4_linear(x, packed, state), *matmul.nf4_linear_group(x, layers)]
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(got, want) for got, want in zip(captured, eager, strict=True))


@pytest.mark.gpu
@pytest.mark.parametrize("config", [TlConfig(16, 32, 128, split_k=2), TlConfig(16, 16, 64, lookup=1),
                                    TlConfig(1, 16, 64, split_k=2, dot=False, lookup=0), *MMA_CONFIGS[:2]], ids=str)
def test_gpu_replayed_launches_equal_triton_launches(config):
    """A repeated call replays the launches its first call recorded (``fused.LAUNCHES``): for a
    new x, a new output, each of two weights of one shape, with and without bias, split-K or not,
    the replay runs and its result equals Triton's own launch of the same call."""
    dtype = torch.bfloat16
    weights = [quantize((136, 1024), dtype=dtype, device="cuda", seed=seed) for seed in (1, 2)]
    bias = torch.randn(136, device="cuda", dtype=dtype)
    replays = []

    def counted(launch_fn):
        def replay(*args):
            replays.append(launch_fn)
            return launch_fn(*args)
        return replay

    fused.LAUNCHES.clear()
    for (packed, state), case_bias in itertools.product(weights, (None, bias)):
        launch(torch.randn(3, 1024, device="cuda", dtype=dtype), packed, state, config, case_bias)  # records
        for key, launches in list(fused.LAUNCHES.items()):
            fused.LAUNCHES[key] = tuple(None if fn is None else counted(fn) for fn in launches)
        x = torch.randn(3, 1024, device="cuda", dtype=dtype)
        before = len(replays)
        replayed = launch(x, packed, state, config, case_bias)
        assert len(replays) == before + (1 if config.split_k == 1 else 2)
        fused.LAUNCHES.clear()
        assert torch.equal(replayed, launch(x, packed, state, config, case_bias))  # Triton's own launch


def test_nf4_linear_group_names_bad_input(device):
    """Several weights read by one x: 1 to 3 of them, each checked as nf4_linear checks it; where no
    launch merges them (the CPU's interpreter; K below every tile's columns), each output is nf4_linear's."""
    x = torch.randn(2, 64, dtype=torch.float16, device=device)
    layers = [linear4bit((rows, 64), dtype=torch.float16, device=device, seed=rows)[0] for rows in (32, 16)]
    for got, layer in zip(matmul.nf4_linear_group(x, layers), layers):
        assert torch.equal(got, matmul.nf4_linear(x, layer))
    with pytest.raises(ValueError, match="1 to 3 layers, got 0"):
        matmul.nf4_linear_group(x, [])
    with pytest.raises(ValueError, match="1 to 3 layers, got 4"):
        matmul.nf4_linear_group(x, layers * 2)

    class Unprintable(list):
        def __repr__(self):
            raise AssertionError("the weights were formatted: a repr reads their bytes back from the GPU")

    for got, layer in zip(matmul.nf4_linear_group(x, Unprintable(layers)), layers):  # valid: no message built
        assert torch.equal(got, matmul.nf4_linear(x, layer))
    with pytest.raises(ValueError, match="features"):
        matmul.nf4_linear_group(x, layers + [linear4bit((16, 128), dtype=torch.float16, device=device)[0]])


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8, 33, matmul.GROUP_MAX_ROWS + 1])
def test_gpu_nf4_linear_group_equals_each_alone(rows, monkeypatch):
    """One launch over q, k and v: each output bit for bit its weight's alone through the group's tile;
    where the tile does not divide a weight's rows, or x has more rows than a group takes,
    nf4_linear's own of each."""
    x = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16)
    layers = [linear4bit((count, 512), device="cuda", seed=count)[0] for count in (256, 128, 128)]
    states = [(layer.weight.data, layer.weight.quant_state) for layer in layers]
    plan = matmul.group_plan(x, states)
    if rows > matmul.GROUP_MAX_ROWS:
        launches = []
        launch = fused.launch_fused
        monkeypatch.setattr(matmul, "launch_fused", lambda *args, **kwargs: launches.append(kwargs.get("members"))
                            or launch(*args, **kwargs))
        for got, layer in zip(matmul.nf4_linear_group(x, layers), layers):
            assert torch.equal(got, matmul.nf4_linear(x, layer))
        assert plan is None and not any(launches)  # every launch one weight's
        return
    assert plan is not None and len(plan.layouts) == 3
    config = plan.config
    assert config.fold or fused.largest_divisor(512 // config.block_k, config.split_k) == 1
    for got, (packed, state) in zip(matmul.nf4_linear_group(x, layers), states):
        assert torch.equal(got, matmul.linear_by_route(x, packed, state, None, routes.Route(rows, "fused", config)))
    odd = [linear4bit((count, 512), device="cuda", seed=count)[0] for count in (200, 128)]
    assert matmul.group_plan(x, [(layer.weight.data, layer.weight.quant_state) for layer in odd]) is None
    for got, layer in zip(matmul.nf4_linear_group(x, odd), odd):
        assert torch.equal(got, matmul.nf4_linear(x, layer))


def outputs_from_threads(call, inputs, calls=200):
    """[[output of each of ``calls`` calls of ``call(x)``] for each input's thread], all threads on the
    current stream at once, nothing synchronized between calls; read once every thread is done."""
    results = [[] for _ in inputs]

    def work(i):
        for _ in range(calls):
            results[i].append(call(inputs[i]))

    failures = failures_in_threads(work, len(inputs))
    torch.cuda.synchronize()
    assert not failures, failures
    return results


@pytest.mark.gpu
@pytest.mark.parametrize("config", [MmaConfig(16, 64, 256, split_k=4, words=4),
                                    MmaConfig(16, 64, 128, split_k=4, words=4, stage_x=False),
                                    WgmmaConfig(32, 128, 64, split_k=4, num_warps=8, prefetch=True),
                                    TlConfig(16, 64, 256, split_k=4)], ids=str)
def test_gpu_threads_on_one_stream_at_a_split_k_reduction(config):
    """Two threads on one stream through a split-K tile whose sums a second kernel adds: each output is its own
    input's (a stream's shared partial sums handed one thread's sums to the other's reduction: 54 of 400
    outputs at 16 rows of 4096x4096 bf16 on an H200 were the other thread's)."""
    if isinstance(config, WgmmaConfig) and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("wgmma runs on sm_90")
    if isinstance(config, GLUON_CONFIGS) and not fused.gluon_runs_on(torch.cuda.get_device_capability()):
        pytest.skip("the Gluon kernels need Triton 3.6 and sm_80")
    dtype = torch.bfloat16
    packed, state = quantize((4096, 4096), dtype=dtype, device="cuda", seed=11)
    route = routes.Route(64, "fused", config)
    xs = [torch.randn(16, 4096, device="cuda", dtype=dtype) for _ in range(2)]
    expected = [matmul.linear_by_route(x, packed, state, None, route) for x in xs]
    results = outputs_from_threads(lambda x: matmul.linear_by_route(x, packed, state, None, route), xs)
    wrong = sum(not torch.equal(y, want) for ys, want in zip(results, expected) for y in ys)
    assert wrong == 0, f"{wrong} of {sum(map(len, results))} outputs are not their own input's"


@pytest.mark.gpu
@pytest.mark.parametrize("shape, rows", [((4096, 4096), 16), ((1024, 4096), 32), ((4096, 14336), 3),
                                         ((4096, 14336), 64)])
def test_gpu_threads_on_one_stream_through_nf4_linear(shape, rows):
    """The routes nf4_linear takes for these calls, two threads on the default stream: every output its own."""
    dtype = torch.bfloat16
    packed, state = quantize(shape, dtype=dtype, device="cuda", seed=rows)
    xs = [torch.randn(rows, shape[1], device="cuda", dtype=dtype) for _ in range(2)]
    expected = [matmul.nf4_linear(x, packed, state) for x in xs]
    results = outputs_from_threads(lambda x: matmul.nf4_linear(x, packed, state), xs)
    wrong = sum(not torch.equal(y, want) for ys, want in zip(results, expected) for y in ys)
    assert wrong == 0, f"{wrong} of {sum(map(len, results))} outputs are not their own input's"


def test_sm75_takes_bitsandbytes_to_its_fused_rows():
    """A T4 (sm_75) has no mma for the Gluon kernels and Triton lowers the tl kernel's tl.dot to FMA there (the
    ahead-of-time check above): bitsandbytes' own 4-bit matmul to its 1536 fused rows, in both tables and dtypes'
    routes, dequantize + cuBLAS beyond."""
    for table in (routes.MATMUL_ROUTES, routes.TL_ROUTES):
        for rows in (1, 2, 8, 16, 64, 1536):
            assert routes.choose_route((7, 5), rows, 4096, 14336, table).path == "bitsandbytes"
        assert routes.choose_route((7, 5), 1537, 4096, 14336, table).path == "dequantize"
