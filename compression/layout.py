"""Group layouts of the quantized codecs: which elements share a (min, scale) group, and how the wire says so.

"flat" groups `group_size` consecutive elements of the row-major tensor. "channel" gives a 3-D `[B, T, D]`
tensor one group per (sample, channel) across its T tokens, the layout of the AQ-SGD paper's own compressor:
the tensor is permuted to `[B, D, T]` (contiguous) and quantized flat with `group_size = T`, and the decoder
permutes back. A channel of an activation keeps its scale across tokens (a few channels of a transformer's
residual stream are 10x larger than the rest: per-channel groups stop them from inflating every group's step).

A tensor that is not 3-D, or whose T is outside 1..65536 (the wire's group bound), travels flat even when the
config asks for channel; the message's `group_layout` field says which layout it uses, and the receiver decodes
by the message, never by its own config.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from swarm.compression.quantized import group_size
from swarm.compression.wire import WireError
from swarm.proto import wire_pb2

FLAT, CHANNEL = "flat", "channel"
TO_WIRE = {FLAT: wire_pb2.GROUP_LAYOUT_FLAT, CHANNEL: wire_pb2.GROUP_LAYOUT_CHANNEL}
FROM_WIRE = {v: k for k, v in TO_WIRE.items()}
MAX_GROUP = 65536
"""Largest group the wire accepts (`unpack_quantized`)."""


def channel_fits(shape: Sequence[int]) -> bool:
    """Whether a tensor of `shape` can use the channel layout: 3-D with 1..65536 tokens."""
    return len(shape) == 3 and 1 <= shape[1] <= MAX_GROUP


def layout_for(config, shape: Sequence[int]) -> str:
    """The layout a sender uses for a tensor of `shape` under `config` (channel falls back to flat when the
    tensor does not fit it)."""
    return CHANNEL if config.group_layout == CHANNEL and channel_fits(shape) else FLAT


def group_for(config, layout: str, shape: Sequence[int]) -> int:
    """Elements per group: the config's group size when flat, the token count T when channel."""
    return int(shape[1]) if layout == CHANNEL else group_size(config)


def to_groups(x: torch.Tensor, layout: str) -> torch.Tensor:
    """`x` with each group's elements contiguous: `[B, T, D]` -> `[B, D, T]` for channel, `x` itself when flat
    (contiguous either way; a fresh tensor for channel)."""
    if layout == CHANNEL:
        return x.transpose(1, 2).contiguous()
    return x.contiguous()


def from_groups(y: torch.Tensor, layout: str, shape: Sequence[int]) -> torch.Tensor:
    """The inverse of `to_groups`: the elements of `y` (any shape, group order) as a contiguous tensor of
    `shape`."""
    if layout == CHANNEL:
        b, t, d = shape
        return y.reshape(b, d, t).transpose(1, 2).contiguous()
    return y.reshape(tuple(shape))


def write_layout(msg: wire_pb2.TensorMessage, layout: str) -> None:
    """Marks `msg` with `layout` (flat is the proto default, so a flat message stays as small as before)."""
    msg.group_layout = TO_WIRE[layout]


def read_layout(msg: wire_pb2.TensorMessage, shape: Sequence[int], *quantized: wire_pb2.Quantized) -> str:
    """The layout `msg` declares, checked against its shape and the group size of each `quantized` field
    present; raises WireError for an unknown layout, a channel layout on a tensor it does not fit, or a
    group size that is not the token count."""
    if msg.group_layout not in FROM_WIRE:
        raise WireError("group_layout", f"unknown group layout enum {msg.group_layout}")
    layout = FROM_WIRE[msg.group_layout]
    if layout == CHANNEL:
        if not channel_fits(shape):
            raise WireError(
                "group_layout",
                f"the channel layout needs a [B, T, D] tensor with T <= {MAX_GROUP}, got shape {list(shape)}",
            )
        for q in quantized:
            if q.numel and q.group_size != shape[1]:
                raise WireError(
                    "group_layout", f"channel groups are the {shape[1]} tokens, message says group_size {q.group_size}"
                )
    return layout
