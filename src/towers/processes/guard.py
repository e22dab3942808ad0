"""Refuse to start workers from a script that would start them again in every worker.

Where local workers come from a fork server (the caller has used CUDA, elastic jobs,
``TOWERS_START_METHOD=forkserver``; see :mod:`towers.processes.start`), ``multiprocessing``
runs the main script again in each, as the module ``__mp_main__``, so that the functions it
defines can be found; workers forked from the caller do not, but a script must run either way.
A script that calls ``towers.train`` or ``towers.spawn`` at its top level, not under
``if __name__ == "__main__":``, would call it again in every such worker;
multiprocessing then fails deep inside the workers (142 lines ending in an exit code, without a
hint). :func:`check_main_guard` finds the call in the caller, before any worker starts: it looks
for the main script's top-level frame on the stack and asks the script's syntax tree whether the
statement running there is inside such a guard.
"""

from __future__ import annotations

import ast
import sys
from types import FrameType

__all__ = ["check_main_guard"]


def _is_main_guard(node: ast.stmt) -> bool:
    """``if __name__ == "__main__":`` (either operand order)."""
    if not isinstance(node, ast.If) or not isinstance(node.test, ast.Compare):
        return False
    test = node.test
    if len(test.ops) != 1 or not isinstance(test.ops[0], ast.Eq):
        return False
    sides = [test.left, *test.comparators]
    names = [s for s in sides if isinstance(s, ast.Name) and s.id == "__name__"]
    consts = [s for s in sides if isinstance(s, ast.Constant) and s.value == "__main__"]
    return len(names) == 1 and len(consts) == 1


def _main_frame() -> FrameType | None:
    """The frame running the main script's top level, if it is on the stack."""
    main = sys.modules.get("__main__")
    if main is None:
        return None
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals is vars(main):
            return frame
        frame = frame.f_back
    return None


def unguarded_line(source: str, line: int) -> bool:
    """Whether line ``line`` of ``source`` runs at import, outside a ``__main__`` guard."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return False
    for node in tree.body:
        end = getattr(node, "end_lineno", node.lineno)
        if node.lineno <= line <= end:
            return not _is_main_guard(node) and not isinstance(
                node, (ast.FunctionDef, ast.AsyncFunctionDef)
            )
    return False


def check_main_guard(what: str) -> None:
    """Raise ``RuntimeError`` if the main script calls ``what`` at import, outside a guard.

    Scripts run by ``python -c``, an interactive session or a notebook have no file to run again
    and are not checked; nor is a package's ``__main__`` (``python -m pkg``), which
    multiprocessing does not run again.
    """
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and (spec.name == "__main__" or spec.name.endswith(".__main__")):
        return
    frame = _main_frame()
    path = frame.f_globals.get("__file__") if frame is not None else None
    if frame is None or not path:
        return
    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
    except OSError:
        return
    if not unguarded_line(source, frame.f_lineno):
        return
    raise RuntimeError(
        f"{path}, line {frame.f_lineno}: {what} is called when the script is imported. Every "
        "local worker runs the script again to find its functions, so it would start workers "
        "again, in every worker. Put the script's training code under a main guard:\n\n"
        'if __name__ == "__main__":\n    main()\n\n'
        "keeping loss_fn and the model's class at module level (towers run, torchrun and a "
        "world of one do not need the guard)"
    )
