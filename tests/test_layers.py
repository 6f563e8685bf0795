"""The project's own import graph, read with ast (nothing is imported): every module placed in a
layer, no circle, no import pointing up the layers, and no module using another's private names."""

import ast
import glob
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Bottom to top. A module imports from the layers below its own, or from its own without a circle.
# Every tests/test_*.py and conftest.py sits above them all.
LAYERS = [
    ("launch", ["fastpath"]),  # Triton and torch internals, launch plans in general: nothing of a weight format
    ("quant states", ["quantstate"]),  # a weight and its state found, validated, watched by a plan
    ("kernels and their entry points", ["kernel", "mma", "matmul"]),  # the format's kernels, each with its API and operator
    ("drop-in", ["dropin"]),
    ("benchmark helpers", ["bench_timing", "bench_weights", "bench_results", "bench_contenders", "bench_plots"]),
    ("benchmark sections", ["bench_kernels", "bench_harness", "bench_compile", "bench_sweep", "bench_forms", "modelbench",
                            "matmulbench"]),
    ("benchmark commands", ["bench", "fsdp_qlora", "servebench"]),
    ("notebooks", ["notebooks"]),
    ("test helpers", ["reference", "helpers", "aot_compile", "aot_compile_matmul"]),
]
TESTS_LAYER = "tests"

# Private names that a file takes from another project module today, in files whose owners will
# give each a public name or move it; the test fails on any other use, and on an entry no longer used.
ALLOWED_PRIVATE = {}


def project_files():
    """{module name: path relative to the repository} of every Python file at the top level and in tests/."""
    paths = sorted(glob.glob(os.path.join(ROOT, "*.py"))) + sorted(glob.glob(os.path.join(ROOT, "tests", "*.py")))
    files = {os.path.splitext(os.path.basename(path))[0]: os.path.relpath(path, ROOT).replace(os.sep, "/")
             for path in paths}
    assert len(files) == len(paths), "two project files share a module name"
    return files


def is_test(module):
    return module.startswith("test_") or module == "conftest"


def layer_of(module):
    """(index, name) of the module's layer, counted from the bottom."""
    if is_test(module):
        return len(LAYERS), TESTS_LAYER
    return next((index, name) for index, (name, modules) in enumerate(LAYERS) if module in modules)


def parse(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as handle:
        return ast.parse(handle.read(), path)


def imported_modules(tree, modules):
    """The project modules a file imports anywhere (inside functions too), by their own names."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found & set(modules)


def import_graph():
    files = project_files()
    return {module: imported_modules(parse(path), files) - {module} for module, path in files.items()}


def a_circle(graph):
    """One import circle as [a, b, ..., a], or None."""
    state = {}  # module -> "open" while on the path, "done" after

    def visit(module, path):
        state[module] = "open"
        for imported in sorted(graph[module]):
            if state.get(imported) == "open":
                return path[path.index(imported):] + [imported]
            if imported not in state:
                circle = visit(imported, path + [imported])
                if circle:
                    return circle
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state:
            circle = visit(module, [module])
            if circle:
                return circle
    return None


def is_private(name):
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_uses(tree, modules, own):
    """{"module._name"} a file takes from other project modules: ``module._name``, ``from module
    import _name``, and ``setattr``-like calls (monkeypatch's included) naming ``_name`` on a module."""
    aliases = {alias.asname or alias.name: alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
               for alias in node.names if alias.name in modules and alias.name != own}
    uses = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in modules and node.module != own:
            uses.update(f"{node.module}.{alias.name}" for alias in node.names if is_private(alias.name))
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            if is_private(node.attr):
                uses.add(f"{aliases[node.value.id]}.{node.attr}")
        elif isinstance(node, ast.Call) and len(node.args) >= 2:
            called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            target, name = node.args[:2]
            if (called in ("setattr", "getattr", "delattr", "hasattr") and isinstance(target, ast.Name)
                    and target.id in aliases and isinstance(name, ast.Constant) and isinstance(name.value, str)
                    and is_private(name.value)):
                uses.add(f"{aliases[target.id]}.{name.value}")
    return uses


def test_every_module_has_one_layer():
    placed = [module for _, modules in LAYERS for module in modules]
    assert len(placed) == len(set(placed)), "a module placed twice"
    files = {module for module in project_files() if not is_test(module)}
    assert not files - set(placed), f"place these modules in LAYERS: {sorted(files - set(placed))}"
    assert not set(placed) - files, f"LAYERS names modules that no longer exist: {sorted(set(placed) - files)}"


def test_no_import_circle():
    circle = a_circle(import_graph())
    assert circle is None, "import circle: " + " -> ".join(circle)


def test_imports_point_down():
    upward = [f"{module} ({layer_of(module)[1]}) imports {imported} ({layer_of(imported)[1]})"
              for module, imported_set in sorted(import_graph().items()) for imported in sorted(imported_set)
              if layer_of(imported)[0] > layer_of(module)[0]]
    assert not upward, "imports pointing up the layers:\n" + "\n".join(upward)


def test_no_private_names_across_modules():
    files = project_files()
    found = {path: private_uses(parse(path), files, module) for module, path in files.items()}
    new = {path: sorted(uses - ALLOWED_PRIVATE.get(path, set())) for path, uses in found.items()}
    gone = {path: sorted(allowed - found.get(path, set())) for path, allowed in ALLOWED_PRIVATE.items()}
    new, gone = ({path: names for path, names in table.items() if names} for table in (new, gone))
    assert not new, f"private names used across modules (give each a public name, or move it): {new}"
    assert not gone, f"no longer used: remove from ALLOWED_PRIVATE {gone}"


def used_before_defined(tree):
    """[(line, name)] where a top-level statement reads a module-level name that only a later
    statement defines (names a function or class binds itself, such as parameters, left out)."""
    def bound_by(node):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            return {node.name}
        return ({sub.id for sub in ast.walk(node) if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store)}
                | {(sub.asname or sub.name).split(".")[0] for sub in ast.walk(node) if isinstance(sub, ast.alias)}
                | {sub.name for sub in ast.walk(node) if isinstance(sub, (ast.FunctionDef, ast.ClassDef))})

    first = {}
    for node in tree.body:
        for name in bound_by(node):
            first.setdefault(name, node.lineno)
    found = []
    for node in tree.body:
        local = set()
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            local = {sub.id for sub in ast.walk(node) if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store)}
            local |= {sub.arg for sub in ast.walk(node) if isinstance(sub, ast.arg)}
        found += [(node.lineno, sub.id) for sub in ast.walk(node) if isinstance(sub, ast.Name)
                  and isinstance(sub.ctx, ast.Load) and sub.id not in local and first.get(sub.id, 0) > node.lineno]
    return found


@pytest.mark.parametrize("module", ["fastpath", "quantstate", "kernel"])
def test_lower_layers_read_top_down(module):
    """The launch, quant-state and dequantization modules read top-down: each name defined above its first use."""
    found = used_before_defined(parse(f"{module}.py"))
    assert not found, f"{module}.py uses names defined further down: {found}"


def test_the_checks_see_what_they_look_for():
    """Each check on a small made-up case: a circle, an import inside a function, each private form."""
    assert a_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert a_circle({"a": {"b"}, "b": set()}) is None
    source = ("import kernel as k\nfrom kernel import _jit, dequantize_nf4\n"
              "def f(monkeypatch):\n    import dropin\n    k._resolve(); k.__doc__; dropin.enable\n"
              "    monkeypatch.setattr(dropin, '_rule', None)\n")
    tree = ast.parse(source)
    assert imported_modules(tree, {"kernel", "dropin", "bench"}) == {"kernel", "dropin"}
    assert private_uses(tree, {"kernel", "dropin"}, "bench") == {"kernel._jit", "kernel._resolve", "dropin._rule"}
    assert private_uses(tree, {"kernel", "dropin"}, "kernel") == {"dropin._rule"}
    order = ast.parse("import os\ndef a(x):\n    return b(x) + os.sep\ndef b(word):\n    c = word\n    return c\n"
                      "def c(b):\n    return b\n")
    assert used_before_defined(order) == [(2, "b")]
