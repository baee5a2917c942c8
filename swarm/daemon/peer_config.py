"""swarm-peer's configuration: `PeerConfig` (what a peer is told), whose fields are its flags (`swarm.flags`)."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field, replace
from functools import cache
from typing import TYPE_CHECKING

from swarm.compression import DEFAULT_BACKWARD_CODEC, DEFAULT_FORWARD_CODEC, CodecConfig
from swarm.flags import Flag, Flags, flag
from swarm.model.gpt import ModelConfig
from swarm.model.spec import AnyModelConfig
from swarm.options import DHT_FLAGS, MODEL_GROUP, CodecFlags, LinkShaping, ModelFlags
from swarm.peers.records import MAX_PLANNER_LEASE_S
from swarm.peers.shaper import LinkShape
from swarm.peers.transport import TransportConfig
from swarm.runtime.budget import StageBudget
from swarm.runtime.device import check_cpus, check_device, parse_cpus, parse_device, render_cpus
from swarm.runtime.precision import PRECISIONS
from swarm.runtime.worker import OptimConfig

if TYPE_CHECKING:
    from swarm.peers.dht_config import DHTConfig

__all__ = ["PeerConfig", "PlanningConfig", "build_parser", "config_from_args", "peer_flags"]

_PLANNING = "planning (--assign plan)"
_SERVING = "serving"
CODEC_POLICIES = ("fixed", "selective", "per-link")
"""`PlanningConfig.codec_policy`'s choices: what the planner chooses codecs for (nothing, the epilogue, both)."""
_CHECKPOINTS = "checkpoints"


def _default_dht() -> DHTConfig:
    from swarm.peers.dht_config import DHTConfig  # hivemind is slow to import: only when a config is made

    return DHTConfig()


@dataclass(frozen=True)
class PlanningConfig:
    """How a peer following plans (--assign plan) measures its links and plans when it leads."""

    min_peers: int = 0
    """Peers announced before the first plan (0: the run's stage count, or 1 when the planner picks it)."""
    seed: int = field(default=0, metadata=flag(name="--plan-seed"))
    """Seed of the planner's search."""
    probe_bytes: int = 256 << 10
    """Bytes sent to measure a link's rate."""
    peers_per_round: int = field(default=4, metadata=flag(name="--probe-peers-per-round"))
    """Links measured per probing round."""
    interval_s: float = field(default=30.0, metadata=flag(name="--probe-interval-s"))
    """Seconds between probing rounds once every peer has been measured."""
    refresh_s: float = field(default=240.0, metadata=flag(name="--probe-refresh-s"))
    """Re-measure a link after this many seconds."""
    replicas: int = 0
    """Replicas of every stage in a plan (0: the cost model's choice); the other peers stay on standby."""
    heartbeat_s: float = 1.0
    """The planner pings every plan peer's Status this often."""
    gone_after_s: float = 3.0
    """A plan peer silent this long is planned without (eligible again once it answers)."""
    planner_lease_s: float = 3.0
    """The elected planner's lease, renewed every third of it: a dead planner is replaced within about this long.
    Peers' clocks must agree within a fraction of it (leases are DHT time, the wall clock)."""
    probe_links: bool = field(default=True, metadata=flag(name="--link-probe"))
    """Measure links (LinkProber); False (--no-link-probe): measure nothing and plan every link at the assumed
    default (planning.DEFAULT_BYTES_PER_S, 1 ms), without waiting for probes: same peers, same plan, run after run
    (reproducible plans, e.g. for experiments)."""
    micro_batch_size: int = field(default=2, metadata=flag(name="--plan-micro-batch-size"))
    """Samples per micro-batch of the trainers the plan is for (the trainer's --batch-size / --micro-batches):
    the compute measurement and the predicted step use it."""
    micro_batches: int = field(default=4, metadata=flag(name="--plan-micro-batches"))
    """Micro-batches per step of those trainers (the trainer's --micro-batches)."""
    even_layers: bool = field(default=False, metadata=flag(name="--plan-even-layers"))
    """Plan an even layer split (the search still orders and pairs the peers, and predicts the step): runs that
    compare settings keep the same stage boundaries while the plan still says what it predicts."""
    codec_policy: str = field(default="per-link", metadata=flag(choices=CODEC_POLICIES))
    """per-link (the default): the planner chooses each boundary's codecs with the placement, from its measured rate
    and the stages' compute, down to the default codecs as floors (a slow link gets them, a fast one more bits, up to
    fp32, where they hide; `swarm.scheduler.bits`), and the replicas' sums' and the tied sync's from the measured
    links; --fw-codec/--bw-codec are the links' codecs until a plan names theirs. fixed: every link carries
    --fw-codec/--bw-codec and the replicas sum at the floor (2 bits), whatever the links (what experiments comparing
    codec settings run); selective: the links carry those, and the planner chooses the sums' and tied sync's codecs,
    compressing only the exchanges that set the epilogue's length (Optimus-CC's selective stage compression,
    `swarm.scheduler.selective_stages`). Peers apply the plan's."""
    epilogue_only: bool = field(default=False, metadata=flag(name="--plan-epilogue-only"))
    """The planner chooses which backward messages go compressed (Optimus-CC's epilogue-only compression: those on
    the drain's critical path; the others at fp32) from the peers' announced speeds and the probed links, and
    publishes it in the plan (`swarm.scheduler.epilogue_only.plan_epilogue_only`); peers send by the plan's choice
    over their --bw-epilogue. Off by default (docs/reports/optimus.md: equal or quicker where the backward is hidden,
    the same as compressing everything where it is not, for 5x the backward bytes)."""
    calibrate_after_steps: int | None = None
    """The planner re-predicts the plan from its peers' clocks over 4 steps from this many steps in and
    republishes it (`swarm.daemon.calibrate`); None: off (a trainer without the DHT cannot follow the new version)."""
    repack: bool = True
    """When a freezing trainer's stages all froze more layers, the planner repacks the active layers onto fewer
    stages and gives the freed peers to them as replicas, or standbys where they share a plan peer's hardware
    (PipeTransformer; `swarm.daemon.repack`); False (--no-repack): the plan keeps its stages (`swarm experiment
    freezing`'s freeze-only setting)."""
    precision_budget: float = 0.0
    """The planner chooses each stage's precision (fp32/bf16, QSync) from the peers' announced speeds under this
    loss budget, e.g. 1e-3 (summed sensitivity, `swarm.scheduler.precision_choice`); 0: off, every peer computes in its
    --precision."""

    def __post_init__(self) -> None:
        if self.calibrate_after_steps is not None and self.calibrate_after_steps < 0:
            raise ValueError("PlanningConfig: calibrate_after_steps must be >= 0")
        if not (math.isfinite(self.precision_budget) and self.precision_budget >= 0):
            raise ValueError("PlanningConfig: precision_budget must be a finite number >= 0")
        if self.codec_policy not in CODEC_POLICIES:
            choices = ", ".join(CODEC_POLICIES)
            raise ValueError(f"PlanningConfig: codec_policy must be one of {choices}, got {self.codec_policy!r}")
        if self.micro_batch_size < 1 or self.micro_batches < 1:
            raise ValueError("PlanningConfig: micro_batch_size and micro_batches must be >= 1")
        if self.replicas < 0 or self.heartbeat_s <= 0 or self.gone_after_s < self.heartbeat_s:
            raise ValueError("PlanningConfig: need replicas >= 0, heartbeat_s > 0 and gone_after_s >= heartbeat_s")
        if self.min_peers < 0 or self.probe_bytes < 1 or self.peers_per_round < 1:
            raise ValueError("PlanningConfig: need min_peers >= 0, probe_bytes >= 1 and peers_per_round >= 1")
        if self.interval_s <= 0 or self.refresh_s <= 0:
            raise ValueError("PlanningConfig: interval_s and refresh_s must be > 0")
        if not 0.3 <= self.planner_lease_s <= MAX_PLANNER_LEASE_S:
            raise ValueError(f"PlanningConfig: planner_lease_s must be in [0.3, {MAX_PLANNER_LEASE_S:.0f}] s")


_OPTIM_FLAGS = Flag(
    group="optimizer",
    only=("lr_peak", "warmup_steps", "total_steps", "grad_clip_norm"),
    fields={
        "lr_peak": Flag(name="--lr", help="peak learning rate"),
        "warmup_steps": Flag(help="steps of linear learning-rate warm-up"),
        "total_steps": Flag(
            help="steps the cosine decay spans: the run's length, where `swarm train --steps` (or --epochs) must end "
            "too; an owned run's come from its manifest"
        ),
        "grad_clip_norm": Flag(
            name="--grad-clip", parse=float, value=lambda norm: norm or None, render=lambda norm: repr(norm or 0.0),
            help="clip the global gradient norm to this (0 or none = off)",
        ),
    },
)  # fmt: skip
_BUDGET_FLAGS = Flag(
    group=_SERVING,
    only=("max_batch", "max_micro_batches", "max_wait_s", "caller_data_calls", "min_link_rate_bytes_per_s"),
    fields={
        "max_batch": Flag(help="most samples in one micro-batch this stage takes"),
        "max_micro_batches": Flag(help="most micro-batches in one step"),
        "max_wait_s": Flag(help="longest a call may wait here, whatever deadline it asks for"),
        "caller_data_calls": Flag(help="most data calls one peer holds here at once (0: --max-micro-batches + 4)"),
        "min_link_rate_bytes_per_s": Flag(
            help="the slowest link a caller may stream over (default 1 Mbit/s): a stream slower than its bytes at "
            "this rate, plus a slack, is cancelled"
        ),
    },
)
_TRANSPORT_FLAGS = Flag(
    group=_SERVING,
    only=("host", "max_workers"),
    fields={
        "max_workers": Flag(
            help="threads serving gRPC calls: 8 stay free for control calls, the rest serve data calls, which must "
            "exceed --max-micro-batches by 4"
        ),
    },
)


@dataclass(frozen=True)
class PeerConfig:
    """Everything a swarm-peer is told: its fields are its flags (`peer_flags`); tests build it directly."""

    address_file: str | None = field(default=None, metadata=flag(group="DHT"))
    """join through the multiaddrs in this file (as `swarm bootstrap` writes), besides --initial-peers"""
    dht: DHTConfig = field(default_factory=_default_dht, metadata={"flag": DHT_FLAGS})
    """How the peer joins the DHT (its host is also the stage service's) and how long its announcement lives."""
    transport: TransportConfig = field(default_factory=TransportConfig, metadata={"flag": _TRANSPORT_FLAGS})
    """The gRPC stage service's address and bounds."""
    grpc_port: int = field(default=0, metadata=flag(group=_SERVING))
    """port of the gRPC stage service (0 picks a free one)"""
    assign: str = field(default="plan", metadata=flag(choices=("plan", "even"), group=_SERVING))
    """plan: follow the scheduler's plans from the DHT (re-planned on join/leave); even: an even split by join
    order, fixed for the run"""
    num_stages: int = field(default=2, metadata=flag(group=_SERVING))
    """pipeline stages of the run (0 with --assign plan: the planner picks)"""
    stage: int | None = field(default=None, metadata=flag(group=_SERVING))
    """--assign even: serve this stage instead of the split's"""
    device: str = field(default="cpu", metadata=flag(parse=parse_device, metavar="{cpu,cuda,cuda:N}", group=_SERVING))
    """where the stage computes: module, optimizer state and boundary encoding"""
    precision: str = field(default="fp32", metadata=flag(choices=PRECISIONS))
    """compute precision: fp32; bf16 autocast; fp16 autocast with dynamic loss scaling agreed by every stage (a
    non-finite gradient anywhere skips the step everywhere). Weights and optimizer state stay fp32; all stages
    alike (swarm.runtime.precision)"""
    threads: int = field(default=1, metadata=flag(group=_SERVING))
    """torch intra-op threads"""
    cpus: tuple[int, ...] | None = field(
        default=None,
        metadata=flag(parse=parse_cpus, render=render_cpus, metavar="LIST", group=_SERVING),
    )
    """run this peer and its DHT daemons on these CPUs only, a list like 0-3 or 0,2 (Linux's CPU affinity): lend
    part of a machine, or give each of several peers on one machine cores of its own (none: every CPU)"""
    compute_group: str | None = field(default=None, metadata=flag(group=_SERVING))
    """peers announcing the same group share their hardware, so when a repack frees peers (`swarm train
    --freeze`) one of them replicates a stage only if no peer of the plan is in its group (none: peers share
    hardware when they run on one machine's kernel, device and CPU set)"""
    sensitivity_every_steps: int = field(default=5, metadata=flag(group=_SERVING))
    """where the plan asks for it (its planner chooses precisions: --precision-budget), measure the stage's sensitivity
    to bf16 from its real gradients every this many steps (5 times, then every 100) and announce it
    (swarm.runtime.sensitivity_probe; 0: never)"""
    compute_slowdown: float = field(default=1.0, metadata=flag(group=_SERVING))
    """experiments: make this peer N x slower in every precision (it sleeps N - 1 times the time each forward and
    backward took, and announces its measured speeds / N; swarm.runtime.throttle); 1: off"""
    compute_layers_per_s: float = field(default=0.0, metadata=flag(name="--compute-speed", group=_SERVING))
    """declare this peer's forward+backward layers/s instead of measuring it at start-up (0: measure)"""
    assign_timeout_s: float = field(default=120.0, metadata=flag(group=_SERVING))
    """give up if no stage is assigned within this many seconds"""
    announce_host: str | None = field(default=None, metadata=flag(group=_SERVING))
    """IP address other peers dial for this peer's stage service (none: --host, or with --host 0.0.0.0 the
    outward address, detected)"""
    announce_ttl_s: float = field(default=30.0, metadata=flag(group=_SERVING))
    """lifetime of this peer's DHT announcement"""
    auth: bool = field(default=True, metadata=flag(group=_SERVING))
    """Authenticate every call and serve only the plan's peers and trainers; --no-auth: serve anonymous calls
    from anyone (measurement only)"""
    reach: str = field(default="auto", metadata=flag(choices=("auto", "direct", "relay"), group=_SERVING))
    """can others dial this peer? auto: ask a reachable peer to dial back; relay: behave as unreachable (serve
    through a relay; the DHT node runs in client mode), as behind NAT; direct: skip the check (swarm.daemon.nat)"""
    relay: bool = field(default=True, metadata=flag(group=_SERVING))
    """relay for peers behind NAT (--no-relay: do not)"""
    relay_data_port: int | None = field(
        default=0, metadata=flag(parse=int, value=lambda port: None if port < 0 else port, metavar="PORT",
                                 render=lambda port: "-1" if port is None else str(port), group=_SERVING)
    )  # fmt: skip
    """as a relay, carry relayed connections' bytes as plain TCP on this port (swarm.net.splice; 0: any free
    port; -1: none, every relayed byte as gRPC frames on the stage port). Peers behind NAT dial it, and fall back
    to the stage port when they cannot"""
    budget: StageBudget = field(default_factory=StageBudget, metadata={"flag": _BUDGET_FLAGS})
    """What the stage gives its callers at most (rows per micro-batch, micro-batches per step, waits, slots)."""
    planning: PlanningConfig = field(default_factory=PlanningConfig, metadata=flag(group=_PLANNING))
    """Link probing and planning (assign plan)."""
    model: AnyModelConfig = field(default_factory=ModelConfig, metadata=flag(via=ModelFlags, group=MODEL_GROUP))
    """The model; every peer and the trainer must agree (flags: `ModelFlags`)."""
    optim: OptimConfig = field(default_factory=OptimConfig, metadata={"flag": _OPTIM_FLAGS})
    """Optimizer and learning-rate schedule of the stage (defaults from OptimConfig, so a swarm and the
    in-process pipeline train alike unless told otherwise)."""
    fw_codec: CodecConfig = field(
        default_factory=lambda: CodecConfig.parse(DEFAULT_FORWARD_CODEC),
        metadata=flag(via=CodecFlags, covers=("fw_codec", "bw_codec"), group="compression on the links"),
    )
    """Activation codec of the links this peer sends forward on (flags: `CodecFlags`, with bw_codec)."""
    bw_codec: CodecConfig = field(
        default_factory=lambda: CodecConfig.parse(DEFAULT_BACKWARD_CODEC), metadata=flag(skip=True)
    )
    """Gradient codec of the links this peer sends backward on (flags: `CodecFlags`, with fw_codec)."""
    bw_epilogue: str = field(default="", metadata=flag(group="compression on the links"))
    """epilogue-only compression (Optimus-CC): PRECISE:TAILS[:SCHEDULE:MICRO_BATCHES], e.g. fp32:1:1f1b:4 sends
    only the last TAILS backward messages of each boundary's step at --bw-codec and the others at PRECISE
    (`swarm.runtime.epilogue`); empty: every backward message at --bw-codec"""
    link_shape: LinkShape = field(
        default_factory=LinkShape,
        metadata=flag(
            via=LinkShaping,
            covers=("link_shape", "link_shapes"),
            group="link shaping in the application (token bucket + one-way delay)",
        ),
    )
    """Application shaping of every outgoing link (default: none; flags: `LinkShaping`, with link_shapes)."""
    link_shapes: tuple[tuple[str, LinkShape], ...] = field(default=(), metadata=flag(skip=True))
    """(address, shape) of outgoing links shaped differently from `link_shape` (flags: `LinkShaping`)."""
    checkpoint_dir: str | None = field(default=None, metadata=flag(group=_CHECKPOINTS))
    """write a safetensors checkpoint of the stage here (none: no checkpoints)"""
    checkpoint_every: int = field(default=50, metadata=flag(group=_CHECKPOINTS))
    """steps between checkpoints (and one at exit)"""
    resume: bool = field(default=False, metadata=flag(group=_CHECKPOINTS))
    """start from the stage's checkpoint if there is one"""
    replicate_every: int = field(default=20, metadata=flag(group=_CHECKPOINTS))
    """steps between copies of the buddy stage's state kept under --checkpoint-dir/held/ (a copy that survives
    its host)"""
    leave_timeout_s: float = field(default=30.0, metadata=flag(group=_CHECKPOINTS))
    """after SIGTERM, serve this peer's state at most this long for its successor to fetch, then exit"""
    metrics_port: int | None = field(default=None, metadata=flag(group="monitoring"))
    """serve Prometheus metrics at http://HOST:PORT/metrics, HOST being --host (none: off; 0: any port)"""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.compute_slowdown) and self.compute_slowdown >= 1):
            raise ValueError(f"PeerConfig.compute_slowdown: expected a finite number >= 1, got {self.compute_slowdown}")
        if self.sensitivity_every_steps < 0:
            raise ValueError(f"PeerConfig.sensitivity_every_steps: expected >= 0, got {self.sensitivity_every_steps}")
        # the rules that tie fields together, whoever builds the config: 8 of the server's threads stay free for
        # control calls (Status, Probe, Grads, Step); behind NAT nobody can dial the DHT node either, so it joins
        # in client mode (works on hivemind 1.1.12), under auto too until the dial-back finds it reachable
        # (swarm.net.dhtmode upgrades it then)
        object.__setattr__(self, "budget", replace(self.budget, data_calls=max(1, self.transport.max_workers - 8)))
        dht = replace(self.dht, client_mode=self.reach in ("relay", "auto"), announce_ttl_s=self.announce_ttl_s)
        object.__setattr__(self, "dht", dht)
        if self.budget.data_calls < self.budget.max_micro_batches + 4:
            raise ValueError(
                f"PeerConfig: {self.budget.data_calls} data-call threads leave no room for "
                f"{self.budget.max_micro_batches} micro-batches in flight (need --max-micro-batches + 4: raise "
                "--max-workers or lower --max-micro-batches)"
            )
        object.__setattr__(self, "link_shapes", tuple(tuple(pair) for pair in self.link_shapes))
        if self.assign not in ("plan", "even"):
            raise ValueError(f"PeerConfig.assign: expected plan or even, got {self.assign!r}")
        if self.num_stages < (1 if self.assign == "even" else 0):
            raise ValueError(f"PeerConfig.num_stages: {self.num_stages} stages with assign {self.assign}")
        if self.stage is not None and not 0 <= self.stage < max(1, self.num_stages):
            raise ValueError(f"PeerConfig.stage: {self.stage} is not one of {self.num_stages} stages")
        for name in ("grpc_port", "metrics_port"):
            port = getattr(self, name)
            if port is not None and not 0 <= port <= 65535:
                raise ValueError(f"PeerConfig.{name}: expected 0-65535, got {port}")
        if self.threads < 1 or self.checkpoint_every < 1 or self.replicate_every < 1:
            raise ValueError("PeerConfig: threads, checkpoint_every and replicate_every must be >= 1")
        if self.compute_group is not None and not 1 <= len(self.compute_group) <= 128:
            raise ValueError("PeerConfig.compute_group: expected 1 to 128 characters")
        if self.leave_timeout_s < 0:
            raise ValueError("PeerConfig: leave_timeout_s must be >= 0")
        from swarm.runtime.boundary import EpilogueOnly

        EpilogueOnly.parse(self.bw_epilogue)  # a bad value fails here, named
        if self.compute_layers_per_s < 0 or self.assign_timeout_s <= 0:
            raise ValueError("PeerConfig: need compute_layers_per_s >= 0 and assign_timeout_s > 0")


@cache
def peer_flags() -> Flags[PeerConfig]:
    """swarm-peer's flags: `peer_flags().to_argv(config)` is the command line of a peer with that config (made
    on first use: a PeerConfig's DHTConfig imports hivemind, which is slow)."""
    return Flags(PeerConfig)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="swarm-peer",
        description="Lend this machine to a swarm training run: join the DHT, take a pipeline stage, serve it.",
    )
    peer_flags().add_to(parser)
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    return parser


def config_from_args(args: argparse.Namespace) -> PeerConfig:
    """The PeerConfig of swarm-peer's parsed flags, with the --address-file's peers among the initial ones (read
    now: the file is the parent's, written once the bootstrap node is up); a clear DeviceError now when CUDA is
    asked for and absent. With `--run`, the model, codecs and schedule come from the run's manifest (fetched
    from the DHT by id), and a flag that contradicts it raises ValueError naming both values."""
    from swarm.daemon.bootstrap import joined_peers  # hivemind is slow to import: only when a config is made

    cfg = peer_flags().from_args(args)
    check_device(cfg.device)
    if cfg.cpus is not None:
        check_cpus(cfg.cpus)
    dht = replace(cfg.dht, initial_peers=joined_peers(cfg.dht.initial_peers, cfg.address_file))
    if dht.run is not None:  # an owned run: the model, codecs and schedule are the manifest's
        from swarm.daemon.run_cli import manifest_of, with_manifest

        cfg = with_manifest(peer_flags(), args, manifest_of(dht))
    return replace(cfg, dht=dht)
