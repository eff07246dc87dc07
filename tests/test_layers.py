"""The package's layers, read from the import graph (every import, ``TYPE_CHECKING`` and
function-level ones included): no cycle, no upward import, llama.cpp only in ``_native``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import lcgen

PACKAGE = Path(lcgen.__file__).resolve().parent

# Bottom to top; a module may import from its own layer or any lower one.
LAYERS = (
    (
        "lcgen.errors",
        "lcgen._resources",
        "lcgen._files",
        "lcgen._numbers",
        "lcgen._unshared",
        "lcgen._version",
    ),
    ("lcgen._native",),
    ("lcgen.vocab",),
    ("lcgen.registry",),
    ("lcgen.constrain",),
    ("lcgen.decoding",),
    ("lcgen.runtime",),
    ("lcgen.continuous",),
    ("lcgen.tools",),
    ("lcgen.model",),
    ("lcgen.cli", "lcgen", "lcgen.__main__", "lcgen.server"),
)


def module_names() -> dict[str, Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ["lcgen", *path.relative_to(PACKAGE).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


MODULES = module_names()


def layer_of(module: str) -> int:
    best, best_len = None, -1
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            matches = module == prefix or (prefix != "lcgen" and module.startswith(prefix + "."))
            if matches and len(prefix) > best_len:
                best, best_len = i, len(prefix)
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best


def imports_of(module: str) -> set[str]:
    """The lcgen modules ``module`` imports (``from a import b`` counts as a.b when that is a
    module, else as a); relative imports are resolved."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if full in MODULES else base)
    return {name for name in found if name in MODULES and name != module}


GRAPH = {module: imports_of(module) for module in MODULES}


def test_every_module_is_in_a_layer() -> None:
    for module in MODULES:
        layer_of(module)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_upward_import(module: str) -> None:
    upward = sorted(n for n in GRAPH[module] if layer_of(n) > layer_of(module))
    assert not upward, f"{module} (layer {layer_of(module)}) imports from above: {upward}"


def test_no_import_cycle() -> None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for dep in sorted(GRAPH[module]):
            if state.get(dep) == 1:
                cycle = [*path[path.index(dep) :], dep]
                raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
            if dep not in state:
                visit(dep)
        path.pop()
        state[module] = 2

    for module in sorted(MODULES):
        if module not in state:
            visit(module)


# The package and its public modules (function calling's pieces are public in lcgen.tools).
PUBLIC = frozenset(["lcgen", "lcgen.tools"])


def test_the_server_uses_only_the_public_api() -> None:
    """lcgen.server is a client of the package: it imports ``lcgen``, its public modules and
    its own modules."""
    server = {m for m in MODULES if m.startswith("lcgen.server")}
    assert server, "lcgen.server has no modules"
    for module in server:
        other = GRAPH[module] - server - PUBLIC
        assert not other, f"{module} imports lcgen's internals: {sorted(other)}"


def test_only_the_native_layer_imports_llama_cpp() -> None:
    offenders = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            native = any(n == "llama_cpp" or n.startswith("llama_cpp.") for n in names)
            if native and not module.startswith("lcgen._native"):
                offenders.append(module)
    assert not offenders, f"llama_cpp imported outside lcgen._native: {sorted(set(offenders))}"


def test_the_checks_see_a_real_graph() -> None:
    """The graph is not empty and the checks would catch a violation."""
    assert "lcgen.decoding.options" in GRAPH["lcgen.decoding.generator"]
    assert "lcgen.runtime.run" in GRAPH["lcgen.runtime.scheduler"]
    assert layer_of("lcgen.runtime.scheduler") > layer_of("lcgen.decoding.generator")
    assert layer_of("lcgen") == layer_of("lcgen.cli") == len(LAYERS) - 1
