"""Error messages a person can read: the first line of an exception, long text shortened."""

from __future__ import annotations

__all__ = ["first_line", "shorten"]


def first_line(exc: BaseException) -> str:
    """``"TypeName: first line of the message"``, or just the type name for an empty message."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def shorten(text: str, limit: int = 300) -> str:
    """``text`` cut to about ``limit`` characters, keeping its start and end."""
    if len(text) <= limit:
        return text
    keep = max(1, (limit - 5) // 2)
    return f"{text[:keep]} ... {text[-keep:]}"
