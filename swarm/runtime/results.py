"""What one optimizer step did, as the driver reports it: loss, norm, and every byte it put on the wire."""

from __future__ import annotations

from dataclasses import dataclass, field

from swarm.runtime.routing import Traffic

__all__ = ["StepResult"]


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step did."""

    loss: float
    """Mean training loss of the mini-batch, as the last stage computed it (on decoded activations)."""
    grad_norm: float
    """Global gradient norm before clipping."""
    lr: float
    """Learning rate used."""
    traffic: Traffic
    """Bytes on the stage links during the step."""
    seconds: float
    """Wall time of the step."""
    sync_bytes: int = 0
    """Bytes of the tied embedding's gradient sum (the end stages' tied group, compressed with the backward codec
    and paced by the shaper; link "tied" in `traffic`), of the applied attempt."""
    counters: dict[str, float] = field(default_factory=dict)
    """What every counter of the driver's metrics registry gained during the step (snapshot keys)."""
    sample_ids: tuple[int, ...] = ()
    """The samples the applied step trained, each once, route by route."""
    attempts: int = 1
    """Runs of the step: 1, plus one per reroute."""
    dead_peers: tuple[str, ...] = ()
    """Peers declared dead during the step."""
    routes: int = 1
    """Routes the applied step ran on (its CSV column is `chains`)."""
    reduce_bytes: int = 0
    """Bytes the replicas sent each other to sum their gradients (also in `wire_bytes` and `traffic`)."""
    control_bytes: int = 0
    """Bytes of the driver's calls of the step: token and label batches, Reduce/Grads/Step/abandon requests and
    replies, Forward/Backward replies, heartbeat pings and their Status replies, calls of failed attempts;
    serialized protobuf sizes, both directions (gRPC's HTTP/2 framing is not counted anywhere)."""
    total_wire_bytes: int = 0
    """Every byte of the step, over all its attempts: both boundary directions + the tied-embedding sync +
    replica averaging + control. Equal to forward + backward + sync + reduce + control when `attempts` == 1."""
    fp32_total_wire_bytes: int = 0
    """The same tensors in fp32 (the boundaries, sync and averaging at 4 bytes per element, over all attempts)
    plus the same control bytes. The experiments' ratios divide by what an fp32 run actually sent instead
    (zstd beats this raw figure)."""
    skipped: bool = False
    """The global gradient norm was not finite (fp16 overflow somewhere): every stage dropped the step's gradients
    without an optimizer step and backed its loss scale off (`lr` is then 0)."""
    loss_scale: float = 0.0
    """The loss scale every stage holds for the next step (1: unscaled precisions; 0: not known)."""

    @property
    def forward_bytes(self) -> int:
        return self.traffic.forward_bytes

    @property
    def backward_bytes(self) -> int:
        return self.traffic.backward_bytes

    @property
    def fp32_wire_bytes(self) -> int:
        return self.traffic.fp32_wire_bytes

    @property
    def wire_bytes(self) -> int:
        return self.traffic.forward_bytes + self.traffic.backward_bytes + self.reduce_bytes
