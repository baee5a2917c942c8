"""The codec registry: every codec by its name and by its wire enum, checked complete at import.

Names, command-line help, config validation, labels, the planner's bits per element and where a link end
encodes all come from the codecs' own traits (`Codec.TRAITS`, `wire_bits`, `label`, `check`), so a new codec is
its `codec_*` module (a `Codec` subclass listed in the module's `CODECS`), its tests, one entry in
`CODEC_MODULES`, and, because each codec has its own wire enum, one line in proto/wire.proto's `Codec` enum
(then `python scripts/gen_proto.py`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from swarm.compression.codec_base import Codec
from swarm.compression.quantized import SUPPORTED_BITS
from swarm.compression.wire import WireError
from swarm.proto import wire_pb2

if TYPE_CHECKING:
    from swarm.compression.codec_config import CodecConfig

CODEC_MODULES = (
    "codec_raw",
    "codec_directq",
    "codec_aqsgd",
    "codec_gradq",
    "codec_acsgd",
    "codec_tern",
    "codec_bilevel",
    "codec_gsign",
    "codec_gtern",
    "codec_lowrank",
    "codec_mlowrank",
    "codec_topk",
)
"""Modules of swarm.compression that define codecs, in the order names are listed (help, errors)."""


def _load() -> tuple[type[Codec], ...]:
    codecs = tuple(c for m in CODEC_MODULES for c in importlib.import_module(f"swarm.compression.{m}").CODECS)
    for attr in ("name", "wire"):
        seen = [getattr(c, attr) for c in codecs]
        if len(set(seen)) != len(seen) or not all(seen):
            raise ImportError(f"every codec needs its own {attr}; got {dict(zip(codecs, seen, strict=True))}")
    missing = set(wire_pb2.Codec.values()) - {wire_pb2.CODEC_UNSPECIFIED} - {c.wire for c in codecs}
    if missing:  # checked at import: every wire enum has a codec
        raise ImportError(f"codecs missing for wire enums {[wire_pb2.Codec.Name(v) for v in missing]}")
    for c in codecs:  # and every codec says each trait, as a bool (its own or the one it inherits)
        odd = [t for t in Codec.TRAITS if not isinstance(getattr(c, t, None), bool)]
        if odd:
            raise ImportError(f"codec {c.name} must declare {odd} as bools")
    return codecs


_CODECS = _load()
REGISTRY: dict[int, type[Codec]] = {c.wire: c for c in _CODECS}
"""Codec classes by wire enum: what decodes a message."""
BY_NAME: dict[str, type[Codec]] = {c.name: c for c in _CODECS}
"""Codec classes by name: what a config encodes with."""
CODEC_NAMES = tuple(BY_NAME)


def codec_class(name: str) -> type[Codec]:
    """The codec called `name`; an unknown name is a ValueError that lists the known ones."""
    if name not in BY_NAME:
        raise ValueError(f"codec name must be one of {CODEC_NAMES}, got {name!r}")
    return BY_NAME[name]


def codec_labels() -> str:
    """What the command line accepts, for help texts: `fp32, ..., directqN, ..., gradqN[+ef] (N bits: 2, ...)`."""
    labels = [c.name + ("N" if c.quantized else "") + ("[+ef]" if c.error_feedback else "") for c in _CODECS]
    return f"{', '.join(labels)} (N bits: {', '.join(map(str, SUPPORTED_BITS))})"


def make_codec(config: CodecConfig) -> Codec:
    return BY_NAME[config.name](config)


def decoder_for(msg: wire_pb2.TensorMessage, config: CodecConfig | None = None) -> Codec:
    """The codec that reads `msg`; an unknown enum is a clear error."""
    if msg.codec not in REGISTRY:
        raise WireError("codec", f"unknown codec enum {msg.codec}")
    from swarm.compression.codec_config import CodecConfig  # the config module validates names against this one

    cls = REGISTRY[msg.codec]
    return cls(config if config is not None and BY_NAME[config.name] is cls else CodecConfig(name=cls.name))


__all__ = [
    "BY_NAME",
    "CODEC_MODULES",
    "CODEC_NAMES",
    "REGISTRY",
    "Codec",
    "codec_class",
    "codec_labels",
    "decoder_for",
    "make_codec",
]
