"""Named options, ``"name"`` or ``"name:field[:field...]"``: one way to declare, register and parse.

A mode (``mode="ssp:2"``) and a compression (``compress="powersgd:4"``) are each a class, and
the class is the whole spec: its ``name``; the fields of its argument (:class:`Int`,
:class:`Real`, :class:`Word`), each saying what it means, its type and its range; a line of
``help``; :meth:`Spec.check` for what no single field can say; and, as its factory, the class
itself, a frozen dataclass whose fields receive the parsed values in order. A registry is a
plain dict of such classes by name (``towers.core.modes.MODES``,
``towers.engines.transforms.COMPRESSIONS``): :func:`add` puts a class in one, :func:`parse`
reads a text against one. Parsing happens here only, and the error messages, ``towers --help``,
``towers compare`` and the tests of the documentation's tables all list the valid values from
the registries, in the order of registration, so that a new option is one class and one
registration and shows up everywhere.

``str(spec)`` gives back the text that parses to it, normalised (``"ssp:2"``,
``"diloco:8:overlap"``): checkpoints store it and compare it.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, Self, TypeVar

__all__ = ["Field", "Int", "Real", "Spec", "Word", "add", "listing", "parse"]


class Field(Protocol):
    """One colon-separated part of an option's argument."""

    @property
    def optional(self) -> bool:
        """Whether the field may be left out (with every field after it)."""

    @property
    def letter(self) -> str:
        """How the usage writes the field: ``"H"`` in ``"diloco:H"``."""

    def read(self, part: str, spec: type[Spec], text: str) -> Any:
        """The value ``part`` holds; ``ValueError`` naming the spec and ``text`` otherwise."""

    def write(self, value: Any) -> str:
        """The text that :meth:`read` reads back to ``value``."""

    def sample(self) -> Any:
        """A valid value, for an example when the spec gives none."""


def _letter(meaning: str) -> str:
    return meaning.split(",")[0].strip()


@dataclass(frozen=True)
class Int:
    """A whole number of at least ``minimum``.

    ``meaning`` is written as an error shows it, letter first and the range last:
    ``"K, the steps between parameter averages (>= 1)"``.
    """

    meaning: str
    minimum: int = 0
    optional: bool = False

    @property
    def letter(self) -> str:
        return _letter(self.meaning)

    def read(self, part: str, spec: type[Spec], text: str) -> int:
        try:
            value = int(part)
        except ValueError:
            raise ValueError(
                f"{spec.kind} {spec.name!r} needs an integer argument {self.meaning}; got {text!r}"
            ) from None
        if value < self.minimum:
            raise ValueError(f"{spec.kind} {spec.name!r} needs {self.meaning}; got {text!r}")
        return value

    def write(self, value: Any) -> str:
        return str(value)

    def sample(self) -> int:
        return max(self.minimum, 1)


@dataclass(frozen=True)
class Real:
    """A finite number in a range: ``above`` < x and x < ``below`` (exclusive), ``minimum`` <= x
    and x <= ``maximum`` (inclusive).

    ``meaning`` as for :class:`Int`: ``"F, the share of values sent (0 < F <= 1)"``.
    """

    meaning: str
    above: float | None = None
    minimum: float | None = None
    maximum: float | None = None
    optional: bool = False
    below: float | None = None

    @property
    def letter(self) -> str:
        return _letter(self.meaning)

    def read(self, part: str, spec: type[Spec], text: str) -> float:
        try:
            value = float(part)
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            raise ValueError(
                f"{spec.kind} {spec.name!r} needs a number {self.meaning}; got {text!r}"
            )
        if (
            (self.above is not None and value <= self.above)
            or (self.minimum is not None and value < self.minimum)
            or (self.maximum is not None and value > self.maximum)
            or (self.below is not None and value >= self.below)
        ):
            raise ValueError(f"{spec.kind} {spec.name!r} needs {self.meaning}; got {text!r}")
        return value

    def write(self, value: Any) -> str:
        return repr(float(value))  # the shortest text that reads back to the same float

    def sample(self) -> float:
        if self.maximum is not None:
            return self.maximum
        if self.minimum is not None:
            return self.minimum
        if self.below is not None:
            return self.below - 1.0 if self.above is None else (self.above + self.below) / 2
        return 1.0 if self.above is None else self.above + 1.0


@dataclass(frozen=True)
class Word:
    """A keyword that is there or not (``overlap`` in ``"diloco:8:overlap"``): ``True`` if given."""

    word: str
    optional: bool = True

    @property
    def letter(self) -> str:
        return self.word

    def read(self, part: str, spec: type[Spec], text: str) -> bool:
        if part != self.word:
            raise ValueError(
                f"{spec.kind} {text!r}: unknown option {part!r}; {spec.title or spec.name} "
                f"{spec.kind}s are written {spec.forms()}"
            )
        return True

    def write(self, value: Any) -> str:
        return self.word

    def sample(self) -> bool:
        return True


class Spec:
    """A named option; subclasses are frozen dataclasses, registered with :func:`add`.

    The base class of a kind (``Mode``, ``Compression``) sets :attr:`kind`, :attr:`keyword`
    and :attr:`valid`; each registered class sets :attr:`name`, :attr:`help` and its fields:
    :attr:`meaning` and :attr:`minimum` for one integer (the common case), or :attr:`fields`.
    """

    kind: ClassVar[str]  # what messages call one: "mode"
    keyword: ClassVar[str]  # the keyword argument that takes it: "mode", "compress"
    valid: ClassVar[str]  # how a message introduces the registered ones: "valid modes are"

    name: ClassVar[str]
    title: ClassVar[str] = ""  # how prose names it ("DiLoCo"), if not by its name
    help: ClassVar[str] = ""  # one line for --help and the docs; default: the docstring's
    example: ClassVar[str] = ""  # a typical text ("ssp:2"); default: the least valid one
    fields: ClassVar[tuple[Field, ...]] = ()
    # the short way to declare one integer field: what it means (None: no argument), its least
    meaning: ClassVar[str | None] = None
    minimum: ClassVar[int] = 0

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "fields" not in vars(cls) and ("meaning" in vars(cls) or "minimum" in vars(cls)):
            cls.fields = () if cls.meaning is None else (Int(cls.meaning, cls.minimum),)

    def check(self) -> None:
        """``ValueError`` for values that each field accepts but not together."""

    @classmethod
    def parse(cls, text: str) -> Self:
        """The option ``text`` writes, its name (before the first colon) being this class's."""
        parts = text.split(":")[1:]
        if parts and not cls.fields:
            raise ValueError(f"{cls.kind} {cls.name!r} takes no argument, got {text!r}")
        if len(parts) > len(cls.fields):
            where = cls.title or cls.name
            raise ValueError(f"{cls.kind} {text!r}: {where} {cls.kind}s are written {cls.forms()}")
        values = []
        for i, field in enumerate(cls.fields):
            if i == len(parts) and field.optional:
                break
            values.append(field.read(parts[i] if i < len(parts) else "", cls, text))
        spec = cls(*values)  # type: ignore[call-arg]
        spec.check()
        return spec

    def __str__(self) -> str:
        slots = dataclasses.fields(self)  # type: ignore[arg-type]
        parts = [(f, s, getattr(self, s.name)) for f, s in zip(self.fields, slots, strict=False)]
        while parts and parts[-1][0].optional and parts[-1][2] == parts[-1][1].default:
            parts.pop()  # a trailing option left at its default is not written
        return ":".join([self.name, *(f.write(value) for f, _, value in parts)])

    @classmethod
    def usage(cls) -> str:
        """The short form, required fields only: ``"ssp:S"``."""
        return ":".join([cls.name, *(f.letter for f in cls.fields if not f.optional)])

    @classmethod
    def synopsis(cls) -> str:
        """Every form at once, optional fields in brackets: ``"diloco:H[:overlap[:P]]"``."""
        text, depth = cls.name, 0
        for field in cls.fields:
            text += f"[:{field.letter}" if field.optional else f":{field.letter}"
            depth += field.optional
        return text + "]" * depth

    @classmethod
    def forms(cls) -> str:
        """Every form, in words: ``'diloco:H', 'diloco:H:overlap' or 'diloco:H:overlap:P'``."""
        texts, parts = [], [cls.name]
        for field in cls.fields:
            if field.optional:
                texts.append(":".join(parts))
            parts.append(field.letter)
        texts.append(":".join(parts))
        quoted = [repr(t) for t in texts]
        return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"

    @classmethod
    def summary(cls) -> str:
        """One line of help: :attr:`help`, else the first paragraph of the docstring."""
        doc = cls.help or (inspect.getdoc(cls) or "").split("\n\n")[0]
        return " ".join(doc.replace("``", "").split())

    @classmethod
    def typical(cls) -> str:
        """:attr:`example`, else the required fields at their samples (``"local:1"``)."""
        if cls.example:
            return cls.example
        required = [f.write(f.sample()) for f in cls.fields if not f.optional]
        return ":".join([cls.name, *required])


S = TypeVar("S", bound=Spec)
C = TypeVar("C", bound=type[Spec])


def add(table: MutableMapping[str, Any], cls: C) -> C:
    """Register ``cls`` in ``table`` under its name; the same class again changes nothing.

    Raises:
        ValueError: another class already holds the name.
        TypeError: the class cannot be parsed as it declares itself (a malformed name, a
            required field after an optional one, fewer dataclass fields than fields).
    """
    name = cls.name
    if name in table and table[name] is not cls:
        raise ValueError(f"{cls.kind} {name!r} is registered twice: {table[name]} and {cls}")
    if not name or ":" in name or name != name.strip():
        raise TypeError(f"{cls.__name__}.name must be a word without a colon, got {name!r}")
    optional = [f.optional for f in cls.fields]
    if optional != sorted(optional):
        raise TypeError(f"{cls.__name__}: an optional field is followed by a required one")
    if len(dataclasses.fields(cls)) < len(cls.fields):  # type: ignore[arg-type]
        raise TypeError(f"{cls.__name__}: fewer dataclass fields than argument fields")
    table[name] = cls
    return cls


def listing(table: Mapping[str, type[Spec]]) -> str:
    """The registered ones for a message: ``"sync", "async", "ssp:S"``."""
    return ", ".join(f'"{cls.usage()}"' for cls in table.values())


def parse(table: Mapping[str, type[S]], text: object, base: type[S]) -> S:
    """The option that ``text`` names in ``table``, a registry of ``base``'s subclasses.

    Raises:
        TypeError: ``text`` is not a string.
        ValueError: an unknown name (listing the registered ones), or an argument its class
            refuses (saying what the argument means).
    """
    if not isinstance(text, str):
        example = next(iter(table), base.kind)
        raise TypeError(
            f"{base.keyword} must be a string such as {example!r}, got {type(text).__name__}"
        )
    cls = table.get(text.strip().partition(":")[0])
    if cls is None:
        raise ValueError(f"unknown {base.kind} {text!r}; {base.valid} {listing(table)}")
    return cls.parse(text.strip())
