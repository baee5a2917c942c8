"""swarm.flags: flags generated from a config dataclass and its field docstrings, argv round trips, TOML."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from swarm.field_source import field_docs, field_hints
from swarm.flags import Flag, Flags, flag, to_argv


@dataclass(frozen=True)
class Inner:
    """inner knobs"""

    rate_s: float = 1.5
    """Seconds between rounds."""
    seed: int = 0
    """Seed of the inner search."""


@dataclass(frozen=True)
class Sized:
    """A flag-shaped view of a `(width, height)` pair, as `--size WxH` and nothing else."""

    size: str = "1x1"
    """Width x height."""

    def build(self) -> tuple[int, int]:
        w, _, h = self.size.partition("x")
        return int(w), int(h)

    @classmethod
    def of(cls, pair: tuple[int, int]) -> Sized:
        return cls(f"{pair[0]}x{pair[1]}")


@dataclass(frozen=True)
class Outer:
    """A config with every kind of field."""

    steps: int = 3
    """Optimizer steps."""
    verbose: bool = False
    """Log more."""
    auth: bool = True
    """Authenticate every call."""
    limit: int | None = None
    """Most calls; None: no limit."""
    port: int | None = 0
    """Port; none: no port."""
    mode: Literal["fast", "slow"] = "fast"
    """How to run."""
    kind: str = field(default="a", metadata=flag(choices=("a", "b"), name="--the-kind"))
    """Which kind."""
    out: Path = Path("runs")
    """Output folder."""
    peers: tuple[str, ...] = ()
    """Peers to join."""
    links: tuple[str, ...] = field(default=(), metadata=flag(repeat=True, name="--link"))
    """One link each."""
    pair: tuple[int, int] = field(default=(1, 1), metadata=flag(via=Sized))
    """The pair."""
    inner: Inner = field(default_factory=Inner, metadata=flag(group="inner things"))
    """Inner."""
    other: Inner = field(default_factory=Inner, metadata=flag(fields={"seed": Flag(name="--other-seed")}))
    """Another inner, sharing --rate-s."""
    hidden: int = field(default=7, metadata=flag(skip=True))
    """Not a flag."""
    maybe: Inner | None = field(default=None, metadata=flag(name="--maybe", prefix="maybe-"))
    """Turn the optional inner on."""


def test_field_docs_are_the_literals_after_the_fields():
    docs = field_docs(Outer)
    assert docs["steps"] == "Optimizer steps."
    assert docs["limit"] == "Most calls; None: no limit."
    assert "hidden" in docs and "rate_s" not in docs


class Holder:
    @dataclass(frozen=True)
    class Nested:
        depth: int = 1
        """How deep, nested."""


def test_field_docs_find_nested_classes_and_classes_made_in_functions():
    @dataclass(frozen=True)
    class Local:
        width: int = 2
        """How wide, local."""

    if True:  # a class statement inside a block of the function is found too

        @dataclass(frozen=True)
        class InBlock:
            height: int = 3
            """How high, in a block."""

    assert field_docs(Holder.Nested) == {"depth": "How deep, nested."}
    assert field_docs(Local) == {"width": "How wide, local."}
    assert field_docs(InBlock) == {"height": "How high, in a block."}
    assert field_docs(Inner) == {"rate_s": "Seconds between rounds.", "seed": "Seed of the inner search."}


def test_field_docs_of_a_class_without_source_are_empty():
    made = dataclass(type("Made", (), {"__annotations__": {"x": int}, "x": 0}))  # no class statement anywhere
    assert field_docs(made) == {}


def test_field_hints_are_the_annotations_evaluated():
    hints = field_hints(Outer)  # this module's annotations are strings (`from __future__ import annotations`)
    assert hints["steps"] is int and hints["limit"] == int | None
    assert hints["pair"] == tuple[int, int] and hints["maybe"] == Inner | None and hints["out"] is Path


def test_flags_of_every_kind_parse():
    flags = Flags(Outer)
    c = flags.parse(
        ["--steps", "5", "--verbose", "--no-auth", "--limit", "9", "--port", "none", "--mode", "slow",
         "--the-kind", "b", "--out", "x/y", "--peers", "p1", "p2", "--link", "l1", "--link", "l2",
         "--size", "3x4", "--rate-s", "0.25", "--seed", "2", "--other-seed", "5"]
    )  # fmt: skip
    assert c.steps == 5 and c.verbose and not c.auth and c.limit == 9 and c.port is None
    assert c.mode == "slow" and c.kind == "b" and c.out == Path("x/y")
    assert c.peers == ("p1", "p2") and c.links == ("l1", "l2") and c.pair == (3, 4)
    assert c.inner == Inner(0.25, 2) and c.other == Inner(0.25, 5)  # --rate-s is shared by both
    assert flags.parse([]) == Outer()


def test_bad_choice_and_bad_type_are_refused():
    for argv in (["--mode", "medium"], ["--the-kind", "c"], ["--steps", "x"]):
        with pytest.raises(SystemExit):
            Flags(Outer).parse(argv)


def test_optional_nested_config_has_an_on_flag():
    flags = Flags(Outer)
    assert flags.parse([]).maybe is None
    assert flags.parse(["--maybe"]).maybe == Inner()
    c = flags.parse(["--maybe", "--maybe-seed", "4"])
    assert c.maybe == Inner(seed=4)
    assert flags.parse(flags.to_argv(c)) == c


def test_help_has_each_docstring_and_default():
    text = Flags(Outer).parser(prog="t").format_help()
    for doc in (
        "Optimizer steps.",
        "Log more.",
        "Most calls; None: no limit.",
        "Seconds between rounds.",
        "Which kind.",
    ):
        assert doc in " ".join(text.split())
    assert "(default: 3)" in text and "(default: 1x1)" in text and "--no-auth" in text and "inner things" in text
    assert "--hidden" not in text and "--config" in text


def test_to_argv_round_trips_and_lists_only_changes():
    flags = Flags(Outer)
    c = Outer(steps=9, auth=False, port=None, peers=("a",), links=("x", "y"), pair=(2, 5), inner=Inner(seed=3))
    argv = flags.to_argv(c)
    assert "--steps" in argv and "--verbose" not in argv and "--no-auth" in argv
    assert flags.parse(argv) == c
    assert flags.parse(flags.to_argv(c, all=True)) == c
    assert to_argv(Outer()) == []


def test_to_argv_refuses_what_flags_cannot_say():
    with pytest.raises(ValueError, match="hidden: not all of it has flags"):
        to_argv(Outer(hidden=8))
    with pytest.raises(ValueError, match="--rate-s is shared"):
        to_argv(Outer(inner=Inner(rate_s=2.0)))


def test_toml_file_under_the_command_line(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('steps = 4\nverbose = true\nrate_s = 0.5\npeers = ["a", "b"]\nthe-kind = "b"\n')
    flags = Flags(Outer)
    c = flags.parse(["--config", str(path), "--steps", "6"])
    assert c.steps == 6 and c.verbose and c.inner.rate_s == 0.5 and c.peers == ("a", "b") and c.kind == "b"


def test_toml_unknown_key_and_bad_value_name_the_key_and_file(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("stepz = 4\n")
    with pytest.raises(SystemExit, match=r"run\.toml: unknown key 'stepz'"):
        Flags(Outer).parse(["--config", str(path)])
    path.write_text('mode = "medium"\n')
    with pytest.raises(SystemExit, match=r"run\.toml.*medium"):
        Flags(Outer).parse(["--config", str(path)])


def test_flags_join_an_existing_parser():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", action="store_true")
    flags = Flags(Outer)
    flags.add_to(parser)
    args = parser.parse_args(["--json", "--steps", "2"])
    assert args.json and flags.from_args(args).steps == 2


def test_to_argv_always_names_flags_at_their_defaults():
    flags = Flags(Outer)
    argv = flags.to_argv(Outer(steps=5), always=["--mode", "--auth"])
    assert argv == ["--steps", "5", "--auth", "--mode", "fast"]
    assert flags.parse(argv) == Outer(steps=5)
    with pytest.raises(ValueError, match="not flags of Outer"):
        flags.to_argv(Outer(), always=["--nope"])


def test_a_flag_given_at_its_default_still_overrides_the_file(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("steps = 9\nverbose = true\n")
    c = Flags(Outer).parse(["--config", str(path), "--steps", "3", "--no-verbose"])
    assert c.steps == 3 and not c.verbose


def test_toml_sections_follow_the_config_tree(tmp_path):
    """A table is a nested config, named by its field; its keys are that config's field names or flags."""
    path = tmp_path / "run.toml"
    path.write_text(
        'steps = 4\n[inner]\nrate_s = 0.5\nseed = 2\n[other]\nseed = 5\n[pair]\nsize = "2x3"\n[maybe]\nseed = 4\n'
    )
    c = Flags(Outer).parse(["--config", str(path), "--seed", "7"])
    assert c.steps == 4 and c.inner == Inner(0.5, 7) and c.other == Inner(0.5, 5) and c.pair == (2, 3)
    assert c.maybe == Inner(seed=4)  # its table turns the optional config on (its own --maybe-rate-s unset)
    path.write_text("[maybe]\nmaybe = false\nseed = 4\n")
    assert Flags(Outer).parse(["--config", str(path)]).maybe is None


@pytest.mark.parametrize(
    "text, match",
    [
        ("[nope]\nseed = 1\n", r"\[nope\] is not a section .*inner, maybe, other, pair"),
        ("[inner]\nsteps = 1\n", r"unknown key 'steps' in \[inner\]"),
        ("[steps]\nx = 1\n", r"\[steps\] is not a section"),
        ("[inner.deeper]\nx = 1\n", r"\[inner.deeper\] is not a section .*none"),
        ("[inner]\nseed = 'x'\n", r"run\.toml.*'x'"),
    ],
)
def test_a_bad_toml_section_or_key_is_named(tmp_path, text, match):
    path = tmp_path / "run.toml"
    path.write_text(text)
    with pytest.raises(SystemExit, match=match):
        Flags(Outer).parse(["--config", str(path)])
