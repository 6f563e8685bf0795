"""The project's own import graph, read with ast (nothing is imported): every module placed in a
layer, no circle, no import pointing up the layers, and no module using another's private names."""

import ast
import glob
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Bottom to top. A module imports from the layers below its own, or from its own without a circle.
# Every tests/test_*.py and conftest.py sits above them all. Modules by their dotted names.
LAYERS = [
    ("launch", ["nf4_triton.fastpath"]),  # Triton and torch internals, launch plans in general: nothing of a weight format
    ("quant states", ["nf4_triton.quantstate"]),  # a weight and its state found, validated, watched by a plan
    ("the dequantization", ["nf4_triton.kernel"]),  # the kernel, its launch choice, its API and operator
    ("the matmul's routes", ["nf4_triton.routes"]),  # configurations per kernel family, tables per GPU: data
    ("the matmul's kernels", ["nf4_triton.tl_matmul", "nf4_triton.mma_layouts", "nf4_triton.mma_helpers",
                              "nf4_triton.mma_sync", "nf4_triton.wgmma"]),
    ("the matmul's launch", ["nf4_triton.fused"]),
    ("the matmul's entry points", ["nf4_triton.matmul"]),
    ("drop-in", ["nf4_triton.dropin"]),
    ("the package", ["nf4_triton"]),  # its public names
    ("the challenge's name", ["kernel"]),  # the top-level kernel.py: nf4_triton.kernel under the challenge's name
    ("benchmark helpers", ["bench", "bench.timing", "bench.weights", "bench.results", "bench.contenders", "bench.plots"]),
    ("benchmark sections", ["bench.kernels", "bench.harness", "bench.compile", "bench.sweep", "bench.forms", "bench.model",
                            "bench.matmul"]),
    ("benchmark commands", ["bench.run", "bench.__main__", "bench.fsdp_qlora", "bench.serve"]),
    ("tools", ["tools", "tools.notebooks", "tools.launches"]),
    ("test helpers", ["reference", "helpers", "aot_compile", "aot_compile_matmul"]),
]
TESTS_LAYER = "tests"
PACKAGES = ["nf4_triton", "bench", "tools"]

# Private names that a file takes from another project module today, in files whose owners will
# give each a public name or move it; the test fails on any other use, and on an entry no longer used.
ALLOWED_PRIVATE = {}


def module_name(path):
    """The dotted name a file is imported by: ``nf4_triton/kernel.py`` is nf4_triton.kernel, a package's
    ``__init__.py`` the package, a file at the top or in tests/ its own name."""
    parts = os.path.splitext(path)[0].split("/")
    if parts[0] in PACKAGES:
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    return parts[-1]


def project_files():
    """{module name: path relative to the repository} of every Python file of the packages, the top level and tests/."""
    paths = sorted(glob.glob(os.path.join(ROOT, "*.py"))) + sorted(glob.glob(os.path.join(ROOT, "tests", "*.py")))
    for package in PACKAGES:
        paths += sorted(glob.glob(os.path.join(ROOT, package, "*.py")))
    relative = [os.path.relpath(path, ROOT).replace(os.sep, "/") for path in paths]
    files = {module_name(path): path for path in relative}
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


def project_module(dotted, modules):
    """The project module ``dotted`` names, or the longest project module it lies in; None outside the project."""
    parts = dotted.split(".")
    return next((".".join(parts[:end]) for end in range(len(parts), 0, -1) if ".".join(parts[:end]) in modules), None)


def bound_modules(tree, modules):
    """{name a file binds: the project module it is} for its imports (``from nf4_triton import kernel`` binds
    kernel to nf4_triton.kernel; ``import bench.timing`` binds bench to bench)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = alias.name if alias.asname else alias.name.split(".")[0]
                if project_module(target, modules) == target:
                    names[alias.asname or target] = target
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                if f"{node.module}.{alias.name}" in modules:
                    names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def imported_modules(tree, modules):
    """The project modules a file imports anywhere (inside functions too), by their dotted names."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(project_module(alias.name, modules) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                found.add(project_module(f"{node.module}.{alias.name}", modules))
    return found - {None}


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


def dotted(node):
    """``a.b.c`` for an attribute chain over a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id] + parts[::-1]) if isinstance(node, ast.Name) else None


def private_uses(tree, modules, own):
    """{"module._name"} a file takes from other project modules: ``module._name``, ``from module
    import _name``, and ``setattr``-like calls (monkeypatch's included) naming ``_name`` on a module."""
    names = bound_modules(tree, modules)

    def module_of(node):  # the project module an expression names, through the file's imports
        chain = dotted(node)
        if chain is None or chain.split(".")[0] not in names:
            return None
        first, *rest = chain.split(".")
        module = project_module(".".join([names[first], *rest]), modules)
        return module if module == ".".join([names[first], *rest]) else None

    uses = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in modules and node.module != own:
            uses.update(f"{node.module}.{alias.name}" for alias in node.names if is_private(alias.name))
        elif isinstance(node, ast.Attribute) and is_private(node.attr):
            module = module_of(node.value)
            if module is not None and module != own:
                uses.add(f"{module}.{node.attr}")
        elif isinstance(node, ast.Call) and len(node.args) >= 2:
            called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            target, name = node.args[:2]
            module = module_of(target)
            if (called in ("setattr", "getattr", "delattr", "hasattr") and module is not None and module != own
                    and isinstance(name, ast.Constant) and isinstance(name.value, str) and is_private(name.value)):
                uses.add(f"{module}.{name.value}")
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


@pytest.mark.parametrize("path", ["nf4_triton/fastpath.py", "nf4_triton/quantstate.py", "nf4_triton/kernel.py"])
def test_lower_layers_read_top_down(path):
    """The launch, quant-state and dequantization modules read top-down: each name defined above its first use."""
    found = used_before_defined(parse(path))
    assert not found, f"{path} uses names defined further down: {found}"


def test_the_checks_see_what_they_look_for():
    """Each check on a small made-up case: a circle, an import inside a function, each private form."""
    assert a_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert a_circle({"a": {"b"}, "b": set()}) is None
    source = ("from nf4_triton import kernel as k\nfrom nf4_triton.kernel import _jit, dequantize_nf4\nimport bench.timing\n"
              "def f(monkeypatch):\n    from nf4_triton import dropin\n    k._resolve(); k.__doc__; dropin.enable\n"
              "    monkeypatch.setattr(dropin, '_rule', None); bench.timing._clock()\n")
    tree = ast.parse(source)
    modules = {"nf4_triton", "nf4_triton.kernel", "nf4_triton.dropin", "bench", "bench.timing", "bench.run"}
    assert imported_modules(tree, modules) == {"nf4_triton.kernel", "nf4_triton.dropin", "bench.timing"}
    assert private_uses(tree, modules, "bench.run") == {"nf4_triton.kernel._jit", "nf4_triton.kernel._resolve",
                                                        "nf4_triton.dropin._rule", "bench.timing._clock"}
    assert private_uses(tree, modules, "nf4_triton.kernel") == {"nf4_triton.dropin._rule", "bench.timing._clock"}
    assert module_name("nf4_triton/__init__.py") == "nf4_triton" and module_name("tests/helpers.py") == "helpers"
    order = ast.parse("import os\ndef a(x):\n    return b(x) + os.sep\ndef b(word):\n    c = word\n    return c\n"
                      "def c(b):\n    return b\n")
    assert used_before_defined(order) == [(2, "b")]
