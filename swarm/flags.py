"""Command-line flags, TOML files and child-process argv generated from frozen config dataclasses.

A config field is written once: its annotation gives the flag's type, the string literal after it (the field's
docstring, read once from the class source by `swarm.field_source`) gives the flag's help, and its
default gives the flag's default. `Flags(Config)` adds the flags to a parser, builds the config back from the
parsed arguments (`from_args`), renders a config as the argv that rebuilds it (`to_argv`), and loads a TOML
file given with `--config FILE` under the flags given on the command line.

A field whose flag differs from the generated one says so in `field(metadata=flag(...))`: another name, a parser
and renderer (a codec label -> `CodecConfig`), a group, the nested fields that are flags. A field whose value is
built from several flags (a model from `--model/--layers/...`) names a flag-shaped dataclass `via=`, with a
`build()` method and an `of(value)` classmethod. Nested configs become argument groups that share one flag
namespace: two fields that declare the same flag (`--host` of the DHT node and of the gRPC server) are set by it
together.

Types: int, float, str and Path flags; bool as --x/--no-x; `X | None` takes the text "none" for None; tuples
take several values (or one flag per item, `repeat`); Literal and `choices` are argparse choices.

It imports from `swarm` only `swarm.field_source` (the layer below it), which reads the docstrings and
annotations.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar

from swarm.field_source import field_docs, field_hints

__all__ = ["Flag", "Flags", "flag", "to_argv"]

C = TypeVar("C")
_NONE = "none"


@dataclass(frozen=True)
class Flag:
    """How one config field appears on the command line (all optional: the field's annotation, docstring and
    default give the rest)."""

    name: str | None = None
    """The flag, e.g. "--compute-speed"; None: `--` and the field's name with dashes (and the group's prefix)."""
    parse: Callable[[str], Any] | None = None
    """Turns the flag's text into the field's value (argparse `type`); None: from the annotation."""
    render: Callable[[Any], str] | None = None
    """Turns the field's value back into the flag's text (for `to_argv`); None: `str`, "none" for None."""
    value: Callable[[Any], Any] | None = None
    """Turns the parsed flag (what `args` holds, e.g. -1) into the field's value (e.g. None)."""
    help: str | None = None
    """Help text instead of the field's docstring (where the flag's wording differs from the field's)."""
    metavar: str | None = None
    """The value's name in --help."""
    choices: Sequence[Any] | None = None
    """Allowed values (a Literal annotation gives them too)."""
    repeat: bool = False
    """A tuple field whose flag is given once per item (`--link A --link B`) rather than once with every item."""
    nargs: str | int | None = None
    """argparse nargs of a tuple field ("*" unless told)."""
    group: str | None = None
    """Title of the --help group the flag goes in (a nested config: its group's title)."""
    skip: bool = False
    """No flag: the field keeps its default (a config whose value differs cannot be rendered as argv)."""
    only: tuple[str, ...] | None = None
    """A nested config: its fields that are flags (the others keep their defaults)."""
    fields: Mapping[str, Flag] = dataclasses.field(default_factory=dict)
    """A nested config: flags of its fields, instead of their own metadata (for configs owned elsewhere)."""
    prefix: str = ""
    """A nested config: put before its fields' generated flag names (e.g. "freeze-")."""
    via: type | None = None
    """A flag-shaped dataclass whose fields are the flags, with `build(self)` (the field's value, or a dict of
    the `covers` fields' values) and a classmethod `of(*values)` (the flags of those values)."""
    covers: tuple[str, ...] = ()
    """`via`: the fields it builds (default: this one); the others carry `flag(skip=True)`."""


def flag(**kwargs: Any) -> dict[str, Flag]:
    """`field(metadata=flag(name="--lr"))`: the field's flag, as `Flag`'s fields say."""
    return {"flag": Flag(**kwargs)}


def _spec(f: dataclasses.Field, overrides: Mapping[str, Flag]) -> Flag:
    return overrides.get(f.name) or f.metadata.get("flag") or Flag()


# ---- the tree of flags -----------------------------------------------------------------------------------


@dataclass
class _Leaf:
    """One field that is one flag."""

    path: str  # dotted field path from the root config, for messages
    name: str
    annotation: Any
    spec: Flag
    help: str
    kind: str = "value"  # value | bool | multi
    convert: Callable[[str], Any] = str
    render_one: Callable[[Any], str] = str
    nargs: str | int | None = None
    choices: Sequence[Any] | None = None
    group_title: str | None = None

    def __post_init__(self) -> None:
        ann, optional = _strip_optional(self.annotation)
        origin = typing.get_origin(ann)
        choices = self.spec.choices
        if origin is Literal:
            choices = choices or typing.get_args(ann)
            ann = type(typing.get_args(ann)[0])
        if ann is bool and self.spec.parse is None:
            self.kind = "bool"
            return
        if origin is tuple and (self.spec.parse is None or self.spec.repeat):  # a parse: of each item
            self.kind = "multi"
            args = typing.get_args(ann)
            variadic = len(args) == 2 and args[1] is Ellipsis
            self.nargs = self.spec.nargs or ("*" if variadic or not args else len(args))
            self.convert = self.spec.parse or _scalar(args[0] if args else str)
            self.render_one = self.spec.render or _render_scalar
            self.choices = choices
            return
        base = self.spec.parse or _scalar(ann)
        self.convert = (lambda text: None if text.lower() == _NONE else base(text)) if optional else base
        self.render_one = self.spec.render or _render_scalar
        self.choices = choices

    def add_to(self, group: argparse._ActionsContainer, default: Any) -> None:
        """Adds the flag: its dest is the flag's name with underscores (`args.seq_len`), its default the base's
        value, and the names of the flags given are kept in `args` (a --config file goes under them only)."""
        help_text = (self.spec.help or self.help or "").replace("%", "%%")
        help_text += f" (default: {self.show(default)})"
        kwargs: dict[str, Any] = dict(dest=self.dest, help=help_text.strip())
        if self.kind != "bool" and (self.spec.metavar or not self.choices):
            kwargs["metavar"] = self.spec.metavar or self.name[2:].upper().replace("-", "_")
        if self.kind == "bool":
            group.add_argument(self.name, action=_GivenBool, default=default, **kwargs)
            return
        if self.choices:
            kwargs["choices"] = list(self.choices)
        if self.kind == "multi" and self.spec.repeat:
            group.add_argument(self.name, action=_GivenAppend, type=self.convert, default=list(default), **kwargs)
        elif self.kind == "multi":
            group.add_argument(
                self.name, action=_GivenStore, nargs=self.nargs, type=self.convert, default=default, **kwargs
            )
        else:
            group.add_argument(self.name, action=_GivenStore, type=self.convert, default=default, **kwargs)

    def show(self, value: Any) -> str:
        """`value` as --help shows a default."""
        if self.kind == "bool":
            return "true" if value else "false"
        if self.kind == "multi":
            return " ".join(self.render_one(v) for v in value) or _NONE
        return _NONE if value in (None, ()) and self.spec.render is None else self.render_one(value)

    @property
    def dest(self) -> str:
        return self.name[2:].replace("-", "_")

    def value(self, parsed: Any) -> Any:
        parsed = tuple(parsed) if self.kind == "multi" else parsed
        return self.spec.value(parsed) if self.spec.value is not None else parsed

    def render(self, value: Any) -> list[str]:
        """The argv that gives `value` (a bool: its --x or --no-x)."""
        if self.kind == "bool":
            return [self.name if value else "--no-" + self.name[2:]]
        if self.kind == "multi":
            items = [self.render_one(v) for v in value]
            if self.spec.repeat:
                return [t for item in items for t in (self.name, item)]
            return [self.name, *items] if items or self.nargs != "+" else []
        return [self.name, _NONE if value is None and self.spec.render is None else self.render_one(value)]

    def tokens(self, value: Any, where: str) -> list[str]:
        """The argv of a TOML value (a TOML file's key)."""
        if self.kind == "bool":
            if not isinstance(value, bool):
                raise ValueError(f"{where}: expected true or false, got {value!r}")
            return self.render(value)
        if self.kind == "multi":
            items = value if isinstance(value, list) else [value]
            texts = [_toml_text(v) for v in items]
            return [t for v in texts for t in (self.name, v)] if self.spec.repeat else [self.name, *texts]
        if isinstance(value, (list, dict)):
            raise ValueError(f"{where}: expected one value, got {value!r}")
        return [self.name, _toml_text(value)]


_GIVEN = "_flags_given"


def _mark(namespace: argparse.Namespace, dest: str) -> bool:
    """Notes that `dest` was given; True the first time."""
    given = namespace.__dict__.setdefault(_GIVEN, set())
    first = dest not in given
    given.add(dest)
    return first


class _GivenStore(argparse._StoreAction):
    def __call__(self, parser, namespace, values, option_string=None):  # noqa: ANN001
        _mark(namespace, self.dest)
        super().__call__(parser, namespace, values, option_string)


class _GivenAppend(argparse._AppendAction):
    def __call__(self, parser, namespace, values, option_string=None):  # noqa: ANN001
        if _mark(namespace, self.dest):  # the first one replaces the default's items
            setattr(namespace, self.dest, [])
        super().__call__(parser, namespace, values, option_string)


class _GivenBool(argparse.BooleanOptionalAction):
    def __call__(self, parser, namespace, values, option_string=None):  # noqa: ANN001
        _mark(namespace, self.dest)
        super().__call__(parser, namespace, values, option_string)


def _given(namespace: argparse.Namespace, leaves: Mapping[str, list[_Leaf]]) -> dict[str, Any]:
    """`{flag name: value}` of the flags given in `namespace`."""
    given = getattr(namespace, _GIVEN, set())
    return {name[2:]: getattr(namespace, ls[0].dest) for name, ls in leaves.items() if ls[0].dest in given}


def _toml_text(value: Any) -> str:
    return repr(value) if isinstance(value, float) else str(value).lower() if isinstance(value, bool) else str(value)


def _strip_optional(ann: Any) -> tuple[Any, bool]:
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        if len(args) == 1 and len(args) < len(typing.get_args(ann)):
            return args[0], True
    return ann, False


def _scalar(ann: Any) -> Callable[[str], Any]:
    if ann in (int, float, str, Path):
        return ann
    if ann is bool:
        return _parse_bool
    return str


def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _render_scalar(value: Any) -> str:
    return repr(value) if isinstance(value, float) else str(value)


@dataclass
class _Group:
    """A config class: its fields as leaves, nested groups, via groups or fixed (no flag) fields."""

    cls: type
    title: str | None
    children: dict[str, Any]  # field name -> _Leaf | _Group | _Via | None (fixed)
    optional: _Leaf | None = None  # `X | None` nested with a `Flag.name`: the flag that turns it on


@dataclass
class _Via:
    """Fields built from a flag-shaped dataclass's flags."""

    spec: Flag
    group: _Group
    covers: tuple[str, ...]


def _tree(cls: type, path: str, spec: Flag, title: str | None) -> _Group:
    hints, docs = field_hints(cls), field_docs(cls)
    children: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        own = _spec(f, spec.fields)
        where = f"{path}{f.name}"
        if children.get(f.name) == "covered":
            continue
        if own.skip or (spec.only is not None and f.name not in spec.only):
            children.setdefault(f.name, None)
            continue
        if own.via is not None:
            covers = own.covers or (f.name,)
            group_title = own.group or docs.get(f.name, "").rstrip(".") or title
            children[f.name] = _Via(own, _tree(own.via, where + ".", Flag(only=own.only), group_title), covers)
            for name in covers[1:]:
                children[name] = "covered"
            continue
        ann = hints.get(f.name, Any)
        if ann is Any and f.default_factory is not dataclasses.MISSING:  # a TYPE_CHECKING-only annotation
            ann = type(f.default_factory())
        inner, optional = _strip_optional(ann)
        if dataclasses.is_dataclass(inner) and own.parse is None:
            group_title = own.group or docs.get(f.name, "").rstrip(".") or title
            sub = _tree(inner, where + ".", own, group_title)
            if optional and own.name:  # `X | None`: a flag turns it on, else it is on where the base has one
                name = own.name
                sub.optional = _Leaf(where, name, bool, Flag(), docs.get(f.name, ""), group_title=group_title)
            children[f.name] = sub
            continue
        name = own.name or "--" + spec.prefix + f.name.replace("_", "-")
        children[f.name] = _Leaf(where, name, ann, own, docs.get(f.name, ""), group_title=own.group or title)
    return _Group(cls, title, children)


def _leaves(group: _Group) -> Iterator[_Leaf]:
    if group.optional is not None:
        yield group.optional
    for child in group.children.values():
        if isinstance(child, _Leaf):
            yield child
        elif isinstance(child, _Group):
            yield from _leaves(child)
        elif isinstance(child, _Via):
            yield from _leaves(child.group)


# ---- the public object -----------------------------------------------------------------------------------


class Flags(Generic[C]):
    """The flags of one config class: add them to a parser, build the config from parsed args, render argv.

    Args:
        cls: a frozen dataclass.
        base: the config whose values are the flags' defaults (default: `cls()`); a command whose defaults differ
            from the class's (`swarm demo` shapes links to 100 Mbit/s) passes its own.
        title: --help group of the top-level fields (default: the parser's options).
        spec: how the class's own fields are flags (`Flag.only`, `Flag.fields`, `Flag.prefix`), as for a nested
            config.
    """

    def __init__(self, cls: type[C], *, base: C | None = None, title: str | None = None, spec: Flag | None = None):
        self.cls = cls
        self.base = cls() if base is None else base
        self.tree = _tree(cls, "", spec or Flag(), title)
        self._defaults: dict[str, Any] | None = None
        self.by_name: dict[str, list[_Leaf]] = {}
        for leaf in _leaves(self.tree):
            self.by_name.setdefault(leaf.name, []).append(leaf)

    # -- argparse --

    def add_to(self, parser: argparse.ArgumentParser, *, config_flag: bool = True) -> None:
        """Adds every flag (each shared flag once, in the group of its first field) and `--config FILE` (unless
        told not to: a command whose flags come from several configs adds it with one of them)."""
        groups: dict[str | None, argparse._ActionsContainer] = {g.title: g for g in parser._action_groups[2:]}
        groups[None] = parser
        for leaves in self.by_name.values():
            leaf = leaves[0]
            title = leaf.group_title
            if title not in groups:
                groups[title] = parser.add_argument_group(title)
            leaf.add_to(groups[title], self._default(leaf))
        if config_flag:
            parser.add_argument(
                "--config",
                metavar="FILE",
                default=None,
                help="a TOML file of flags (keys are flag names, `-` or `_`); flags on the command line override it",
            )

    def parser(self, **kwargs: Any) -> argparse.ArgumentParser:
        """A parser of these flags alone."""
        parser = argparse.ArgumentParser(**kwargs)
        self.add_to(parser)
        return parser

    def parse(self, argv: Sequence[str] | None = None) -> C:
        """The config of `argv` (with its `--config FILE` under it)."""
        return self.from_args(self.parser().parse_args(argv))

    def from_args(self, args: argparse.Namespace) -> C:
        """The config of parsed args: the base, under the `--config` file's values, under the flags given.

        Raises:
            SystemExit: the --config file is unreadable, names an unknown key, or holds a bad value.
        """
        return self.build(self.given(args))

    def given(self, args: argparse.Namespace) -> dict[str, Any]:
        """`{flag name without dashes: parsed value}` of the flags given on the command line or in its `--config`
        file (what a command checks against values it gets elsewhere, e.g. an owned run's manifest).

        Raises:
            SystemExit: the --config file is unreadable, names an unknown key, or holds a bad value.
        """
        given = _given(args, self.by_name)
        path = getattr(args, "config", None)
        if path:
            try:
                given = {**self.read_toml(path), **given}
            except ValueError as e:
                raise SystemExit(f"--config {e}") from None
        return given

    def read_toml(self, path: str | Path) -> dict[str, Any]:
        """`{flag: value}` of a TOML file of flags.

        Raises:
            ValueError: the file is unreadable, names a key that is not one of these flags, or holds a bad value;
                the message names the file and the key.
        """
        try:
            import tomllib  # the standard library's from Python 3.11
        except ModuleNotFoundError:
            raise ValueError(f"{path}: reading TOML needs Python 3.11 or later (tomllib)") from None
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ValueError(f"{path}: {e}") from None
        tokens: list[str] = []
        for name, value, where in self._toml_items(data, self.tree, "", str(path)):
            tokens += self.by_name[name][0].tokens(value, where)
        parser = argparse.ArgumentParser(exit_on_error=False, add_help=False)
        self.add_to(parser, config_flag=False)
        try:
            parsed = parser.parse_args(tokens)
        except argparse.ArgumentError as e:
            raise ValueError(f"{path}: {e}") from None
        return _given(parsed, self.by_name)

    def _toml_items(self, data: Mapping[str, Any], group: _Group, section: str, path: str) -> Iterator[tuple]:
        """(flag, value, where) of a TOML table: its keys are flags of `group`'s subtree, or its fields' names;
        a table inside is a nested config (`[train]`, `[train.freeze]`: the field's name), which turns an
        optional one on unless it says `NAME = false` itself."""
        leaves = {leaf.name: leaf for leaf in _leaves(group)}
        fields = {name: child for name, child in group.children.items() if isinstance(child, _Leaf)}
        if group.optional is not None and group.optional.name[2:] not in data and section:
            yield group.optional.name, True, f"{path}: [{section}]"
        for key, value in data.items():
            where = f"{path}: {section}.{key}" if section else f"{path}: {key}"
            field_name, name = key.replace("-", "_"), "--" + key.replace("_", "-")
            if isinstance(value, dict):
                child = group.children.get(field_name)
                if not isinstance(child, (_Group, _Via)):
                    sections = sorted(n for n, c in group.children.items() if isinstance(c, (_Group, _Via)))
                    raise ValueError(
                        f"{path}: [{section + '.' if section else ''}{key}] is not a section of this command's "
                        f"config (sections here: {', '.join(sections) or 'none'})"
                    )
                sub = child if isinstance(child, _Group) else child.group
                yield from self._toml_items(value, sub, f"{section}.{key}" if section else key, path)
            elif field_name in fields:
                yield fields[field_name].name, value, where
            elif name in leaves:
                yield name, value, where
            else:
                if section:
                    raise ValueError(f"{path}: unknown key {key!r} in [{section}] (not a flag or field of it)")
                raise ValueError(f"{path}: unknown key {key!r} (not a flag of this command)")

    # -- building --

    def build(self, given: Mapping[str, Any]) -> C:
        """The config from `{flag name without dashes: parsed value}`; absent flags keep the base's values."""
        return self._build(self.tree, self.base, given)

    def _build(self, group: _Group, base: Any, given: Mapping[str, Any], parsed: bool = True) -> Any:
        if base is None and group.optional is None:  # `X | None` without a flag of its own: on if a flag is given
            if not any(leaf.name[2:] in given for leaf in _leaves(group)):
                return None
            base = group.cls()
        if group.optional is not None:
            on = given.get(group.optional.name[2:], base is not None)
            if not on:
                return None
            base = base if base is not None else group.cls()
        changes: dict[str, Any] = {}
        for name, child in group.children.items():
            if isinstance(child, _Leaf) and child.name[2:] in given:
                value = given[child.name[2:]]
                changes[name] = child.value(value) if parsed else value
            elif isinstance(child, _Group):
                changes[name] = self._build(child, getattr(base, name), given, parsed)
            elif isinstance(child, _Via):
                flags = child.spec.via.of(*(getattr(base, c) for c in child.covers))
                built = self._build(child.group, flags, given, parsed).build()
                changes.update(built if len(child.covers) > 1 else {child.covers[0]: built})
        return dataclasses.replace(base, **changes) if changes else base

    # -- rendering --

    def to_argv(self, config: C, *, all: bool = False, always: Sequence[str] = ()) -> list[str]:  # noqa: A002
        """The argv whose flags rebuild `config` (`parse(to_argv(c)) == c`): the flags whose values differ from
        the base's, and those named in `always` (for a child of another checkout, whose defaults may differ),
        or every flag with `all`.

        Raises:
            ValueError: a field without a flag differs from the base, two fields sharing a flag differ, or a
                value cannot be rendered.
        """
        values: dict[str, Any] = {}
        self._collect(self.tree, config, self.base, values, "")
        unknown = set(always) - set(self.by_name)
        if unknown:
            raise ValueError(f"not flags of {self.cls.__name__}: {sorted(unknown)}")
        argv: list[str] = []
        for name, leaves in self.by_name.items():
            key = name[2:]
            if key not in values:
                continue
            value, default = values[key]
            if all or value != default or name in always:
                argv += leaves[0].render(value)
        rebuilt = self._build(self.tree, self.base, {k: v for k, (v, _) in values.items()}, parsed=False)
        if rebuilt != config:  # a field without a flag differs from the base (fields derived from others do not)
            differ = [f.name for f in dataclasses.fields(config) if getattr(rebuilt, f.name) != getattr(config, f.name)]
            raise ValueError(f"{', '.join(differ)}: not all of it has flags, so it cannot be rendered as argv")
        return argv

    def _collect(self, group: _Group, value: Any, base: Any, out: dict, path: str) -> None:
        if group.optional is None and value is None and base is None:
            value = base = group.cls()  # its flags' defaults, for --help (nothing differs, nothing is rendered)
        elif group.optional is None and (value is None) != (base is None):
            raise ValueError(f"{path.rstrip('.')}: {value!r} cannot be rendered as argv (no flag turns it on or off)")
        if group.optional is not None:
            self._put(out, group.optional, value is not None, base is not None)
            if value is None:  # off: its flags' defaults are the class's (shown in --help, never rendered)
                value = base = group.cls()
            base = base if base is not None else group.cls()
        for name, child in group.children.items():
            mine, theirs = getattr(value, name), getattr(base, name)
            if isinstance(child, _Leaf):
                self._put(out, child, mine, theirs)
            elif isinstance(child, _Group):
                self._collect(child, mine, theirs, out, f"{path}{name}.")
            elif isinstance(child, _Via):
                via = child.spec.via
                mine = [getattr(value, c) for c in child.covers]
                flags, base_flags = via.of(*mine), via.of(*(getattr(base, c) for c in child.covers))
                built = flags.build()
                if (list(built.values()) if len(child.covers) > 1 else [built]) != mine:
                    raise ValueError(f"{path}{name}: {mine!r} cannot be written as {via.__name__}'s flags")
                self._collect(child.group, flags, base_flags, out, f"{path}{name}.")

    def _put(self, out: dict, leaf: _Leaf, value: Any, default: Any) -> None:
        key = leaf.name[2:]
        if key in out and out[key][0] != value:
            raise ValueError(f"{leaf.name} is shared by fields with different values: {out[key][0]!r}, {value!r}")
        out.setdefault(key, (value, default))

    def _default(self, leaf: _Leaf) -> Any:
        if self._defaults is None:
            self._defaults = {}
            self._collect(self.tree, self.base, self.base, self._defaults, "")
        return self._defaults[leaf.name[2:]][0]


def to_argv(config: Any, *, all: bool = False) -> list[str]:  # noqa: A002
    """`Flags(type(config)).to_argv(config)`: the argv whose flags rebuild `config` against the class's defaults."""
    return Flags(type(config)).to_argv(config, all=all)
