"""One stage's ends of its boundaries: codec state per direction, and the data path out and in.

Stage k holds the receiving end of the activations from stage k-1 and the sending end of the gradients back
to it, and the sending end of its activations to stage k+1 and the receiving end of the gradients from it.
The way out is `LinkEnds.outgoing` (encode, then `tensor_items`: frame -> stream items -> pace) and the way
in its mirror (`read_stream`: stream items -> unframe, checked; then `LinkEnds.incoming`: decode); both run
the same in one process and across peers.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from swarm.compression import CodecConfig, LinkState, WireError, WireLimits, ZstdPolicy, make_codec
from swarm.net.stream import Incoming, tensor_items
from swarm.peers.shaper import LinkShaping
from swarm.proto import stage_pb2, wire_pb2

__all__ = ["Direction", "LinkEnds", "need_message"]


@dataclass
class Direction:
    """This stage's end of one direction of one boundary: the codec and its state (AQ-SGD buffers, error
    feedback, rounding draws)."""

    config: CodecConfig
    state: LinkState = field(init=False)

    def __post_init__(self) -> None:
        self.codec = make_codec(self.config)
        self.state = LinkState(self.config)

    @property
    def buffers(self):
        """The AQ-SGD message buffers of this end (None for other codecs)."""
        return self.state.buffers


class LinkEnds:
    """A stage's ends of its two boundaries, their zstd decisions per destination, and the links' shapers.

    Args:
        forward: codec of the activations (both boundaries).
        backward: codec of the activation gradients (both boundaries).
        shaping: the application's link shaping per destination (None: unshaped).
        adaptive_zstd: decide zstd per link from its rate (the swarm); False compresses every message, as an
            in-process pipeline standing for a slow link does.
    """

    def __init__(
        self,
        forward: CodecConfig,
        backward: CodecConfig,
        shaping: LinkShaping | None = None,
        adaptive_zstd: bool = True,
    ):
        self.fw_recv, self.fw_send = Direction(forward), Direction(forward)
        self.bw_recv, self.bw_send = Direction(backward), Direction(backward)
        self.shaping = shaping or LinkShaping()
        self.adaptive_zstd = adaptive_zstd
        self.lock = threading.Lock()
        """Held while a codec state changes: decodes run in the callers' threads, encodes in schedule order."""
        self._zstd: dict[str, ZstdPolicy] = {}

    def end_step(self) -> None:
        with self.lock:
            for end in (self.fw_recv, self.fw_send, self.bw_recv, self.bw_send):
                end.state.end_step()

    def buffered_samples(self) -> int:
        return sum(len(d.buffers) for d in (self.fw_recv, self.fw_send) if d.buffers is not None)

    def forget(self, sample_ids: list[int]) -> None:
        """Drops the sender's AQ-SGD buffers of these samples (the receiver lost them): they go in full next."""
        with self.lock:
            if self.fw_send.buffers is not None:
                self.fw_send.buffers.forget(sample_ids)

    def outgoing(
        self,
        end: Direction,
        tensor: torch.Tensor,
        sample_ids: list[int] | None,
        info: stage_pb2.CallInfo,
        address: str,
    ) -> Iterator[bytes]:
        """The way out: one tensor as the serialized stream items of a call to `address`.

        Encoding happens now, in the caller's (schedule) order; the rest runs as the transport pulls items.
        """
        # encode: AQ-SGD quantizes the change since the sample's last sight and moves the sender's buffer
        with self.lock:
            msg = end.codec.encode(tensor, sample_ids=sample_ids, state=end.state)
        # frame (zstd where it pays on this link) -> stream items (the call info with the first chunk) -> pace
        policy = self._policy(address, end.config.zstd_level)
        return tensor_items(info, msg, end.config.zstd_level, self.shaping.for_destination(address), policy)

    def incoming(self, end: Direction, msg: wire_pb2.TensorMessage, limits: WireLimits) -> torch.Tensor:
        """The way in, the mirror of `outgoing` from the message on (`read_stream` has unframed it, bounds
        checked): decode. AQ-SGD returns the receiver's buffer m for these samples. Runs only after the call
        was admitted, so a refused call changes no codec state."""
        with self.lock:
            return end.codec.decode(msg, state=end.state, limits=limits)

    def _policy(self, address: str, level: int) -> ZstdPolicy:
        with self.lock:
            return self._zstd.setdefault(address, ZstdPolicy(level=level, adaptive=self.adaptive_zstd))


def need_message(call: Incoming) -> wire_pb2.TensorMessage:
    if call.message is None:
        raise WireError("chunk", "the call carries no tensor")
    return call.message
