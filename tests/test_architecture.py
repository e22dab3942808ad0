"""The package keeps its shape: layers import downwards only, no cycles, small functions and
modules, a docstring on every module (docs/architecture.md)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "towers"
# A module may import from its own layer and the layers before it, never from a later one.
LAYERS = ["core", "comm", "processes", "engines", "api", "tools"]
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 80  # code lines: a docstring does not count


def _modules(package: Path = PACKAGE) -> dict[str, Path]:
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ``modules`` that ``name`` imports, resolved to module names.

    Every import counts, those under ``if TYPE_CHECKING:`` too: an import for annotations is a
    dependency all the same, and one that closes a cycle hides a design that needs it.
    """
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    root = package.split(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith(root)}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith(root):
                found.add(target)
                found |= {f"{target}.{a.name}" for a in node.names}
    return {m for m in found if m in modules and m != name}


def _graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    modules = _modules(package)
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else len(LAYERS)


def test_layers_import_downwards_only():
    """Imports under ``if TYPE_CHECKING:`` count here too."""
    problems = []
    for name, targets in _graph().items():
        for target in targets:
            if _layer(target) > _layer(name):
                problems.append(f"{name} imports {target}")
    assert not problems, "imports against the layers:\n" + "\n".join(problems)


def test_the_pure_core_never_touches_torch_distributed():
    for name, path in _modules().items():
        if not name.startswith("towers.core"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            assert not any(n.startswith("torch.distributed") for n in names), (name, names)


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """An import cycle of ``graph``, as the modules along it, or ``None``."""
    # A package's __init__ importing its own modules is how packages are built, not a cycle.
    graph = {n: {t for t in targets if not n.startswith(t + ".")} for n, targets in graph.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycles():
    """Imports under ``if TYPE_CHECKING:`` count: a cycle for annotations is a cycle."""
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_an_import_for_annotations_only_closes_a_cycle_too(tmp_path):
    pkg = tmp_path / "towers"
    (pkg / "engines").mkdir(parents=True)
    (pkg / "__init__.py").write_text('"""."""\n')
    (pkg / "engines" / "__init__.py").write_text('"""."""\nfrom . import server\n')
    (pkg / "engines" / "server.py").write_text('"""."""\nfrom .policies import Policy\n')
    (pkg / "engines" / "policies.py").write_text(
        '"""."""\nfrom typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n'
        "    from .server import Server\n"
    )
    graph = _graph(pkg)
    assert graph["towers.engines.policies"] == {"towers.engines.server"}
    cycle = _cycle(graph)
    assert cycle is not None and cycle[0] == cycle[-1]
    assert set(cycle) == {"towers.engines.policies", "towers.engines.server"}
    (pkg / "engines" / "policies.py").write_text('"""."""\n')
    assert _cycle(_graph(pkg)) is None  # the package's __init__ importing its module is no cycle


def _code_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    body = node.body
    first = body[0]
    has_doc = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
    start = body[1].lineno if has_doc and len(body) > 1 else first.lineno
    return (node.end_lineno or start) - start + 1


def test_modules_and_functions_stay_small_and_documented():
    problems = []
    for name, path in _modules().items():
        source = path.read_text()
        tree = ast.parse(source)
        if not ast.get_docstring(tree):
            problems.append(f"{name}: no module docstring")
        if len(source.splitlines()) > MAX_MODULE_LINES:
            problems.append(f"{name}: {len(source.splitlines())} lines")
        for node in ast.walk(tree):
            function = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            if function and _code_lines(node) > MAX_FUNCTION_LINES:
                problems.append(f"{name}.{node.name}: {_code_lines(node)} lines of code")
    assert not problems, "\n".join(problems)
