"""The launch layer: how the project's Triton kernels run and how a validated launch is replayed.
It knows Triton and torch, and nothing of any weight format.

Where kernels run: on CUDA tensors, compiled by Triton; without CUDA, on CPU tensors through
Triton's interpreter (``INTERPRET``, ``jit``), chosen for the project's kernels alone.

Contract of the launch plans
----------------------------
What a plan does. A kernel module's validating call leaves a plan in that module's ``PlanCache``,
keyed by ``id`` of the object the plan watches (a quant state) and dropped when that object dies.
A later call that the plan ``matches`` (a subclass's rule: nothing the launch reads has changed)
allocates the output and launches the compiled kernel directly, skipping validation and Triton's
argument binding. The address of the call's first input is taken at launch, so bytes gathered
into new memory every step (FSDP) stay on their plan. A plan holds no tensor. A call the plan does
not match takes the validating path, which replaces the plan.

What it relies on. In Triton: a compiled kernel's ``run``, ``function`` and ``packed_metadata``;
the launcher's C ``launch`` and its forwarding call, replayed with a stand-in ``self`` to record
what it forwards (``kernel_launcher``); the launch hooks of Triton 3.3 (``CompiledKernel``
attributes) and of 3.4 on (``triton.knobs.runtime``); the interpreter's ``InterpretedFunction``.
In torch: ``torch._C._cuda_getDevice``, ``_cuda_setDevice`` and ``_cuda_getCurrentRawStream``, and
Inductor's allocation entry ``torch._C._dynamo.guards._empty_strided_cuda`` (``torch.empty_strided``
where it is missing).

Where it ran. On an H100 under Triton 3.3.1, 3.4.0, 3.5.1, 3.6.0, 3.7.1, 3.8.0 and 3.9.0 with
torch 2.11 (README, Triton versions); FSDP1 on two H200s, FSDP1 and FSDP2 on two H100s.

How it falls back. A launcher whose call is not one plain forwarding call (scratch buffers made
per call, an unknown shape) keeps Triton's own launcher; no plan watches an object without
weakrefs, nor is made while launch hooks are set. ``NF4_TRITON_PLANS=0`` in the environment, read
at import, turns plans off: none is kept, every call validates and launches through Triton.
"""

import ctypes
import os
import threading
import weakref

import torch
import triton

__all__ = ["INTERPRET", "ENABLED", "jit", "sum_combine", "interpret", "device_facts", "peak_dram_gbps", "FAST_DRAM_GBPS",
           "table_for",
           "empty_cuda", "launch_hooks_active", "kernel_launcher", "interpreter_launcher", "run", "can_watch", "LaunchPlan",
           "PlanCache"]

# Without CUDA, CPU tensors through Triton's interpreter, chosen here for the project's kernels
# alone: TRITON_INTERPRET is read, never set, so other Triton code in the process is left as the
# user configured it (TRITON_INTERPRET=1 or 0 still forces either).
_INTERPRET_ENV = os.environ.get("TRITON_INTERPRET")
INTERPRET = (_INTERPRET_ENV not in ("", "0")) if _INTERPRET_ENV is not None else not torch.cuda.is_available()
ENABLED = os.environ.get("NF4_TRITON_PLANS", "1") != "0"


def jit(fn):
    """``triton.jit``, or Triton's interpreter for ``fn`` when INTERPRET."""
    if INTERPRET:
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(fn)
    return triton.jit(fn)


@jit
def sum_combine(a, b):
    """``a + b``, the combine of a ``tl.reduce`` sum: ``tl.sum`` is itself a jitted function, which the
    interpreter cannot call from a kernel it runs alone."""
    return a + b


# Triton's interpreter keeps the grid and the program index process-wide: one launch at a time.
_INTERPRETER_LOCK = threading.Lock()


def interpret(kernel, grid, args, options):
    """``kernel[grid](*args, **options)`` through Triton's interpreter (CPU tensors), one launch at a time."""
    with _INTERPRETER_LOCK:
        kernel[grid](*args, **options)


_DEVICE_FACTS = {}


def peak_dram_gbps(properties):
    """A device's peak DRAM bandwidth in GB/s from its properties (double data rate: two transfers a memory
    clock over the bus); 0 where this torch does not report them."""
    clock_khz = getattr(properties, "memory_clock_rate", 0)
    bus_bits = getattr(properties, "memory_bus_width", 0)
    return 2 * clock_khz * 1000 * (bus_bits // 8) // 10**9


def device_facts(device=None):
    """(compute capability, L2 bytes, peak DRAM GB/s) of a CUDA device (default: the current one);
    ((0, 0), 0, 0) without one."""
    if device is not None and device.index is not None:  # a call's own device: one lookup (every fused call)
        facts = _DEVICE_FACTS.get(device.index)
        if facts is not None:
            return facts
    if INTERPRET or not torch.cuda.is_available():
        return (0, 0), 0, 0
    index = torch.cuda.current_device() if device is None or device.index is None else device.index
    if index not in _DEVICE_FACTS:
        properties = torch.cuda.get_device_properties(index)
        _DEVICE_FACTS[index] = ((properties.major, properties.minor), properties.L2_cache_size,
                                peak_dram_gbps(properties))
    return _DEVICE_FACTS[index]


# The H200's DRAM peaks at 4814 GB/s (device_facts), the H100 SXM's datasheet at 3.35 TB/s: from this peak a GPU
# takes the launch tiers and matmul routes its capability keeps for fast DRAM (NOTES.md items 104, 105, 109).
FAST_DRAM_GBPS = 4400


def table_for(capability, dram_gbps, tables, fast_dram_tables, default):
    """A GPU's entry in a table by compute capability: ``fast_dram_tables``' where its DRAM peaks at
    ``FAST_DRAM_GBPS`` or more and that table names its capability, else ``tables``', else ``default``."""
    capability = tuple(capability)
    if dram_gbps >= FAST_DRAM_GBPS and capability in fast_dram_tables:
        return fast_dram_tables[capability]
    return tables.get(capability, default)


# Inductor's allocation entry: an empty CUDA tensor on the current device, past torch.empty's
# dispatcher (2.1 against 5.0 us per call on the H100 host, NOTES.md item 57).
try:
    from torch._C._dynamo.guards import _empty_strided_cuda as empty_cuda
except ImportError:
    def empty_cuda(size, strides, dtype):
        return torch.empty_strided(size, strides, dtype=dtype, device="cuda")


if hasattr(triton, "knobs"):  # Triton >= 3.4: the hooks are HookChain objects (or a function)
    _RUNTIME_KNOBS = triton.knobs.runtime

    def launch_hooks_active():
        """Whether a profiler set Triton launch hooks (they need Triton's own launch path)."""
        enter, exit_ = _RUNTIME_KNOBS.launch_enter_hook, _RUNTIME_KNOBS.launch_exit_hook
        return bool(getattr(enter, "calls", enter)) or bool(getattr(exit_, "calls", exit_))
else:  # Triton 3.3: plain attributes of CompiledKernel, None when unset
    def launch_hooks_active():
        """Whether a profiler set Triton launch hooks (they need Triton's own launch path)."""
        compiled_kernel = triton.compiler.CompiledKernel
        return compiled_kernel.launch_enter_hook is not None or compiled_kernel.launch_exit_hook is not None


# --------------------------------------------------------------------------------------------
# Launching again: f(stream, *pointers)
# --------------------------------------------------------------------------------------------
class _LaunchRecorder:
    """Stands in for a Triton launcher while the launcher's own ``__call__`` runs: records what it
    passes to its C launch function instead of launching (the launcher itself, shared by every
    launch of its kernel, is left untouched)."""

    def __init__(self, launcher):
        self._launcher = launcher
        self._forwarded = []

    def __getattr__(self, name):
        return getattr(self._launcher, name)

    def launch(self, *args):
        self._forwarded.append(args)


def _direct_launch(run, grid, function, metadata, args, stream):
    """(C launch function, the extra arguments the launcher forwards, whether the kernel's
    arguments go as one tuple), or None unless two recordings show one forwarding call each, with
    the same extras both times (no buffer made per call). ``grid``: (x, y, z)."""
    launch = getattr(run, "launch", None)
    if not callable(launch) or any(getattr(run, name, 0) for name in
                                   ("global_scratch_size", "profile_scratch_size", "gsan_enabled")):
        return None
    extras = []
    for _ in range(2):
        recorder = _LaunchRecorder(run)
        try:
            type(run).__call__(recorder, *grid, stream, function, metadata, None, None, None, *args)
        except Exception:  # a launcher this recording does not understand: keep Triton's
            return None
        if len(recorder._forwarded) != 1:
            return None
        forwarded = recorder._forwarded[0]
        if forwarded[:5] != (*grid, stream, function):
            return None
        as_tuple = type(forwarded[-1]) is tuple and forwarded[-1] == args
        if not as_tuple and forwarded[-len(args):] != args:  # args is never empty (out_ptr)
            return None
        extras.append(forwarded[5:-1] if as_tuple else forwarded[5:-len(args)])
    first, second = extras
    if len(first) != len(second) or not all(a is b or (type(a) in (bool, int, float, str) and a == b)
                                            for a, b in zip(first, second)):
        return None
    return launch, first, as_tuple


def _splicer(args, varying):
    """f(*pointers): ``args`` with the pointers at positions ``varying`` (three, the first 0)."""
    first_at, second_at, third_at = varying
    assert first_at == 0 < second_at < third_at, varying
    head, middle, tail = args[1:second_at], args[second_at + 1:third_at], args[third_at + 1:]
    return lambda first, second, third: (first, *head, second, *middle, third, *tail)


def kernel_launcher(compiled, grid, args, varying, stream):
    """f(stream, *pointers): launches ``compiled`` on ``grid`` (programs along x, or an (x, y, z) tuple)
    with ``args`` (integers: the kernel's arguments, then its constexprs), those at positions ``varying``
    (two or three, ascending, the first 0) replaced by the pointers a call passes; through Triton's C
    launch function directly where that is safe.

    Triton's Python launcher (``compiled.run``) prepares scratch buffers per call and then calls
    its C launch function; with no scratch buffers its call is a plain forwarding call, so the
    arguments it forwards are recorded here and passed straight on (NOTES.md, item 33). Any other
    shape of call keeps Triton's launcher. ``stream`` and ``args`` are those of a launch just made:
    the recording runs the launcher's Python with them, so a launcher that launched by some other
    route would only repeat that launch."""
    run, function, metadata = compiled.run, compiled.function, compiled.packed_metadata
    gx, gy, gz = (grid, 1, 1) if isinstance(grid, int) else (*grid, 1, 1)[:3]
    args = tuple(args)
    direct = _direct_launch(run, (gx, gy, gz), function, metadata, args, stream)
    if len(varying) == 3:  # a third pointer (the split-K partial sums): the arguments spliced per call
        splice = _splicer(args, varying)
        if direct is None:
            return lambda stream, *pointers: run(gx, gy, gz, stream, function, metadata, None, None, None,
                                                 *splice(*pointers))
        launch, extras, as_tuple = direct
        if as_tuple:
            return lambda stream, *pointers: launch(gx, gy, gz, stream, function, *extras, splice(*pointers))
        return lambda stream, *pointers: launch(gx, gy, gz, stream, function, *extras, *splice(*pointers))
    first_at, out_at = varying  # the launch plans' (input, output): the fewest host operations a call
    assert first_at == 0, varying
    head, tail = args[1:out_at], args[out_at + 1:]
    if direct is None:
        def via_triton(stream, input_ptr, out_ptr):
            run(gx, gy, gz, stream, function, metadata, None, None, None, input_ptr, *head, out_ptr, *tail)

        return via_triton
    launch, extras, as_tuple = direct
    if as_tuple:  # Triton 3.7 to 3.9: the kernel's arguments as one tuple
        def direct_as_tuple(stream, input_ptr, out_ptr):
            launch(gx, gy, gz, stream, function, *extras, (input_ptr, *head, out_ptr, *tail))

        return direct_as_tuple

    def direct(stream, input_ptr, out_ptr):  # Triton 3.3 to 3.6: the kernel's arguments spread out
        launch(gx, gy, gz, stream, function, *extras, input_ptr, *head, out_ptr, *tail)

    return direct


def _at_address(address, dtype, numel):
    """A CPU tensor over ``numel`` elements of ``dtype`` at ``address``."""
    memory = (ctypes.c_char * (numel * dtype.itemsize)).from_address(address)
    return torch.frombuffer(memory, dtype=dtype, count=numel)


def interpreter_launcher(kernel, grid, args, varying, options):
    """f(stream, *pointers) for CPU tensors, like ``kernel_launcher`` on the GPU: the interpreter's
    ``kernel`` over the addresses of ``args`` recorded now (wrapped as tensors again, as the GPU's
    launch passes them), those at positions ``varying`` replaced by the pointers a call passes."""
    recorded = [(arg.data_ptr(), arg.dtype, arg.numel()) if isinstance(arg, torch.Tensor) else None for arg in args]
    values = [None if place else arg for arg, place in zip(args, recorded)]

    def launch_kernel(stream, *pointers):
        addresses = dict(zip(varying, pointers))
        interpret(kernel, grid, [value if place is None else _at_address(addresses.get(at, place[0]), *place[1:])
                                 for at, (value, place) in enumerate(zip(values, recorded))], options)

    return launch_kernel


def run(kernel, grid, args, options, varying=None):
    """``kernel[grid](*args, **options)`` on the current CUDA device, whose current stream the first argument's
    device names (the interpreter on CPU tensors, one launch at a time). With
    ``varying`` (positions in ``args``, as ``kernel_launcher`` takes them), returns f(stream, *pointers) that
    launches the same again with other pointers there and every other argument as now."""
    if INTERPRET:
        interpret(kernel, grid, args, options)
        return None if varying is None else interpreter_launcher(kernel, grid, args, varying, options)
    compiled = kernel[grid](*args, **options)
    if varying is None:
        return None
    values = tuple(arg.data_ptr() if isinstance(arg, torch.Tensor) else arg for arg in args)
    constexprs = tuple(options[name] for name in kernel.arg_names[len(args):])
    stream = torch._C._cuda_getCurrentRawStream(args[0].device.index)
    return kernel_launcher(compiled, grid, values + constexprs, varying, stream)


# --------------------------------------------------------------------------------------------
# Launch plans
# --------------------------------------------------------------------------------------------
def can_watch(watched):
    """Whether a plan can watch this object now: it takes weakrefs, and no profiler set launch hooks."""
    return hasattr(type(watched), "__weakref__") and not launch_hooks_active()


class LaunchPlan:
    """One validated launch, replayed into a new output while the subclass's ``matches(first,
    watched)`` holds for a call's first input and watched object."""

    __slots__ = ("key", "state_ref", "device", "device_index", "dtype", "size", "strides", "transpose",
                 "launch_kernel", "__weakref__")

    def __init__(self, cache, watched, out, transpose, launch_kernel):
        """``cache``: the PlanCache that drops this plan when ``watched`` dies; ``out``: the validated
        call's (contiguous) output, whose shape, dtype and device each launch allocates, returned
        transposed where ``transpose``; ``launch_kernel(stream, input_ptr, out_ptr)`` launches the
        validated call's kernel again."""
        self.key = id(watched)
        # The callback is bound now: at interpreter exit an object may die after the modules' globals.
        self.state_ref = weakref.ref(watched, lambda _, key=self.key, plan=weakref.ref(self), drop=cache.drop:  # noqa: B008
                                     drop(key, plan))
        self.device, self.device_index = out.device, out.device.index
        self.dtype, self.size, self.strides = out.dtype, tuple(out.shape), out.stride()
        self.transpose, self.launch_kernel = transpose, launch_kernel

    def launch(self, first):
        """The launch's result for ``first`` (where ``matches`` accepted it), in a new tensor."""
        index, input_ptr = self.device_index, first.data_ptr()
        if index is None:  # CPU tensors: the interpreter
            out = torch.empty(size=self.size, dtype=self.dtype, device=self.device)
            self.launch_kernel(0, input_ptr, out.data_ptr())
        elif torch._C._cuda_getDevice() == index:
            out = empty_cuda(self.size, self.strides, self.dtype)
            self.launch_kernel(torch._C._cuda_getCurrentRawStream(index), input_ptr, out.data_ptr())
        else:  # Triton launches, and the allocator allocates, on the current device
            current = torch._C._cuda_getDevice()
            torch._C._cuda_setDevice(index)
            try:
                out = empty_cuda(self.size, self.strides, self.dtype)
                self.launch_kernel(torch._C._cuda_getCurrentRawStream(index), input_ptr, out.data_ptr())
            finally:
                torch._C._cuda_setDevice(current)
        return out.t() if self.transpose else out


class PlanCache(dict):
    """One kernel module's plans, by ``id`` of the object each watches. Its module keeps and clears
    them; others read. Under ``NF4_TRITON_PLANS=0`` none is kept."""

    def __init__(self):
        super().__init__()
        self.kept = 0  # plans kept since import: the validating calls that left one

    def serve(self, first, watched):
        """The result of the plan for ``watched`` where it matches this call, else None."""
        plan = self.get(id(watched))
        return plan.launch(first) if plan is not None and plan.matches(first, watched) else None

    def keep(self, plan):
        """Serve later calls for the plan's watched object from it."""
        if ENABLED:
            self[plan.key] = plan
            self.kept += 1

    def drop(self, key, plan_ref):
        """A watched object died: forget its plan, unless a newer object already took the key."""
        plan = self.get(key)
        if plan is not None and plan is plan_ref():
            del self[key]

    def stats(self):
        """{"live": plans alive now, "kept": plans kept since import (one per validating call that left one)}."""
        return {"live": len(self), "kept": self.kept}
