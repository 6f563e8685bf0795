"""The launch plans' direct launch (fastpath.kernel_launcher), on stand-in Triton launchers: pure
Python, so it runs on CPU. Whatever path it picks, the C launch function must receive exactly what
Triton's own launcher would have passed it for the same call."""

import pytest

from nf4_triton import fastpath


class Compiled:
    """The three attributes of a Triton CompiledKernel that a launch plan uses."""

    def __init__(self, run):
        self.run, self.function, self.packed_metadata = run, "function", ("metadata",)


class Launcher:
    """Triton 3.3 to 3.6: scratch buffers (none here), then the kernel's arguments spread out."""

    global_scratch_size = 0
    profile_scratch_size = 0

    def __init__(self):
        self.launched = []
        self.calls = 0
        self.launch = lambda *args: self.launched.append(args)  # an instance attribute, like Triton's

    def __call__(self, grid_x, grid_y, grid_z, stream, function, *args):
        self.calls += 1
        self.launch(grid_x, grid_y, grid_z, stream, function, False, False, self.scratch(), None, *args)

    def scratch(self):
        return None


class TupleLauncher(Launcher):
    """Triton 3.7 to 3.9: the hooks and fixed objects forwarded, the kernel's arguments as one tuple."""

    annotations = object()

    def __call__(self, grid_x, grid_y, grid_z, stream, function, kernel_metadata, launch_metadata, enter_hook,
                 exit_hook, *args):
        self.calls += 1
        self.launch(grid_x, grid_y, grid_z, stream, function, False, False, kernel_metadata, launch_metadata,
                    enter_hook, exit_hook, None, None, self.annotations, "signature", args)


class ScratchLauncher(Launcher):
    """A kernel that needs a global scratch buffer, allocated per call."""

    global_scratch_size = 128

    def scratch(self):
        return object()


class FreshObjectLauncher(Launcher):
    """Forwards an object made per call without declaring any scratch: replaying a recorded one
    would be wrong."""

    def scratch(self):
        return object()


class OtherPathLauncher(Launcher):
    """Launches through something other than its ``launch`` attribute (as Triton 3.9's tvm-ffi path)."""

    def __call__(self, grid_x, grid_y, grid_z, stream, function, *args):
        self.calls += 1
        self.launched.append(("other", grid_x, grid_y, grid_z, stream, *args))


class SelfCheckingLauncher(Launcher):
    """Refuses to run on anything but itself (a stand-in for launchers written in C)."""

    def __call__(self, *args):
        if type(self) is not SelfCheckingLauncher:
            raise TypeError("descriptor '__call__' requires a 'SelfCheckingLauncher' object")
        super().__call__(*args)


HEAD, TAIL = (11, 12, 13), (21, 22)
FIRST = (77, 1024, 4096)  # (stream, packed_ptr, out_ptr) of the launch the plan is built after
LATER = (78, 2048, 8192)  # a later call's: the packed bytes moved, another output


PARTIALS = (3072, 6144)  # a third pointer (split-K partial sums) in the first call and a later one


def arguments(pointers):
    """The kernel's arguments with the pointers of a call at their places: (packed_ptr, out_ptr[, partial_ptr])."""
    return (pointers[0], *HEAD, pointers[1], *TAIL[:1], *pointers[2:], *TAIL[1:])


def launched_by_triton(launcher_type, stream, *pointers, grid=(5, 1, 1)):
    """What the C launch function receives when Triton's launcher itself is called."""
    launcher = launcher_type()
    compiled = Compiled(launcher)
    launcher(*grid, stream, compiled.function, compiled.packed_metadata, None, None, None, *arguments(pointers))
    return launcher.launched


def launched_by_plan(launcher_type, grid=5, third=False):
    """The plan's launch function for a launcher, what the launcher launched while it was built,
    and what a later call through it launched, with the number of Triton launcher calls it took."""
    launcher = launcher_type()
    first, later = (FIRST + PARTIALS[:1], LATER + PARTIALS[1:]) if third else (FIRST, LATER)
    varying = (0, len(HEAD) + 1) + ((len(HEAD) + 3,) if third else ())
    launch = fastpath.kernel_launcher(Compiled(launcher), grid, arguments(first[1:]), varying, first[0])
    while_built = list(launcher.launched)
    launcher.launched.clear()
    calls_before = launcher.calls
    launch(*later)
    return launch.__name__, while_built, launcher.launched, launcher.calls - calls_before


def comparable(calls, fresh_objects):
    """Calls with the per-call scratch object (position 7) left out where the launcher makes one."""
    return [call[:7] + call[8:] for call in calls] if fresh_objects else calls


@pytest.mark.parametrize("launcher_type, path", [
    (Launcher, "direct"),
    (TupleLauncher, "direct_as_tuple"),
    (ScratchLauncher, "via_triton"),
    (FreshObjectLauncher, "via_triton"),
    (OtherPathLauncher, "via_triton"),
    (SelfCheckingLauncher, "via_triton"),
], ids=lambda value: value if isinstance(value, str) else value.__name__)
@pytest.mark.parametrize("grid", [5, (5, 3, 2), (5,)], ids=["1d", "3d", "1-tuple"])
@pytest.mark.parametrize("third", [False, True], ids=["two-pointers", "three-pointers"])
def test_plan_launch_forwards_what_triton_would(launcher_type, path, grid, third):
    name, while_built, later, triton_calls = launched_by_plan(launcher_type, grid, third)
    grid3 = (grid, 1, 1) if isinstance(grid, int) else (*grid, 1, 1)[:3]
    fresh_objects = launcher_type in (ScratchLauncher, FreshObjectLauncher)
    if not third:  # three pointers: a spliced launch, not one of the named forms
        assert name == path
    assert triton_calls == (1 if path == "via_triton" else 0)
    first, later_call = (FIRST + PARTIALS[:1], LATER + PARTIALS[1:]) if third else (FIRST, LATER)
    # A later call launches exactly what Triton's launcher would for it, on every grid axis.
    assert comparable(later, fresh_objects) == comparable(launched_by_triton(launcher_type, *later_call, grid=grid3),
                                                          fresh_objects)
    # Building it launches nothing, or (a launcher that launches by another route) repeats the
    # launch it was built after, never one with other arguments.
    assert all(call == launched_by_triton(launcher_type, *first, grid=grid3)[0] for call in while_built)
    assert while_built == [] or launcher_type is OtherPathLauncher
