"""Reads a stage's state (its named fp32 tensors) from the peer that holds it: a joining or repaired peer's
`GetState` call, bounded against a holder that sends too much."""

from __future__ import annotations

import torch

from swarm.compression import CodecConfig, make_codec
from swarm.proto import stage_pb2, stage_pb2_grpc

__all__ = ["MAX_STATE_TENSORS", "fetch_state"]

MAX_STATE_TENSORS = 1 << 14
"""Named tensors one GetState reply may carry (a stage has a few per parameter): more is refused."""


def fetch_state(
    channels,
    address: str,
    stage: int,
    plan_version: int,
    timeout_s: float = 120.0,
    metadata: tuple[tuple[str, str], ...] = (),
    max_bytes: int = 8 << 30,
    max_bytes_per_s: float = 0.0,
    on_call=None,
) -> dict:
    """The named fp32 tensors of `stage` as the peer at `address` held it under `plan_version` (or, with the
    held-range `metadata`, the checkpoint copy it holds). The reply is bounded: at most MAX_STATE_TENSORS
    names, `max_bytes` of bodies, each tensor framed within the wire limits; a name sent twice is refused.
    `max_bytes_per_s` asks the holder to pace the stream (a background copy: `swarm.daemon.replication`); `on_call`
    is given the gRPC call once it is made (so that its owner can cancel it: `Replicator.track`)."""
    from swarm.compression import Unframer, WireError

    fp32 = make_codec(CodecConfig("fp32"))
    stub = stage_pb2_grpc.StageStub(channels.get(address))
    tensors: dict[str, torch.Tensor] = {}
    unframers: dict[str, Unframer] = {}
    received = 0
    call = stub.GetState(
        stage_pb2.StateRequest(stage=stage, plan_version=plan_version, max_bytes_per_s=max_bytes_per_s),
        timeout=timeout_s,
        metadata=metadata or None,
    )
    if on_call is not None:
        on_call(call)
    for item in call:
        if item.name in tensors or (item.name not in unframers and len(unframers) >= MAX_STATE_TENSORS):
            call.cancel()
            raise WireError(f"state from {address}", f"tensor {item.name[:64]!r} repeated or over {MAX_STATE_TENSORS}")
        received += len(item.chunk.data)
        if received > max_bytes:
            call.cancel()
            raise WireError(f"state from {address}", f"over {max_bytes} bytes")
        msg = unframers.setdefault(item.name, Unframer()).feed(item.chunk)
        if msg is not None:
            tensors[item.name] = fp32.decode(msg)
    return tensors
