"""Named options, without processes: registered classes with fields of every type, their
messages, a compression added the way a mode is, and the transports parsed into one enum."""

from __future__ import annotations

import pickle
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

import towers.engines.transforms.compressions as compressions
from towers.core.modes import MODES
from towers.core.specs import Int, Real, Spec, Word, add, listing, parse
from towers.core.transport import Transport
from towers.engines.transforms import COMPRESSIONS, AllReduce, Compression, compression


@dataclass(frozen=True)
class Option(Spec):
    """The base of a kind made up for the test."""

    kind = "option"
    keyword = "option"
    valid = "valid options are"


@dataclass(frozen=True)
class Sparse(Option):
    """``sparse:F[:BITS]``: a share of the values, with an optional bit width."""

    name = "sparse"
    help = "the largest F of the values"
    fields = (
        Real("F, the share of values sent (0 < F <= 1)", above=0.0, maximum=1.0),
        Int("BITS, the bits of each value sent (>= 2)", minimum=2, optional=True),
    )

    share: float = 1.0
    bits: int = 8


@dataclass(frozen=True)
class Plain(Option):
    """Nothing to say."""

    name = "plain"


@pytest.fixture
def table() -> dict[str, type[Option]]:
    out: dict[str, type[Option]] = {}
    add(out, Plain)
    add(out, Sparse)
    return out


@pytest.mark.parametrize(
    ("text", "share", "bits", "normal"),
    [
        ("sparse:0.01", 0.01, 8, "sparse:0.01"),
        (" sparse:1 ", 1.0, 8, "sparse:1.0"),
        ("sparse:1e-3:4", 0.001, 4, "sparse:0.001:4"),
        ("sparse:0.5:8", 0.5, 8, "sparse:0.5"),  # the default bit width is not written
    ],
)
def test_a_fraction_field_reads_and_writes_back(table, text, share, bits, normal):
    got = parse(table, text, Option)
    assert type(got) is Sparse and (got.share, got.bits) == (share, bits)
    assert str(got) == normal and parse(table, str(got), Option) == got
    assert pickle.loads(pickle.dumps(got)) == got


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("sparse", r"option 'sparse' needs a number F, the share of values sent \(0 < F <= 1\); "
                   r"got 'sparse'$"),
        ("sparse:x", r"needs a number F, .*; got 'sparse:x'$"),
        ("sparse:nan", r"needs a number F"),
        ("sparse:inf", r"needs a number F"),
        ("sparse:0", r"option 'sparse' needs F, the share of values sent \(0 < F <= 1\); "
                     r"got 'sparse:0'$"),
        ("sparse:1.5", r"needs F, .*; got 'sparse:1.5'$"),
        ("sparse:0.1:1", r"needs BITS, the bits of each value sent \(>= 2\); got 'sparse:0.1:1'"),
        ("sparse:0.1:4.5", r"needs an integer argument BITS"),
        ("sparse:0.1:4:2", r"option 'sparse:0.1:4:2': sparse options are written "
                           r"'sparse:F' or 'sparse:F:BITS'$"),
        ("plain:1", r"option 'plain' takes no argument, got 'plain:1'$"),
        ("dense", r"unknown option 'dense'; valid options are \"plain\", \"sparse:F\"$"),
    ],
)  # fmt: skip
def test_refusals_say_what_the_argument_means_and_list_the_valid_ones(table, text, message):
    with pytest.raises(ValueError, match=message):
        parse(table, text, Option)


def test_a_text_is_required_and_names_are_registered_once(table):
    with pytest.raises(TypeError, match="option must be a string such as 'plain', got float"):
        parse(table, 0.1, Option)
    assert add(table, Sparse) is Sparse

    @dataclass(frozen=True)
    class Other(Sparse):
        pass

    with pytest.raises(ValueError, match="option 'sparse' is registered twice"):
        add(table, Other)


def test_a_spec_that_cannot_be_parsed_as_declared_is_refused_at_registration():
    @dataclass(frozen=True)
    class Backwards(Option):
        name = "backwards"
        fields = (Word("fast"), Int("N, anything (>= 0)"))
        fast: bool = False
        n: int = 0

    @dataclass(frozen=True)
    class Colon(Option):
        name = "a:b"

    for cls in (Backwards, Colon):
        with pytest.raises(TypeError):
            add({}, cls)


def test_usage_forms_help_and_examples_come_from_the_class(table):
    assert listing(table) == '"plain", "sparse:F"'
    assert Sparse.forms() == "'sparse:F' or 'sparse:F:BITS'"
    assert Sparse.summary() == "the largest F of the values"
    assert Plain.summary() == "Nothing to say."  # the docstring's first line
    assert Sparse.typical() == "sparse:1.0" and Plain.typical() == "plain"
    assert parse(table, Sparse.typical(), Option) == Sparse(1.0)


@dataclass(frozen=True)
class Halve(Compression):
    """``halve:N``: a compression made up for the test (the plain sum, N ignored)."""

    name = "halve"
    meaning = "N, how many times (>= 1)"
    minimum = 1

    times: int = 1

    def transform(self):
        return AllReduce()


def test_a_new_compression_is_one_class_and_one_registration(monkeypatch):
    monkeypatch.setattr(compressions, "COMPRESSIONS", dict(COMPRESSIONS))
    assert compressions.register(Halve) is Halve
    assert type(compression("halve:3")) is AllReduce
    with pytest.raises(ValueError, match=r"compression 'halve' needs N, how many times \(>= 1\)"):
        compression("halve:0")
    with pytest.raises(ValueError, match=r'"int8", "powersgd:R", "topk:F", "halve:N"$'):
        compression("zip")


def test_the_registered_compressions_in_order():
    assert list(COMPRESSIONS) == ["bf16", "fp16", "int8", "powersgd", "topk"]
    assert [str(compression(c.typical())) for c in COMPRESSIONS.values()][:3] == [
        "bf16",
        "fp16",
        "int8",
    ]


def test_a_transport_is_parsed_once_from_the_keyword_or_the_environment():
    assert Transport.parse("shm") is Transport.SHM
    assert Transport.parse(Transport.NCCL) is Transport.NCCL  # parsed already: passes through
    assert Transport.parse(None, "gloo") is Transport.GLOO  # TOWERS_TRANSPORT
    assert Transport.parse("shm", "gloo") is Transport.SHM  # the keyword wins
    assert Transport.parse(None) is Transport.AUTO and str(Transport.AUTO) == "auto"
    with pytest.raises(ValueError, match="must be one of auto, shm, gloo, nccl; got 'tcp'"):
        Transport.parse(None, "tcp")


def _table_rows(path: Path, heading: str) -> list[str]:
    """The quoted options in the first column of the first table after ``heading``."""
    text = path.read_text().split(heading, 1)[1]
    table = text.split("\n\n|", 1)[1].split("\n\n", 1)[0]
    return re.findall(r'^\| `"([^"]+)"` \|', "|" + table, re.M)


def test_the_documentation_tables_list_the_registered_options():
    root = Path(__file__).resolve().parents[1]
    modes = _table_rows(root / "README.md", "## Synchronous or asynchronous")
    assert modes == [cls.usage() for cls in MODES.values()]
    compressed = _table_rows(root / "docs" / "compression.md", "# Compressed gradients")
    assert compressed == [cls.usage() for cls in COMPRESSIONS.values()]
