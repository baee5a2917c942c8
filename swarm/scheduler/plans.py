"""The scheduler's data: what it plans from (peers, link matrices, the model) and what it outputs (a plan).

Everything here is plain data with units in its names and a JSON form, so a simulated scenario, a file
written by hand and (later) the live DHT all reach the planner through the same `PlanInput`, and a `Plan`
can be published in the DHT as it is.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

COSTED_SCHEDULES = ("1f1b", "gpipe")
"""The pipeline schedules whose steady state the cost model prices (`FullCost.round_trip_pace`: 1F1B's in-flight
bound; GPipe none); the runtime's registry (`swarm.runtime.schedules.SCHEDULES`) may name more than it knows."""

if TYPE_CHECKING:
    from swarm.peers.plan import PlanDocument

__all__ = [
    "Breakdown",
    "LinkLadder",
    "LinkRung",
    "ModelSpec",
    "Peer",
    "Plan",
    "PlanInput",
    "StagePlan",
    "TransformerShape",
]

PLAN_FORMAT = 1  # bumped when the JSON form of a Plan changes incompatibly


@dataclass(frozen=True)
class Peer:
    """One peer as the planner sees it."""

    peer_id: str
    """Stable identity (the DHT peer id in a live swarm)."""
    compute_flops_per_s: float
    """Sustained training throughput, measured or declared (not the datasheet peak)."""
    memory_bytes: float
    """Device memory the peer offers to its stage (weights, optimizer state and activations must fit)."""
    region: str = ""
    """Free-form location label, only for display."""

    def __post_init__(self) -> None:
        if self.compute_flops_per_s <= 0 or self.memory_bytes <= 0:
            raise ValueError(f"peer {self.peer_id}: compute and memory must be positive")


@dataclass(frozen=True)
class LinkRung:
    """One codec a boundary may send with: its label, the bytes of one micro-batch's message, and the seconds one
    message costs to encode and decode on the planner's machine (`swarm.scheduler.sizes.measure_link_rungs`)."""

    label: str
    message_bytes: float
    coding_s: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.message_bytes) and self.message_bytes > 0):
            raise ValueError(f"rung {self.label!r}: message_bytes must be finite and > 0")
        if not (math.isfinite(self.coding_s) and self.coding_s >= 0):
            raise ValueError(f"rung {self.label!r}: coding_s must be finite and >= 0")

    def seconds(self, inverse_bandwidth):
        """One message on a link of `1 / bytes_per_s` (a number or an array): its bytes and its coding."""
        return self.message_bytes * inverse_bandwidth + self.coding_s


@dataclass(frozen=True)
class LinkLadder:
    """The codecs a boundary may take each way, most precise first, down to the loss budget's floors
    (`swarm.scheduler.bits.link_ladder`). With one in the `ModelSpec`, the cost model prices each pair of peers at
    its quickest rung (the search places peers knowing which codec each link would get) instead of at one codec
    for every link."""

    forward: tuple[LinkRung, ...]
    backward: tuple[LinkRung, ...]

    def __post_init__(self) -> None:
        if not self.forward or not self.backward:
            raise ValueError("LinkLadder: each direction needs at least one rung")

    def rung(self, label: str) -> LinkRung:
        """The rung of `label` (either direction)."""
        for r in (*self.forward, *self.backward):
            if r.label == label:
                return r
        raise KeyError(f"no rung {label!r} on the ladder")


@dataclass(frozen=True, eq=False)
class PlanInput:
    """Peers and the measured links between them: everything the planner knows about the swarm.

    Matrices are indexed like `peers`; entry [i, j] describes sending from peer i to peer j. The diagonal is
    never used. A later DHT reader fills this from the peers' announcements and link probes.
    """

    peers: tuple[Peer, ...]
    delay_s: np.ndarray
    """One-way delay of each link, in seconds."""
    bandwidth_bytes_per_s: np.ndarray
    """Throughput of each link, in bytes per second."""
    burst_bytes: np.ndarray | None = None
    """Bytes a link passes at once after an idle spell before its rate applies (a token bucket's depth: tc tbf,
    the application's shaper), measured by the link probe; None: no burst anywhere."""

    def __post_init__(self) -> None:
        n = len(self.peers)
        delay = np.asarray(self.delay_s, dtype=np.float64)
        bandwidth = np.asarray(self.bandwidth_bytes_per_s, dtype=np.float64)
        burst = np.zeros((n, n)) if self.burst_bytes is None else np.asarray(self.burst_bytes, dtype=np.float64)
        if burst.shape != (n, n) or not (np.isfinite(burst) & (burst >= 0)).all():
            raise ValueError(f"burst_bytes must be a {n}x{n} matrix of finite bytes >= 0")
        object.__setattr__(self, "burst_bytes", burst)
        if delay.shape != (n, n) or bandwidth.shape != (n, n):
            raise ValueError(f"matrices must be {n}x{n}, got {delay.shape} and {bandwidth.shape}")
        off = ~np.eye(n, dtype=bool)
        if (delay[off] < 0).any() or not (bandwidth[off] > 0).all():
            raise ValueError("delays must be >= 0 and bandwidths > 0 between distinct peers")
        if len({p.peer_id for p in self.peers}) != n:
            raise ValueError("peer ids must be unique")
        object.__setattr__(self, "delay_s", delay)
        object.__setattr__(self, "bandwidth_bytes_per_s", bandwidth)

    @property
    def n_peers(self) -> int:
        return len(self.peers)

    @property
    def speeds_flops_per_s(self) -> np.ndarray:
        return np.array([p.compute_flops_per_s for p in self.peers])

    @property
    def memories_bytes(self) -> np.ndarray:
        return np.array([p.memory_bytes for p in self.peers])

    def subset(self, indices: list[int] | np.ndarray) -> PlanInput:
        """The same swarm restricted to some peers (in the given order)."""
        idx = np.asarray(indices, dtype=np.int64)
        return PlanInput(
            peers=tuple(self.peers[i] for i in idx),
            delay_s=self.delay_s[np.ix_(idx, idx)],
            bandwidth_bytes_per_s=self.bandwidth_bytes_per_s[np.ix_(idx, idx)],
            burst_bytes=self.burst_bytes[np.ix_(idx, idx)],
        )

    def to_dict(self) -> dict:
        return {
            "peers": [asdict(p) for p in self.peers],
            "delay_s": self.delay_s.tolist(),
            "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s.tolist(),
        }

    @classmethod
    def from_dict(cls, data: dict) -> PlanInput:
        """Reads the JSON form; `bandwidth_gbps` and `delay_ms` are accepted as friendlier alternatives."""
        peers = tuple(Peer(**p) for p in data["peers"])
        if "delay_s" in data:
            delay = np.asarray(data["delay_s"], dtype=np.float64)
        else:
            delay = np.asarray(data["delay_ms"], dtype=np.float64) / 1e3
        if "bandwidth_bytes_per_s" in data:
            bandwidth = np.asarray(data["bandwidth_bytes_per_s"], dtype=np.float64)
        else:
            bandwidth = np.asarray(data["bandwidth_gbps"], dtype=np.float64) * 1e9 / 8
        n = len(peers)
        # The diagonal is unused; a file may leave it as 0 bandwidth.
        bandwidth = np.where(np.eye(n, dtype=bool), np.inf, bandwidth)
        return cls(peers=peers, delay_s=delay, bandwidth_bytes_per_s=bandwidth)

    def save(self, path: str | Path) -> None:
        data = self.to_dict()
        data["bandwidth_bytes_per_s"] = np.where(
            np.isinf(self.bandwidth_bytes_per_s), 0.0, self.bandwidth_bytes_per_s
        ).tolist()
        Path(path).write_text(json.dumps(data))

    @classmethod
    def load(cls, path: str | Path) -> PlanInput:
        return cls.from_dict(json.loads(Path(path).read_text()))


@dataclass(frozen=True)
class TransformerShape:
    """A decoder-only transformer and its training settings, from which the cost model's figures follow."""

    layers: int = 24
    hidden: int = 2048
    seq_len: int = 2048
    micro_batch_size: int = 1
    """Samples per micro-batch."""
    micro_batches: int = 256
    """Micro-batches per training step, over all replicas (the global batch is this x micro_batch_size)."""
    forward_bits: float = 4.0
    """Bits per activation element on the wire, forward (AQ-SGD's quantised deltas)."""
    backward_bits: float = 8.0
    """Bits per activation-gradient element on the wire, backward."""
    gradient_bits: float = 8.0
    """Bits per weight-gradient element exchanged between replicas of a stage (8-bit averaging)."""
    optimizer_bytes_per_param: float = 16.0
    """fp16 weights and gradients, fp32 master weights and two Adam moments."""

    def __post_init__(self) -> None:
        if min(self.layers, self.hidden, self.seq_len, self.micro_batch_size, self.micro_batches) < 1:
            raise ValueError("layers, hidden, seq_len, micro_batch_size and micro_batches must be >= 1")


@dataclass(frozen=True)
class ModelSpec:
    """What the cost model needs to know about the model being trained, in seconds-ready units.

    Build it from a `TransformerShape` (`ModelSpec.transformer`) or write the figures directly (DT-FM's
    settings are `ModelSpec.dtfm`).
    """

    layers: int
    flops_per_layer: float
    """Forward + backward (+ recomputation) FLOPs of one layer for one micro-batch."""
    forward_bytes: float
    """Bytes on the wire per micro-batch from a stage to the next (compressed activations)."""
    backward_bytes: float
    """Bytes on the wire per micro-batch from a stage to the previous (compressed activation gradients)."""
    gradient_bytes_per_layer: float
    """Bytes each replica contributes to its stage's gradient averaging, per layer held."""
    memory_bytes_per_layer: float
    """Weights, gradients and optimizer state of one layer."""
    stash_bytes_per_micro_batch: float = 0.0
    """Activation memory a stage keeps per micro-batch in flight (inputs kept for recomputation)."""
    working_bytes: float = 0.0
    """Activation memory of the one layer being (re)computed."""
    micro_batches: int = 1
    """Micro-batches per step over all replicas; each of R pipelines runs ceil(micro_batches / R)."""
    overlapped_sync_latency: bool = True
    """All-reduce latency: a butterfly all-reduce (hivemind's) sends its parts concurrently, so a replica
    waits for its farthest partner once; DT-FM's model adds every partner's delay in turn."""
    full_duplex: bool = False
    """Links carry both directions at once (TCP over a full-duplex link, the application's shaper): a boundary
    paces at its busier direction, max(forward, backward), instead of their sum (DT-FM's half-duplex view)."""
    step_overhead_s: float = 0.0
    """Fixed time per step outside the pipeline (optimizer step, Grads/Step round trips), measured."""
    tied_bytes: float = 0.0
    """Bytes each end stage sends the other per step to sum the tied embedding's gradient, after the pipeline
    drains and beside the replicas' averaging (0: an untied model); the first stage's members send this."""
    tied_bytes_last: float | None = None
    """Bytes each last-stage member sends per partner, when the two ends' tied gradients differ (the peers
    measured 4.8 kB from the first stage and 14.1 kB from the last at 1 Mbit/s); None: `tied_bytes` too."""
    message_elements: float = 0.0
    """Elements of one boundary message (micro-batch x sequence x hidden), so 4x this is its fp32 size; 0: not
    known. Calibration prices a measured compression ratio by it (`swarm.daemon.calibrate.measured_bytes`)."""
    schedule: str = "1f1b"
    """"1f1b" keeps at most S - k micro-batches in flight on stage k, so a round trip through the later stages
    can pace the steady state; "gpipe" keeps them all in flight (no such bound)."""
    gradient_elements_per_layer: float = 0.0
    """Weight-gradient elements of one layer (what `gradient_bytes_per_layer` carries at some codec's bits); 0: not
    known, read as `gradient_bytes_per_layer` at `TransformerShape.gradient_bits`."""
    tied_shape: tuple[int, int] = (0, 0)
    """The tied weight's (vocab, hidden): its elements, and the matrix a low-rank tied codec factors; (0, 0): not
    known, its elements read back from `tied_bytes` (`swarm.scheduler.selective.tied_elements`)."""
    link_ladder: LinkLadder | None = None
    """The codecs each boundary may take (`--codec-policy per-link`): the cost model prices each pair of peers at
    its quickest rung, so placement and the links' codecs are chosen together; None: every link at
    `forward_bytes` / `backward_bytes` (the configured codecs)."""

    def __post_init__(self) -> None:
        if self.layers < 1 or self.micro_batches < 1:
            raise ValueError("layers and micro_batches must be >= 1")
        for name in (
            "step_overhead_s",
            "tied_bytes",
            "tied_bytes_last",
            "message_elements",
            "gradient_elements_per_layer",
        ):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be finite and >= 0")
        if len(self.tied_shape) != 2 or any(type(n) is not int or n < 0 for n in self.tied_shape):
            raise ValueError(f"tied_shape must be two counts >= 0, got {self.tied_shape!r}")
        if self.schedule not in COSTED_SCHEDULES:
            raise ValueError(
                f"schedule {self.schedule!r}: the cost model prices only {', '.join(COSTED_SCHEDULES)} "
                "(a new schedule in swarm.runtime.schedules.SCHEDULES needs its pace in swarm.scheduler.cost too)"
            )

    @classmethod
    def transformer(cls, shape: TransformerShape) -> ModelSpec:
        """Figures of a GPT-style layer: 12 h^2 parameters; 24 b s h^2 + 4 b s^2 h forward FLOPs, and
        backward twice that plus one recomputed forward (activation checkpointing at stage inputs)."""
        b, s, h = shape.micro_batch_size, shape.seq_len, shape.hidden
        params = 12 * h * h + 13 * h
        forward_flops = 24 * b * s * h * h + 4 * b * s * s * h
        elements = b * s * h
        return cls(
            layers=shape.layers,
            flops_per_layer=4 * forward_flops,
            forward_bytes=elements * shape.forward_bits / 8,
            backward_bytes=elements * shape.backward_bits / 8,
            gradient_bytes_per_layer=params * shape.gradient_bits / 8,
            memory_bytes_per_layer=params * shape.optimizer_bytes_per_param,
            stash_bytes_per_micro_batch=elements * 2,
            working_bytes=elements * 34 + 5 * b * s * s * max(1, h // 128),
            micro_batches=shape.micro_batches,
            message_elements=float(elements),
            gradient_elements_per_layer=float(params),
        )

    @classmethod
    def dtfm(cls, activation_bytes: float, gradient_bytes: float, stages: int = 8, replicas: int = 8) -> ModelSpec:
        """DT-FM's settings: no compute, one micro-batch per pipeline, the same activation size both ways
        and `gradient_bytes` per stage of `layers / stages` layers. Under these the full cost model equals
        DT-FM's data-parallel cost + 2 x pipeline cost (checked by a test)."""
        return cls(
            layers=stages,
            flops_per_layer=0.0,
            forward_bytes=activation_bytes,
            backward_bytes=activation_bytes,
            gradient_bytes_per_layer=gradient_bytes,
            memory_bytes_per_layer=0.0,
            micro_batches=replicas,
            overlapped_sync_latency=False,
        )

    def tied_sent(self, replicas: int) -> np.ndarray:
        """Tied bytes each end-stage member of a 2+ stage plan sends every other one, the first stage's `replicas`
        members then the last's (`tied_bytes`, then `tied_bytes_last` where given)."""
        last = self.tied_bytes if self.tied_bytes_last is None else self.tied_bytes_last
        return np.repeat([self.tied_bytes, last], replicas)

    @property
    def tied(self) -> bool:
        """Whether the end stages exchange a tied gradient at all."""
        return self.tied_bytes > 0 or (self.tied_bytes_last or 0.0) > 0

    def micro_batches_per_pipeline(self, replicas: int) -> int:
        return math.ceil(self.micro_batches / replicas)

    def stage_memory_bytes(self, layers: int, stages: int, replicas: int) -> float:
        """Memory a peer needs to host `layers` layers: 1F1B keeps up to `stages` micro-batches in flight."""
        in_flight = min(stages, self.micro_batches_per_pipeline(replicas))
        return layers * self.memory_bytes_per_layer + in_flight * self.stash_bytes_per_micro_batch + self.working_bytes


@dataclass(frozen=True)
class Breakdown:
    """Predicted time of one training step and where it goes (seconds)."""

    total_s: float
    compute_s: float = 0.0
    """Sum over stages of one micro-batch's forward + backward (pipeline fill and drain)."""
    transfer_s: float = 0.0
    """Sum over boundaries of one micro-batch's activation and gradient transfer (fill and drain)."""
    latency_s: float = 0.0
    """Sum over boundaries of the one-way delays forward and back (fill and drain)."""
    steady_s: float = 0.0
    """The remaining micro-batches at the pace of the slowest stage or link."""
    sync_s: float = 0.0
    """Gradient averaging between the replicas of each stage (the slowest stage's)."""
    pace_s: float = 0.0
    """Time per micro-batch of the slowest stage or link."""
    overhead_s: float = 0.0
    """The model's fixed time per step (`ModelSpec.step_overhead_s`)."""
    tied_s: float = 0.0
    """The end stages' tied-gradient exchange (beside the replicas' averaging: a step waits for the longer)."""


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: its layers and the peers holding it."""

    layer_start: int
    layer_end: int
    """Layers [layer_start, layer_end) of the model."""
    peer_ids: tuple[str, ...]
    """Replica r of this stage sends to replica r of the next: column r is one pipeline."""


@dataclass(frozen=True)
class Plan:
    """The planner's answer: stages in pipeline order, and its predicted step time."""

    stages: tuple[StagePlan, ...]
    breakdown: Breakdown
    cost_model: str
    """"full" (ours) or "dtfm" (DT-FM's data-parallel + 2 x pipeline cost)."""
    version: int = 0
    """Increases each time the swarm re-plans, so peers can tell a newer plan from an older one."""
    unused_peer_ids: tuple[str, ...] = field(default_factory=tuple)
    """Peers left out (too slow, too little memory, or a shape that does not divide them)."""

    @property
    def n_stages(self) -> int:
        return len(self.stages)

    @property
    def n_replicas(self) -> int:
        return len(self.stages[0].peer_ids) if self.stages else 0

    @property
    def step_time_s(self) -> float:
        return self.breakdown.total_s

    def to_dict(self) -> dict:
        return {
            "format": PLAN_FORMAT,
            "version": self.version,
            "cost_model": self.cost_model,
            "step_time_s": self.breakdown.total_s,
            "breakdown": asdict(self.breakdown),
            "stages": [
                {"layer_start": s.layer_start, "layer_end": s.layer_end, "peer_ids": list(s.peer_ids)}
                for s in self.stages
            ],
            "unused_peer_ids": list(self.unused_peer_ids),
        }

    @classmethod
    def from_document(cls, document: PlanDocument) -> Plan:
        """The scheduler's plan a published plan was made from (what `swarm plan --dht` describes): its stages,
        standbys, breakdown (calibrated, once the planner re-predicted it), cost model and version. ValueError for
        a plan that no scheduler of this format made."""
        if document.format != PLAN_FORMAT:
            raise ValueError(f"unknown plan format {document.format!r}")
        if document.breakdown is None or document.cost_model is None or document.version is None:
            raise ValueError("the plan has no breakdown, cost model or version: not a scheduler's plan")
        return cls(
            stages=tuple(StagePlan(s.layer_start, s.layer_end, s.peer_ids) for s in document.stages),
            breakdown=Breakdown(**dict(document.breakdown)),
            cost_model=document.cost_model,
            version=document.version,
            unused_peer_ids=document.unused_peer_ids,
        )

    @classmethod
    def from_dict(cls, data: dict) -> Plan:
        if data.get("format") != PLAN_FORMAT:
            raise ValueError(f"unknown plan format {data.get('format')!r}")
        return cls(
            stages=tuple(StagePlan(s["layer_start"], s["layer_end"], tuple(s["peer_ids"])) for s in data["stages"]),
            breakdown=Breakdown(**data["breakdown"]),
            cost_model=data["cost_model"],
            version=data["version"],
            unused_peer_ids=tuple(data.get("unused_peer_ids", ())),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(json.loads(text))
