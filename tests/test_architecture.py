"""The package keeps its shape: layers import downwards only, no cycles, small functions and
modules, a docstring on every module (docs/architecture.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "towers"
# A module may import from its own layer and the layers before it, never from a later one.
LAYERS = ["core", "comm", "processes", "engines", "api", "tools"]
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 80  # code lines: a docstring does not count


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _type_checking_only(tree: ast.Module) -> set[int]:
    """Line numbers of imports under ``if TYPE_CHECKING:`` (annotations only, never run)."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in ast.walk(node):
                if isinstance(inner, (ast.Import, ast.ImportFrom)):
                    lines.add(inner.lineno)
    return lines


def _imports(name: str, path: Path) -> set[str]:
    """The towers modules ``name`` imports (at run time), resolved to module names."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_only(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("towers")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("towers"):
                found.add(target)
                found |= {f"{target}.{a.name}" for a in node.names}
    modules = _modules()
    return {m for m in found if m in modules and m != name}


def _layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else len(LAYERS)


def test_layers_import_downwards_only():
    problems = []
    for name, path in _modules().items():
        for target in _imports(name, path):
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


def test_no_import_cycles():
    graph = {name: _imports(name, path) for name, path in _modules().items()}
    # A package's __init__ importing its own modules is how packages are built, not a cycle.
    for name in graph:
        graph[name] = {t for t in graph[name] if not name.startswith(t + ".")}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                cycle = [*stack[stack.index(nxt) :], nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in graph:
        if node not in state:
            visit(node)


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
