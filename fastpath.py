"""Launch plans: the per-call fast path of ``kernel.dequantize_nf4``.

Contract
--------
What it does. A validated call leaves a plan keyed by ``id(quant_state)``, one per state. The next
call with that state checks that nothing the launch reads has changed, allocates the output and
launches the compiled kernel directly, skipping validation and Triton's argument binding. Each call
checks: the state is the same object; every table (absmax, code, state2's absmax and code, the
offset) has the address, dtype and size recorded, so a table rebound, ``.data`` replaced, ``set_``
or ``resize_`` all show; the packed weight has the shape (a leading 1 transposes the result), byte
count, 16-byte alignment, storage offset, contiguity and device recorded, and its storage still
holds its bytes (FSDP frees a flat parameter with ``resize_(0)`` under its views); its address is
taken at launch, so a weight FSDP gathers into new memory every step stays on its plan; the state's
scalars are equal; no profiler has set Triton launch hooks.
Anything else returns to the validating path, which replaces the plan. The kernel reads the bytes
on every call, so a weight re-quantized in place is served fresh. A plan holds no tensor (its
state holds the tables it checks) and is dropped when its state dies.

What it relies on. In Triton: a compiled kernel's ``run``, ``function`` and ``packed_metadata``;
the launcher's C ``launch`` and its forwarding call, replayed with a stand-in ``self`` to record
what it forwards (``kernel_launcher``); the launch hooks of Triton 3.3 (``CompiledKernel``
attributes) and of 3.4 on (``triton.knobs.runtime``). In torch: ``torch._C._cuda_getDevice``,
``_cuda_setDevice`` and ``_cuda_getCurrentRawStream``, and Inductor's allocation entry
``torch._C._dynamo.guards._empty_strided_cuda`` (``torch.empty_strided`` where it is missing).

Where it ran. On an H100 under Triton 3.3.1, 3.4.0, 3.5.1, 3.6.0, 3.7.1, 3.8.0 and 3.9.0 with
torch 2.11 (README, Triton versions); FSDP1 on two H200s.

How it falls back. A launcher whose call is not one plain forwarding call (scratch buffers made
per call, an unknown shape) keeps Triton's own launcher; a plan is not made while launch hooks are
set. ``NF4_TRITON_PLANS=0`` in the environment, read at import, turns plans off: every call
validates and launches through Triton.
"""

import os
import weakref

import torch
import triton

__all__ = ["ENABLED", "PLANS", "LaunchPlan", "kernel_launcher", "launch_hooks_active", "stats"]

ENABLED = os.environ.get("NF4_TRITON_PLANS", "1") != "0"
PLANS = {}  # id(quant_state) -> LaunchPlan
_kept = 0  # plans kept since import: the validating calls that left one

# Inductor's allocation entry: an empty CUDA tensor on the current device, past torch.empty's
# dispatcher (2.1 against 5.0 us per call on the H100 host, NOTES.md item 57).
try:
    from torch._C._dynamo.guards import _empty_strided_cuda as _empty_cuda
except ImportError:
    def _empty_cuda(size, strides, dtype):
        return torch.empty_strided(size, strides, dtype=dtype, device="cuda")


def stats():
    """{"live": plans alive now, "kept": plans kept since import (one per validating call that left one)}."""
    return {"live": len(PLANS), "kept": _kept}


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


def _drop_plan(plans, key, plan_ref):
    """A state died: forget its plan, unless a newer state already took the key."""
    plan = plans.get(key)
    if plan is not None and plan is plan_ref():
        del plans[key]


class LaunchPlan:
    """One validated launch, replayed for the same quant state while nothing it reads has changed."""

    __slots__ = ("key", "state_ref", "device", "device_index", "dtype", "size", "strides", "facts", "nested",
                 "nested_facts", "offset", "storage_bytes", "transpose", "launch_kernel", "__weakref__")

    def __init__(self, packed, qs, shape, blocksize, blocksize2, nested, transpose, tables, launch_kernel):
        """``tables``: (absmax, code, absmax2, code2, offset) as launched; ``launch_kernel(stream,
        packed_ptr, out_ptr)`` launches the validated call's kernel again."""
        self.key = id(qs)
        # The callback's globals are bound now: at interpreter exit a state may die after this
        # module's globals are gone.
        self.state_ref = weakref.ref(qs, lambda _, key=self.key, plan=weakref.ref(self), drop=_drop_plan,  # noqa: B008
                                     plans=PLANS: drop(plans, key, plan))
        # The packed bytes may move: any address of the same 16-byte alignment, on which Triton
        # specialized the kernel and the word loads depend. Read as bytes, whatever dtype stores them.
        self.device, self.device_index = packed.device, packed.device.index
        self.dtype, self.nested = qs.dtype, nested
        self.size, self.strides = tuple(shape), torch.empty(shape, device="meta").stride()  # contiguous
        # What `matches` compares, in its order: the packed weight's alignment, shape (a leading 1
        # transposes the result), byte count, place in its storage, contiguity and device (-1: the
        # CPU); the state's fields; (address, dtype, size) of each table as launched.
        absmax, code, absmax2, code2, offset = tables
        self.facts = (packed.data_ptr() % 16, packed.shape, packed.nbytes, packed.storage_offset(), True,
                      packed.get_device(), qs.dtype, shape, blocksize, qs.quant_type, nested,
                      absmax.data_ptr(), absmax.dtype, absmax.numel(), code.data_ptr(), code.dtype, code.numel())
        self.nested_facts = ((blocksize2, absmax2.data_ptr(), absmax2.dtype, absmax2.numel(),
                              code2.data_ptr(), code2.dtype, code2.numel()) if nested else None)
        # An offset given as a float: its value; as a tensor: its (address, dtype, size).
        self.offset = ((offset.data_ptr(), offset.dtype, offset.numel()) if isinstance(qs.offset, torch.Tensor)
                       else qs.offset) if nested else None
        # The storage must still hold the bytes: FSDP frees a flat parameter with `resize_(0)` under
        # the views it hands out, and any storage can be resized smaller under a view.
        self.storage_bytes = packed.storage_offset() * packed.element_size() + packed.nbytes
        self.transpose, self.launch_kernel = transpose, launch_kernel

    def keep(self):
        """Serve later calls with this plan's state from it."""
        global _kept
        PLANS[self.key] = self
        _kept += 1

    def matches(self, packed, qs):
        """Whether this plan's launch is the validated call's for (packed, qs)."""
        try:
            absmax, code = qs.absmax, qs.code
            if (self.state_ref() is not qs
                    or (packed.data_ptr() % 16, packed.shape, packed.nbytes, packed.storage_offset(),
                        packed.is_contiguous(), packed.get_device(), qs.dtype, qs.shape, qs.blocksize,
                        qs.quant_type, qs.nested, absmax.data_ptr(), absmax.dtype, absmax.numel(),
                        code.data_ptr(), code.dtype, code.numel()) != self.facts
                    or packed.untyped_storage().nbytes() < self.storage_bytes
                    or (self.device_index is None and not packed.is_cpu)  # get_device() is -1 for meta too
                    or launch_hooks_active()):
                return False
            if not self.nested:
                return True
            state2, offset = qs.state2, qs.offset
            absmax2, code2 = state2.absmax, state2.code
            if (state2.blocksize, absmax2.data_ptr(), absmax2.dtype, absmax2.numel(),
                    code2.data_ptr(), code2.dtype, code2.numel()) != self.nested_facts:
                return False
            if isinstance(offset, torch.Tensor):
                return (offset.data_ptr(), offset.dtype, offset.numel()) == self.offset
            return offset == self.offset  # given as a number (a tuple recorded never equals one)
        except (AttributeError, RuntimeError):  # a field gone, or a tensor with no storage (sparse, meta)
            return False

    def launch(self, packed):
        """The dequantized weight of ``packed`` (the bytes ``matches`` accepted), in a new tensor."""
        index, packed_ptr = self.device_index, packed.data_ptr()
        if index is None:  # CPU tensors: the interpreter
            out = torch.empty(size=self.size, dtype=self.dtype, device=self.device)
            self.launch_kernel(0, packed_ptr, out.data_ptr())
        elif torch._C._cuda_getDevice() == index:
            out = _empty_cuda(self.size, self.strides, self.dtype)
            self.launch_kernel(torch._C._cuda_getCurrentRawStream(index), packed_ptr, out.data_ptr())
        else:  # Triton launches, and the allocator allocates, on the current device
            current = torch._C._cuda_getDevice()
            torch._C._cuda_setDevice(index)
            try:
                out = _empty_cuda(self.size, self.strides, self.dtype)
                self.launch_kernel(torch._C._cuda_getCurrentRawStream(index), packed_ptr, out.data_ptr())
            finally:
                torch._C._cuda_setDevice(current)
        return out.t() if self.transpose else out


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


def kernel_launcher(compiled, grid, head, tail, stream, packed_ptr, out_ptr):
    """f(stream, packed_ptr, out_ptr): launches ``compiled`` on ``grid`` with the arguments
    ``packed_ptr``, ``head``, ``out_ptr``, ``tail`` (integers), through Triton's C launch function
    directly where that is safe.

    Triton's Python launcher (``compiled.run``) prepares scratch buffers per call and then calls
    its C launch function; with no scratch buffers its call is a plain forwarding call, so the
    arguments it forwards are recorded here and passed straight on (NOTES.md, item 33). Any other
    shape of call keeps Triton's launcher. ``stream``, ``packed_ptr`` and ``out_ptr`` are those of a
    launch just made: the recording runs the launcher's Python with them, so a launcher that
    launched by some other route would only repeat that launch."""
    run, function, metadata = compiled.run, compiled.function, compiled.packed_metadata
    direct = _direct_launch(run, grid, function, metadata, (packed_ptr,) + head + (out_ptr,) + tail, stream)
    if direct is None:
        def via_triton(stream, packed_ptr, out_ptr):
            run(grid, 1, 1, stream, function, metadata, None, None, None, packed_ptr, *head, out_ptr, *tail)

        return via_triton
    launch, extras, as_tuple = direct
    if as_tuple:  # Triton 3.7 to 3.9: the kernel's arguments as one tuple
        def direct_as_tuple(stream, packed_ptr, out_ptr):
            launch(grid, 1, 1, stream, function, *extras, (packed_ptr, *head, out_ptr, *tail))

        return direct_as_tuple

    def direct(stream, packed_ptr, out_ptr):  # Triton 3.3 to 3.6: the kernel's arguments spread out
        launch(grid, 1, 1, stream, function, *extras, packed_ptr, *head, out_ptr, *tail)

    return direct


def _direct_launch(run, grid, function, metadata, args, stream):
    """(C launch function, the extra arguments the launcher forwards, whether the kernel's
    arguments go as one tuple), or None unless two recordings show one forwarding call each, with
    the same extras both times (no buffer made per call)."""
    launch = getattr(run, "launch", None)
    if not callable(launch) or any(getattr(run, name, 0) for name in
                                   ("global_scratch_size", "profile_scratch_size", "gsan_enabled")):
        return None
    extras = []
    for _ in range(2):
        recorder = _LaunchRecorder(run)
        try:
            type(run).__call__(recorder, grid, 1, 1, stream, function, metadata, None, None, None, *args)
        except Exception:  # a launcher this recording does not understand: keep Triton's
            return None
        if len(recorder._forwarded) != 1:
            return None
        forwarded = recorder._forwarded[0]
        if forwarded[:5] != (grid, 1, 1, stream, function):
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
