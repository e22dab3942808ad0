"""The package keeps its shape: layers import downwards only, no cycles, small functions and
modules, a docstring on every module, no subclass that skips its parent's constructor
(docs/architecture.md)."""

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


def _class_names(
    package: Path = PACKAGE,
) -> tuple[dict[str, dict[str, tuple[str, str]]], dict[tuple[str, str], ast.ClassDef]]:
    """Each module's names for the package's classes (its own, and those it imports, through
    re-exports), and every class of the package by ``(module, name)``."""
    modules = _modules(package)
    trees = {name: ast.parse(path.read_text()) for name, path in modules.items()}
    classes = {
        (m, node.name): node
        for m, tree in trees.items()
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
    }
    names: dict[str, dict[str, tuple[str, str]]] = {}

    def resolve(module: str, seen: frozenset[str] = frozenset()) -> dict[str, tuple[str, str]]:
        if module in names:
            return names[module]
        found = {n: (m, n) for (m, n) in classes if m == module}
        package_name = (
            module if modules[module].name == "__init__.py" else module.rpartition(".")[0]
        )
        for node in ast.walk(trees[module]):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                parts = package_name.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            if target not in modules or target in seen:
                continue
            theirs = resolve(target, seen | {module})
            for alias in node.names:
                if alias.name in theirs:
                    found[alias.asname or alias.name] = theirs[alias.name]
        names[module] = found
        return found

    for module in modules:
        resolve(module)
    return names, classes


def _init(cls: ast.ClassDef) -> ast.FunctionDef | None:
    inits = [f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"]
    return inits[0] if inits else None


def _base_name(base: ast.expr) -> str | None:
    # The package names its bases plainly (``Base``, never ``module.Base``).
    return base.id if isinstance(base, ast.Name) else None


def _skipped_constructors(package: Path = PACKAGE) -> list[str]:
    """The package's classes whose ``__init__`` does not call their parent's, when one of their
    ancestors in the package defines one (dataclasses, which write their own, aside)."""
    names, classes = _class_names(package)

    def parents(module: str, cls: ast.ClassDef) -> list[tuple[str, str]]:
        known = names[module]
        return [known[n] for b in cls.bases if (n := _base_name(b)) in known]

    def an_ancestor_has_init(module: str, cls: ast.ClassDef) -> bool:
        for key in parents(module, cls):
            parent = classes[key]
            if _init(parent) is not None or an_ancestor_has_init(key[0], parent):
                return True
        return False

    problems = []
    for (module, name), cls in classes.items():
        init = _init(cls)
        decorators = [ast.unparse(d) for d in cls.decorator_list]
        if init is None or any("dataclass" in d for d in decorators):
            continue
        if not an_ancestor_has_init(module, cls):
            continue
        bases = {ast.unparse(b) for b in cls.bases}
        calls = [
            ast.unparse(c.func.value)
            for c in ast.walk(init)
            if isinstance(c, ast.Call)
            and isinstance(c.func, ast.Attribute)
            and c.func.attr == "__init__"
        ]
        if not any(call == "super()" or call in bases for call in calls):
            problems.append(f"{module}.{name}")
    return problems


def test_no_subclass_skips_its_parent_s_constructor():
    """One driver, variation injected (STYLE.md): a subclass that does not run its parent's
    ``__init__`` depends on how the parent builds itself, without the parent knowing."""
    problems = _skipped_constructors()
    assert not problems, "__init__ without the parent's __init__:\n" + "\n".join(problems)


def test_a_skipped_constructor_is_found_through_imports(tmp_path):
    pkg = tmp_path / "towers"
    (pkg / "processes").mkdir(parents=True)
    (pkg / "__init__.py").write_text('"""."""\n')
    (pkg / "processes" / "__init__.py").write_text('"""."""\nfrom .base import Base\n')
    (pkg / "processes" / "base.py").write_text(
        '"""."""\nclass Base:\n    def __init__(self):\n        self.x = 1\n\n\n'
        "class Middle(Base):\n    pass\n"
    )
    (pkg / "processes" / "nodes.py").write_text(
        '"""."""\nfrom dataclasses import dataclass\n\nfrom . import Base\n'
        "from .base import Middle as M\n\n\n"
        "class Skips(M):\n    def __init__(self):\n        self.y = 2\n\n\n"
        "class Calls(Base):\n    def __init__(self):\n        Base.__init__(self)\n\n\n"
        "class Supers(M):\n    def __init__(self):\n        super().__init__()\n\n\n"
        "@dataclass\nclass Record(Base):\n    z: int = 0\n"
    )
    assert _skipped_constructors(pkg) == ["towers.processes.nodes.Skips"]


def _store_keys_by_hand(tree: ast.AST) -> list[tuple[int, str]]:
    """Strings that name a key of the elastic store: one that starts as a family of keys
    does anywhere, and any string passed to a store's method or a signed record's helper."""
    families = ("hb/", "lost/", "join/", "ready/", "refused/", "left/", "notice/", "node/")
    families += ("node_of/",)
    methods = {"set", "get", "add", "check", "wait", "delete_key", "compare_set"}
    helpers = {"put_signed", "get_signed", "read_signed"}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr) and node.values:
            head = node.values[0]
            if isinstance(head, ast.Constant) and str(head.value).startswith(families):
                found.append((node.lineno, str(head.value)))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value.startswith(families):
                found.append((node.lineno, node.value))
        elif isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if not (
                (
                    isinstance(func, ast.Attribute)
                    and called in methods
                    and "store" in ast.unparse(func)
                )
                or called in helpers
            ):
                continue
            key = node.args[2:3] if called in helpers else node.args[:1]  # the key's place
            for arg in key:
                for item in arg.elts if isinstance(arg, ast.List) else [arg]:
                    if isinstance(item, ast.Constant) and isinstance(item.value, str):
                        found.append((item.lineno, item.value))
    return found


def test_the_elastic_store_s_keys_are_named_only_in_its_protocol_module():
    """Every key an elastic job keeps in its store is named in ``comm/protocol.py``: a key
    written by hand anywhere else is one a change of the protocol would miss."""
    by_hand = [
        f"{path.name}:{line}: {text!r}"
        for name, path in _modules().items()
        if name.startswith(("towers.comm", "towers.processes")) and name != "towers.comm.protocol"
        for line, text in _store_keys_by_hand(ast.parse(path.read_text()))
    ]
    assert not by_hand, by_hand
