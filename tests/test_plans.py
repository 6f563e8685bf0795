"""Launch plans, the per-call fast path: every call form reaches one, and no plan ever serves what
the validating path would not. On the CPU the plans launch Triton's interpreter over the recorded
addresses, as the GPU's launch passes them, so these checks run in CI too."""

import copy
import gc
import os
import subprocess
import sys
import time
import types
import weakref

import pytest
import torch

from helpers import assert_bit_exact, bit_exact, expected_values, failures_in_threads, linear4bit, offset_copy, quantize
from nf4_triton import kernel, quantstate
from reference import dequantize_reference


def plan_of(state):
    return kernel.PLANS.get(id(state))


def planned(packed, state):
    """Two calls: the validating one, then the plan's (which must exist and be used)."""
    kernel.dequantize_nf4(packed, state)
    plan = plan_of(state)
    assert plan is not None and plan.matches(packed, state)
    return kernel.dequantize_nf4(packed, state)


def test_plan_is_used_and_exact(device):
    packed, state = quantize((256, 320), dtype=torch.bfloat16, device=device, seed=12)
    expected = expected_values(packed, state)
    first = kernel.dequantize_nf4(packed, state)
    assert plan_of(state) is not None
    second, third = kernel.dequantize_nf4(packed, state), kernel.dequantize_nf4(packed, state)
    for got in (first, second, third):
        assert_bit_exact(got, expected)
    assert len({first.data_ptr(), second.data_ptr(), third.data_ptr()}) == 3
    if device == "cuda":
        # Triton 3.3 to 3.9 forward to their C launch function in a way the plan can record: it
        # must take the direct launch there, not silently fall back to Triton's launcher.
        assert plan_of(state).launch_kernel.__name__ in ("direct", "direct_as_tuple")


# ---- every call form reaches the plan --------------------------------------------------------
CALL_FORMS = {
    "module": lambda layer: kernel.dequantize_nf4(layer),
    "params4bit": lambda layer: kernel.dequantize_nf4(layer.weight),
    "params4bit+state": lambda layer: kernel.dequantize_nf4(layer.weight, layer.weight.quant_state),
    "packed+state": lambda layer: kernel.dequantize_nf4(layer.weight.data, layer.weight.quant_state),
    "entry point": lambda layer: kernel.your_dequantize_nf4(layer),
}


@pytest.mark.parametrize("form", CALL_FORMS)
def test_every_call_form_uses_the_plan(form, device, monkeypatch):
    layer, packed, state = linear4bit((96, 128), device=device)
    expected = expected_values(packed, state)
    call = CALL_FORMS[form]
    assert_bit_exact(call(layer), expected)  # validates and leaves the plan
    plan = plan_of(state)
    assert plan is not None

    def refuse(*args, **kwargs):
        raise AssertionError("the validating path ran: the plan was missed")

    monkeypatch.setattr(kernel, "validate_and_dequantize", refuse)
    assert_bit_exact(call(layer), expected)
    assert plan_of(state) is plan


@pytest.mark.parametrize("form", CALL_FORMS)
@pytest.mark.parametrize("change", ["requantized in place", "swapped", "moved", "freed"])
def test_every_call_form_notices(form, change, device):
    """After a plan exists, each form sees a weight re-quantized in place, swapped for another,
    moved to new memory, or freed and its memory reused."""
    layer, packed, state = linear4bit((96, 128), device=device, seed=31)
    call = CALL_FORMS[form]
    call(layer)
    other_packed, other_state = quantize((96, 128), dtype=torch.bfloat16, device=device, seed=32)
    if change == "requantized in place":
        packed.copy_(other_packed)
        for mine, theirs in ((state.absmax, other_state.absmax), (state.state2.absmax, other_state.state2.absmax),
                             (state.offset, other_state.offset)):
            mine.copy_(theirs)
        expected = expected_values(other_packed, other_state)
    elif change == "swapped":
        layer.weight.data = other_packed
        layer.weight.quant_state = other_state
        expected = expected_values(other_packed, other_state)
    elif change == "moved":  # what Params4bit.to does: new tensors bound to the same state object
        layer.weight.data = packed.clone()
        state.absmax, state.offset = state.absmax.clone(), state.offset.clone()
        state.state2.absmax, state.state2.code = state.state2.absmax.clone(), state.state2.code.clone()
        expected = expected_values(packed, state)
    else:
        del packed
        layer.weight.data = torch.empty(0, dtype=torch.uint8, device=device)
        gc.collect()
        layer.weight.data = other_packed  # perhaps in the freed memory
        expected = expected_values(other_packed, state)
    assert_bit_exact(call(layer), expected)


def test_plan_follows_packed_bytes_that_move(device, monkeypatch):
    """FSDP gathers a weight's bytes into new memory every step: the plan launches on them where
    they are now, as long as their 16-byte alignment (which the kernel was compiled for) holds."""
    packed, state = quantize((128, 256), device=device, seed=33)
    planned(packed, state)
    moved = packed.clone()
    assert moved.data_ptr() != packed.data_ptr() and moved.data_ptr() % 16 == packed.data_ptr() % 16
    with monkeypatch.context() as patch:
        patch.setattr(kernel, "validate_and_dequantize", lambda *args, **kwargs: pytest.fail("the plan was not used"))
        assert_bit_exact(kernel.dequantize_nf4(moved, state), expected_values(packed, state))
        moved.copy_(quantize((128, 256), device=device, seed=34)[0])
        assert_bit_exact(kernel.dequantize_nf4(moved, state), expected_values(moved, state))
    misaligned = offset_copy(packed, 4)  # word-aligned, not 16-byte aligned: validated again
    assert_bit_exact(kernel.dequantize_nf4(misaligned, state), expected_values(packed, state))


@pytest.mark.parametrize("shape", [(96, 64), (64, 64)], ids=["96x64", "square"])
def test_plan_follows_the_packed_orientation(shape, device):
    """A packed weight of shape[0] == 1 comes back transposed (bitsandbytes' rule for its weight.t()):
    a plan made for the (n, 1) tensor does not serve its (1, n) view, nor the reverse."""
    packed, state = quantize(shape, device=device, seed=47)
    flipped = packed.t()
    for first, second in ((packed, flipped), (flipped, packed)):
        planned(first, state)
        assert_bit_exact(kernel.dequantize_nf4(second, state), expected_values(second, state))


@pytest.mark.parametrize("kept_bytes", [1024, 0])
def test_plan_does_not_read_past_a_shrunk_storage(kept_bytes, device):
    """The packed weight's storage resized smaller under it (FSDP frees a flat parameter with
    resize_(0)): the call is refused, not served past the allocation; grown back and refilled, the
    weight is served again."""
    packed, state = quantize((96, 64), device=device, seed=48)
    saved = packed.clone()
    planned(packed, state)
    storage = packed.untyped_storage()
    storage.resize_(kept_bytes)
    with pytest.raises(ValueError, match=f"spans 3072 bytes but its storage holds {kept_bytes} from where it starts"):
        kernel.dequantize_nf4(packed, state)
    storage.resize_(saved.nbytes)
    packed.copy_(saved)
    assert_bit_exact(kernel.dequantize_nf4(packed, state), expected_values(saved, state))


# ---- state changes after a plan was made -------------------------------------------------------
def _changed_after_plan(change, device):
    """A weight whose plan exists, then one field of its state rebound (or, for "blocksize-shape",
    another weight and state); returns (packed, state, what the call must now return)."""
    packed, state = quantize((256, 320), device=device, seed=15)
    planned(packed, state)
    other_packed, other = quantize((256, 320), device=device, seed=16)
    if change == "absmax":
        state.absmax = other.absmax
    elif change == "code":
        state.code = state.code.flip(0)
    elif change == "offset":
        state.offset = state.offset + 0.25
    elif change == "state2":
        state.state2, state.offset = other.state2, other.offset
    elif change == "state2-absmax":
        state.state2.absmax = other.state2.absmax * 2
    elif change == "state2-code":
        state.state2.code = state.state2.code.flip(0)
    elif change == "dtype":
        state.dtype = torch.float32
    elif change == "shape":
        state.shape = torch.Size((320, 256))
    elif change == "quant_type":  # the table rewritten in place to FP4's (same object), the type flipped
        state.code.copy_(quantize((256, 320), quant_type="fp4", device=device, seed=16)[1].code)
        state.quant_type = "fp4"
    else:
        packed, state = quantize((320, 256), blocksize=128, device=device, seed=17)
    # bitsandbytes decodes NF4 with its built-in table; the format (and this kernel) read the state's.
    expected = dequantize_reference(packed, state) if change == "code" else expected_values(packed, state)
    return packed, state, expected


STATE_CHANGES = ["absmax", "code", "offset", "state2", "state2-absmax", "state2-code", "dtype", "shape",
                 "quant_type"]
INVALIDATING_CHANGES = ["blocksize", "state2-blocksize", "nested"]


@pytest.mark.parametrize("change", STATE_CHANGES + ["blocksize-shape"])
def test_plan_after_state_changes(change, device):
    """Every field a plan relies on, rebound after the plan was made: the next call sees it."""
    packed, state, expected = _changed_after_plan(change, device)
    assert_bit_exact(kernel.dequantize_nf4(packed, state), expected)


# The same tensor object, its storage replaced: `.data =` and `set_` keep the Python object.
TABLES = {
    "absmax": lambda state: state.absmax,
    "code": lambda state: state.code,
    "offset": lambda state: state.offset,
    "state2.absmax": lambda state: state.state2.absmax,
    "state2.code": lambda state: state.state2.code,
}
STORAGE_CHANGES = {
    "data": lambda tensor, new: setattr(tensor, "data", new),
    "set_": lambda tensor, new: tensor.set_(new),
}


def replacement(name, tensor):
    """Other values for a table, same dtype and size: FP4's table for the code, a flipped absmax
    code table, the absmax bytes reversed, the scales doubled and moved."""
    if name == "code":
        return torch.tensor([0.0, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.33, 0.0, -0.005, -0.01, -0.02, -0.04,
                             -0.08, -0.16, -0.33], device=tensor.device)
    if name == "state2.code" or tensor.dtype == torch.uint8:
        return tensor.flip(0)
    return tensor * 2 + 1e-3


@pytest.mark.parametrize("storage_change", STORAGE_CHANGES)
@pytest.mark.parametrize("table", TABLES)
def test_plan_after_a_table_storage_changes(table, storage_change, device):
    packed, state = quantize((256, 320), device=device, seed=40)
    planned(packed, state)
    tensor = TABLES[table](state)
    STORAGE_CHANGES[storage_change](tensor, replacement(table, tensor))
    assert TABLES[table](state) is tensor  # the same object, other memory
    assert_bit_exact(kernel.dequantize_nf4(packed, state), dequantize_reference(packed, state))


@pytest.mark.parametrize("change, message", [
    (lambda state: setattr(state.absmax, "data", state.absmax.float()), "absmax must be torch.uint8"),
    (lambda state: state.state2.absmax.resize_(0), "state2.absmax has 0 elements"),
    (lambda state: state.code.resize_(8), "code has 8 elements"),
], ids=["absmax-as-float", "absmax2-resized-to-0", "code-resized-to-8"])
def test_plan_does_not_hide_a_table_made_invalid(change, message, device):
    packed, state = quantize((256, 320), device=device, seed=41)
    planned(packed, state)
    change(state)
    with pytest.raises(ValueError, match=message):
        kernel.dequantize_nf4(packed, state)


def _invalidated_after_plan(change, device):
    packed, state = quantize((256, 320), device=device, seed=21)
    planned(packed, state)
    if change == "blocksize":
        state.blocksize = 32  # twice the blocks the absmax holds
    elif change == "state2-blocksize":
        state.state2.blocksize = 128  # twice the blocks state2's absmax holds
    else:
        state.nested = False  # a uint8 absmax read as fp32 scales
    return packed, state


@pytest.mark.parametrize("change", INVALIDATING_CHANGES)
def test_plan_does_not_hide_an_invalid_state(change, device):
    """A change that makes the state unusable for the packed weight raises after a plan exists,
    as it would without one."""
    packed, state = _invalidated_after_plan(change, device)
    with pytest.raises(ValueError, match="absmax"):
        kernel.dequantize_nf4(packed, state)


def state_identity_only(self, packed, qs):
    """Known-bad: the same state object, nothing else."""
    return self.state_ref() is qs


def scalars_only(self, packed, qs):
    """Known-bad (the rule before table addresses were recorded, where the table objects were the
    same): the state and its scalars, nothing about the memory its tables read."""
    return self.state_ref() is qs and (qs.dtype, qs.shape, qs.blocksize, qs.quant_type, qs.nested) == self.state.facts[5:10]


@pytest.mark.parametrize("change", STATE_CHANGES + INVALIDATING_CHANGES + ["table-storage"])
def test_known_bad_plan_checks_are_caught(change, device, monkeypatch):
    """Known-bad: a plan that checks who it holds, not what it reads, serves a stale result (or
    no error) for every change above, so each of those tests can fail."""
    if change == "table-storage":
        monkeypatch.setattr(quantstate.WeightPlan, "matches", scalars_only)
        packed, state = quantize((256, 320), device=device, seed=40)
        planned(packed, state)
        state.absmax.data = state.absmax.flip(0)
        assert not bit_exact(kernel.dequantize_nf4(packed, state), dequantize_reference(packed, state))
        return
    monkeypatch.setattr(quantstate.WeightPlan, "matches", state_identity_only)
    if change in INVALIDATING_CHANGES:
        packed, state = _invalidated_after_plan(change, device)
        kernel.dequantize_nf4(packed, state)  # no error: the stale plan answered
    else:
        packed, state, expected = _changed_after_plan(change, device)
        assert not bit_exact(kernel.dequantize_nf4(packed, state), expected)


def test_plan_on_the_weights_device_only(device):
    """A packed tensor with the recorded address, dtype and size on another device is not the
    planned weight (the plan would launch on the wrong device)."""
    packed, state = quantize((64, 64), device=device, seed=42)
    planned(packed, state)
    plan = plan_of(state)

    alignment, shape, nbytes, _, device_number = plan.state.facts[:5]

    class Elsewhere:
        """The planned weight's address, shape and size, on another device."""

        is_contiguous = staticmethod(lambda: True)
        data_ptr = staticmethod(lambda: 16 * 4096 + alignment)
        storage_offset = staticmethod(lambda: packed.storage_offset())
        element_size = staticmethod(lambda: packed.element_size())
        get_device = staticmethod(lambda: device_number + 1)
        untyped_storage = staticmethod(lambda: packed.untyped_storage())

    Elsewhere.shape, Elsewhere.nbytes = shape, nbytes

    assert plan.matches(packed, state)
    assert not plan.matches(Elsewhere(), state)


# ---- plan lifetime ---------------------------------------------------------------------------
def test_one_plan_per_state_when_a_weight_moves(device):
    """Moving a model rebinds the same state's tables to new tensors (Params4bit.to): the plan is
    replaced, never added to, and holds none of the tensors it was made with."""
    packed, state = quantize((128, 128), device=device, seed=43)
    planned(packed, state)
    plans_before = len(kernel.PLANS)
    old_tables = [weakref.ref(state.absmax), weakref.ref(state.state2.absmax)]
    for _ in range(5):
        packed = packed.clone()
        state.absmax, state.state2.absmax = state.absmax.clone(), state.state2.absmax.clone()
        assert_bit_exact(kernel.dequantize_nf4(packed, state), expected_values(packed, state))
    assert len(kernel.PLANS) == plans_before
    gc.collect()
    assert all(ref() is None for ref in old_tables), "a plan kept a replaced table alive"


def test_plan_dropped_with_its_state(device):
    packed, state = quantize((64, 64), device=device, seed=18)
    planned(packed, state)
    key = id(state)
    assert key in kernel.PLANS
    del state
    gc.collect()
    assert key not in kernel.PLANS


def test_state_without_dict_gets_no_plan(device):
    """A quant state with __slots__ (no __dict__, no weakref) cannot be watched by a plan: every
    call takes the validating path, and a rebound field is served fresh."""
    packed, state = quantize((256, 320), device=device, seed=20)
    fields = ("absmax", "shape", "code", "dtype", "blocksize", "quant_type", "offset", "state2", "nested")
    slotted = type("SlottedState", (), {"__slots__": fields})()
    for name in fields:
        setattr(slotted, name, getattr(state, name))
    for _ in range(2):
        assert_bit_exact(kernel.dequantize_nf4(packed, slotted), expected_values(packed, state))
    assert plan_of(slotted) is None
    state.absmax = slotted.absmax = state.absmax.flip(0)
    assert_bit_exact(kernel.dequantize_nf4(packed, slotted), expected_values(packed, state))


def test_plan_with_float_offset(device):
    """An offset given as a Python float: the wrapper's tensor for it outlives every plan."""
    packed, state = quantize((256, 320), device=device, seed=19)
    state.offset = float(state.offset)
    expected = expected_values(packed, state)
    for _ in range(3):
        junk = [torch.randn(1024, device=device) for _ in range(8)]  # reuse freed blocks
        assert_bit_exact(kernel.dequantize_nf4(packed, state), expected)
        del junk
    offset_tensor = quantstate.offset_tensor(state, state.offset, packed.device)
    kernel.set_launch_config()  # drops every plan
    gc.collect()
    assert quantstate.offset_tensor(state, state.offset, packed.device) is offset_tensor
    state.offset += 0.5  # another value: another tensor, and the plan sees it
    assert_bit_exact(kernel.dequantize_nf4(packed, state), expected_values(packed, state))


def test_float_offsets_freed_with_their_states(device):
    """The tensor made for a float offset lives as long as its state: 20 states that came and went,
    each with its own float offset, leave none behind."""
    packed, state = quantize((64, 64), device=device, seed=46)
    offset_tensors = []
    for step in range(20):
        twin = copy.copy(state)
        twin.offset = float(state.offset) + step / 64
        assert_bit_exact(kernel.dequantize_nf4(packed, twin), expected_values(packed, twin))
        offset_tensors.append(weakref.ref(quantstate.offset_tensor(twin, twin.offset, packed.device)))
    del twin
    gc.collect()
    assert all(ref() is None for ref in offset_tensors)


def test_float_offset_one_tensor_for_two_threads(device, monkeypatch):
    """Two threads making the first call on one state at once get one offset tensor (the plan kept
    last records its address, so a second tensor would be freed under it). The window between
    looking the state up and holding its tensor is widened to 0.2 s."""
    _, state = quantize((64, 64), device=device, seed=49)

    def slow_ref(*args):
        time.sleep(0.2)
        return weakref.ref(*args)

    monkeypatch.setattr(quantstate, "weakref", types.SimpleNamespace(ref=slow_ref))
    tensors = [None, None]

    def work(i):
        tensors[i] = quantstate.offset_tensor(state, 0.25, torch.device(device))

    assert not failures_in_threads(work, 2)
    assert tensors[0] is tensors[1]


def test_float_offset_inside_torch_compile(device):
    """A float offset in a compiled graph, fullgraph: the graph makes its tensor (no lock traced)."""
    packed, state = quantize((64, 128), dtype=torch.bfloat16, device=device, seed=50)
    state.offset = float(state.offset)
    torch._dynamo.reset()
    compiled = torch.compile(lambda weight: kernel.dequantize_nf4(weight, state), fullgraph=True)
    assert_bit_exact(compiled(packed), expected_values(packed, state))


def test_same_state_for_two_packed_tensors(device):
    """One state used with two packed tensors (two copies of a weight): each call exact."""
    packed, state = quantize((64, 128), device=device, seed=44)
    copy_ = packed.clone()
    expected = expected_values(packed, state)
    for _ in range(3):
        assert_bit_exact(kernel.dequantize_nf4(packed, state), expected)
        assert_bit_exact(kernel.dequantize_nf4(copy_, state), expected)


def test_interpreter_threads_of_different_shapes():
    """Triton's interpreter keeps its grid process-wide: concurrent CPU calls must not mix."""
    if not kernel.INTERPRET:
        pytest.skip("the interpreter runs on the CPU only")
    weights = [quantize((32 + 32 * i, 128 + 64 * (i % 3)), dtype=torch.float16, seed=50 + i) for i in range(8)]
    expected = [expected_values(*weight) for weight in weights]

    def work(i):
        for call in range(4):
            got = kernel.dequantize_nf4(*weights[i]) if call % 2 else kernel.validate_and_dequantize(*weights[i])
            if not bit_exact(got, expected[i]):
                return "wrong values"

    assert not failures_in_threads(work, 8)


def test_deepcopied_state_gets_its_own_plan(device):
    packed, state = quantize((64, 64), device=device, seed=45)
    planned(packed, state)
    twin = copy.deepcopy(state)
    twin.absmax = twin.absmax.flip(0)
    assert_bit_exact(kernel.dequantize_nf4(packed, twin), expected_values(packed, twin))
    assert_bit_exact(kernel.dequantize_nf4(packed, state), expected_values(packed, state))


# One fresh Python for what only a new process shows: importing kernel sets no environment variable,
# NF4_TRITON_PLANS=0 (read at import) turns the plans off, and a plan's weakref callback may run after
# the modules' globals are gone at exit. Each step prints a line the tests below look for.
FRESH_PROCESS = """
import os, sys
sys.path[:0] = sys.argv[1:3]
before = dict(os.environ)
import torch
from nf4_triton import kernel
from nf4_triton import fastpath
from helpers import expected_values, quantize
changed = set(os.environ.items()) ^ set(before.items())
print("environment unchanged by import" if not changed else f"environment changed: {changed}")
print("interpreter" if kernel.INTERPRET else "compiled")
device = sys.argv[3]
packed, state = quantize((33, 130), dtype=torch.bfloat16, device=device)
outs = [kernel.dequantize_nf4(packed, state) for _ in range(3)]
if all(torch.equal(out.view(torch.int16), expected_values(packed, state).view(torch.int16)) for out in outs):
    print("exact with plans off")
if not fastpath.ENABLED and not kernel.PLANS:
    print("no plan kept")
# A kept plan and one that is not, held by the module itself: their state dies while the module's
# globals are being cleared.
packed, state = quantize((64, 64), device=device)
kept = kernel.build_plan(packed, state)
fastpath.ENABLED = True  # plans on again, for one kept plan
kernel.PLANS.keep(kept)
kernel._held_until_exit = (packed, state, kept, kernel.build_plan(packed, state))
print("holding plans until exit")
"""


@pytest.fixture(scope="module")
def fresh_process(device):
    """The finished FRESH_PROCESS, started with NF4_TRITON_PLANS=0 and no TRITON_INTERPRET."""
    tests = os.path.dirname(os.path.abspath(__file__))
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-c", FRESH_PROCESS, os.path.dirname(tests), tests, device],
                          env=dict(env, NF4_TRITON_PLANS="0"), capture_output=True, text=True, timeout=300)


def test_import_leaves_the_environment_alone(fresh_process):
    """Importing kernel sets no environment variable: without a GPU the interpreter is chosen for its
    kernels alone, and other Triton code in the process is left as the user configured it."""
    lines = fresh_process.stdout.splitlines()
    assert "environment unchanged by import" in lines, fresh_process.stdout + fresh_process.stderr[-3000:]
    assert ("compiled" if torch.cuda.is_available() else "interpreter") in lines


def test_plans_switched_off(fresh_process):
    """NF4_TRITON_PLANS=0: every call validates and launches through Triton; no plan is kept."""
    lines = fresh_process.stdout.splitlines()
    assert "exact with plans off" in lines and "no plan kept" in lines, fresh_process.stderr[-3000:]


def test_plans_alive_at_interpreter_exit(fresh_process):
    """A plan's weakref callback may run after the module's globals are gone: no error at exit."""
    assert "holding plans until exit" in fresh_process.stdout.splitlines(), fresh_process.stderr[-3000:]
    assert fresh_process.returncode == 0, fresh_process.stderr[-3000:]
    assert "Exception ignored" not in fresh_process.stderr, fresh_process.stderr[-3000:]
