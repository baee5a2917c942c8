"""swarm-peer's configuration: `PeerConfig` (what a peer is told), its flags, and `config_from_args`."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from swarm.compression import DEFAULT_BW_CODEC, DEFAULT_FW_CODEC, CodecConfig
from swarm.model.gpt import ModelConfig
from swarm.model.spec import AnyModelConfig
from swarm.options import (
    add_codec_arguments,
    add_dht_arguments,
    add_metrics_arguments,
    add_model_arguments,
    add_shaping_arguments,
    codec_configs,
    dht_config,
    link_shapes,
    model_config,
)
from swarm.peers.records import MAX_PLANNER_LEASE_S
from swarm.peers.shaper import LinkShape
from swarm.peers.transport import TransportConfig
from swarm.runtime.budget import StageBudget
from swarm.runtime.device import add_device_argument, check_device
from swarm.runtime.precision import add_precision_argument
from swarm.runtime.worker import OptimConfig

if TYPE_CHECKING:
    from swarm.peers.dht import DHTConfig

__all__ = ["PeerConfig", "PlanningConfig", "build_parser", "config_from_args"]


def _default_dht() -> DHTConfig:
    from swarm.peers.dht import DHTConfig  # hivemind is slow to import: only when a config is made

    return DHTConfig()


@dataclass(frozen=True)
class PlanningConfig:
    """How a peer following plans (--assign plan) measures its links and plans when it leads."""

    min_peers: int = 0
    """Peers announced before the first plan (0: the run's stage count, or 1 when the planner picks it)."""
    seed: int = 0
    """Seed of the planner's search."""
    probe_bytes: int = 256 << 10
    """Bytes sent to measure a link's rate."""
    peers_per_round: int = 4
    """Links measured per probing round."""
    interval_s: float = 30.0
    """Seconds between probing rounds once every peer has been measured."""
    refresh_s: float = 240.0
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
    probe_links: bool = True
    """Measure links (LinkProber); False: measure nothing and plan every link at the assumed default
    (planning.DEFAULT_BYTES_PER_S, 1 ms), without waiting for probes: same peers, same plan, run after run."""
    micro_batch_size: int = 2
    """Samples per micro-batch of the trainers the plan is for (the trainer's --batch-size / --micro-batches):
    the compute measurement and the predicted step use it."""
    micro_batches: int = 4
    """Micro-batches per step of those trainers (the trainer's --micro-batches)."""
    even_layers: bool = False
    """Plan an even layer split (the search still orders and pairs the peers, and predicts the step): runs that
    compare settings keep the same stage boundaries while the plan still says what it predicts."""
    codec_policy: str = "fixed"
    """fixed: every link carries --fw-codec/--bw-codec; per-link: the planner chooses each boundary's codecs from
    its measured rate and the stages' compute (`swarm.scheduler.bits`) and peers apply the plan's."""
    calibrate_after_steps: int | None = None
    """The planner re-predicts the plan from its peers' clocks over 4 steps from this many steps in and
    republishes it (`swarm.daemon.calibrate`); None: off (a trainer without the DHT cannot follow the new version)."""
    precision_budget: float = 0.0
    """The planner chooses each stage's precision (fp32/bf16) from the peers' announced speeds under this loss
    budget (summed sensitivity, `swarm.scheduler.precision`); 0: off, every peer computes in its --precision."""

    def __post_init__(self) -> None:
        if self.calibrate_after_steps is not None and self.calibrate_after_steps < 0:
            raise ValueError("PlanningConfig: calibrate_after_steps must be >= 0")
        if not (math.isfinite(self.precision_budget) and self.precision_budget >= 0):
            raise ValueError("PlanningConfig: precision_budget must be a finite number >= 0")
        if self.codec_policy not in ("fixed", "per-link"):
            raise ValueError(f"PlanningConfig: codec_policy must be fixed or per-link, got {self.codec_policy!r}")
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


@dataclass(frozen=True)
class PeerConfig:
    """Everything a swarm-peer is told: `config_from_args` builds it from the flags, tests directly."""

    dht: DHTConfig = field(default_factory=_default_dht)
    """How the peer joins the DHT (its host is also the stage service's) and how long its announcement lives."""
    transport: TransportConfig = field(default_factory=TransportConfig)
    """The gRPC stage service's address and bounds."""
    grpc_port: int = 0
    """Port of the gRPC stage service; 0 picks a free one."""
    assign: str = "plan"
    """plan: follow the scheduler's plans from the DHT; even: an even split by join order, fixed for the run."""
    num_stages: int = 2
    """Pipeline stages of the run (0 with assign plan: the planner picks)."""
    stage: int | None = None
    """With assign even: serve this stage instead of the split's."""
    device: str = "cpu"
    """torch device to compute on."""
    precision: str = "fp32"
    """Compute precision (swarm.runtime.precision): fp32, bf16, or fp16 with loss scaling; all stages alike."""
    threads: int = 1
    """torch intra-op threads."""
    compute_layers_per_s: float = 0.0
    """Declared forward+backward speed, layers/s; 0: measure it at start-up."""
    assign_timeout_s: float = 120.0
    """Leave if no stage is assigned within this many seconds."""
    planning: PlanningConfig = field(default_factory=PlanningConfig)
    """Link probing and planning (assign plan)."""
    model: AnyModelConfig = field(default_factory=ModelConfig)
    """The model; every peer and the trainer must agree."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and learning-rate schedule of the stage."""
    fw_codec: CodecConfig = field(default_factory=lambda: CodecConfig.parse(DEFAULT_FW_CODEC))
    """Activation codec of the links this peer sends forward on."""
    bw_codec: CodecConfig = field(default_factory=lambda: CodecConfig.parse(DEFAULT_BW_CODEC))
    """Gradient codec of the links this peer sends backward on."""
    link_shape: LinkShape = field(default_factory=LinkShape)
    """Application shaping of every outgoing link (default: none)."""
    link_shapes: tuple[tuple[str, LinkShape], ...] = ()
    """(address, shape) of outgoing links shaped differently from `link_shape`."""
    checkpoint_dir: str | None = None
    """Folder of the stage's safetensors checkpoints; None: no checkpoints."""
    checkpoint_every: int = 50
    """Steps between checkpoints (and one at exit)."""
    resume: bool = False
    """Start from the stage's checkpoint if there is one."""
    replicate_every: int = 20
    """Steps between pulls of the buddy stage's state into --checkpoint-dir/held/ (a copy that survives its host)."""
    leave_timeout_s: float = 30.0
    """After SIGTERM, serve this peer's state at most this long for its successor to fetch, then exit."""
    metrics_port: int | None = None
    """Serve the process's metrics at http://HOST:PORT/metrics (HOST: the transport's); None: off, 0: any port."""
    announce_host: str | None = None
    """IP address other peers dial for the stage service; None: the listening host, detected if a wildcard."""
    auth: bool = True
    reach: str = "auto"
    """--reach: auto (dial-back check), direct or relay (swarm.daemon.nat)"""
    relay: bool = True
    """relay for peers behind NAT (--no-relay: False)"""
    relay_data_port: int | None = 0
    """the relay's raw data port (swarm.net.splice): relayed bytes as plain TCP; 0: any free port; None: none
    (every relayed byte goes as gRPC frames)"""
    budget: StageBudget = field(default_factory=StageBudget)
    """What the stage gives its callers at most (rows per micro-batch, micro-batches per step, waits, slots)."""
    """Authenticate every call and serve only the plan's peers and trainers; False only to measure its cost."""

    def __post_init__(self) -> None:
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
        if self.leave_timeout_s < 0:
            raise ValueError("PeerConfig: leave_timeout_s must be >= 0")
        if self.compute_layers_per_s < 0 or self.assign_timeout_s <= 0:
            raise ValueError("PeerConfig: need compute_layers_per_s >= 0 and assign_timeout_s > 0")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="swarm-peer",
        description="Lend this machine to a swarm training run: join the DHT, take a pipeline stage, serve it.",
    )
    add_dht_arguments(parser)
    d, plans = PeerConfig, PlanningConfig
    g = parser.add_argument_group("serving")
    g.add_argument(
        "--grpc-port", type=int, default=d.grpc_port, help="port of the gRPC stage service (0 picks a free one)"
    )
    g.add_argument(
        "--assign",
        choices=["plan", "even"],
        default=d.assign,
        help="plan: follow the scheduler's plans from the DHT (re-planned on join/leave); "
        "even: an even split by join order, fixed for the run",
    )
    g.add_argument(
        "--num-stages",
        type=int,
        default=d.num_stages,
        help="pipeline stages of the run (0 with --assign plan: the planner picks)",
    )
    g.add_argument("--stage", type=int, default=d.stage, help="--assign even: serve this stage instead of the split's")
    add_device_argument(g, default=d.device)
    g.add_argument("--threads", type=int, default=d.threads, help="torch intra-op threads")
    g.add_argument(
        "--compute-speed",
        type=float,
        default=d.compute_layers_per_s,
        help="declare this peer's layers/s instead of measuring it at start-up (0: measure)",
    )
    g.add_argument(
        "--assign-timeout-s", type=float, default=d.assign_timeout_s, help="give up if no stage is assigned by then"
    )
    g.add_argument(
        "--announce-host",
        default=None,
        help="IP address other peers dial for this peer's stage service (default: --host, or with --host 0.0.0.0 "
        "the outward address, detected)",
    )
    g.add_argument("--announce-ttl-s", type=float, default=30.0, help="lifetime of this peer's DHT announcement")
    g.add_argument(
        "--max-workers",
        type=int,
        default=32,
        help="threads serving gRPC calls: 8 stay free for control calls, the rest serve data calls, which must "
        "exceed --max-micro-batches by 4",
    )
    g.add_argument("--no-auth", action="store_true", help="serve anonymous calls from anyone (measurement only)")
    g.add_argument(
        "--reach", choices=("auto", "direct", "relay"), default=d.reach,
        help="can others dial this peer? auto: ask a reachable peer to dial back; relay: behave as unreachable "
        "(serve through a relay; the DHT node runs in client mode), as behind NAT; direct: skip the check",
    )  # fmt: skip
    g.add_argument("--no-relay", action="store_true", help="do not relay for peers behind NAT (default: relay)")
    g.add_argument(
        "--relay-data-port", type=int, default=d.relay_data_port, metavar="PORT",
        help="as a relay, carry relayed connections' bytes as plain TCP on this port (0: any free port; -1: none, "
        "every relayed byte as gRPC frames on the stage port). Peers behind NAT dial it, and fall back to the "
        "stage port when they cannot",
    )  # fmt: skip
    budget = StageBudget()
    g.add_argument(
        "--max-batch", type=int, default=budget.max_batch, help="most samples in one micro-batch this stage takes"
    )
    g.add_argument(
        "--max-micro-batches", type=int, default=budget.max_micro_batches, help="most micro-batches in one step"
    )
    g.add_argument(
        "--max-wait-s",
        type=float,
        default=budget.max_wait_s,
        help="longest a call may wait here, whatever deadline it asks for",
    )
    g = parser.add_argument_group("planning (--assign plan)")
    g.add_argument(
        "--min-peers", type=int, default=plans.min_peers, help="peers announced before the first plan (0: --num-stages)"
    )
    g.add_argument(
        "--replicas",
        type=int,
        default=plans.replicas,
        help="replicas of every stage (0: the cost model's choice); other peers stay on standby",
    )
    g.add_argument(
        "--heartbeat-s", type=float, default=plans.heartbeat_s, help="the planner pings plan peers' Status this often"
    )
    g.add_argument(
        "--gone-after-s",
        type=float,
        default=plans.gone_after_s,
        help="a plan peer silent to the heartbeats this long is planned without",
    )
    g.add_argument(
        "--planner-lease-s",
        type=float,
        default=plans.planner_lease_s,
        help="the elected planner's lease, renewed every third of it: a dead planner is replaced about this fast",
    )
    g.add_argument("--plan-seed", type=int, default=plans.seed, help="seed of the planner's search")
    g.add_argument(
        "--plan-micro-batch-size",
        type=int,
        default=plans.micro_batch_size,
        help="samples per micro-batch of the trainers (their --batch-size / --micro-batches): what the plan predicts",
    )
    g.add_argument(
        "--plan-micro-batches", type=int, default=plans.micro_batches, help="micro-batches per step of the trainers"
    )
    g.add_argument(
        "--codec-policy",
        choices=("fixed", "per-link"),
        default=plans.codec_policy,
        help="fixed: --fw-codec/--bw-codec on every link; per-link: the planner chooses each boundary's codecs",
    )
    g.add_argument(
        "--calibrate-after-steps",
        type=int,
        default=plans.calibrate_after_steps,
        help="re-predict the plan from the peers' measured clocks over 4 steps from N steps in, and republish it",
    )
    g.add_argument(
        "--precision-budget",
        type=float,
        default=plans.precision_budget,
        help="plan each stage's precision (fp32/bf16, QSync) under this loss budget, e.g. 1e-3; 0: off",
    )
    g.add_argument(
        "--plan-even-layers",
        action="store_true",
        help="plan an even layer split (peers still ordered and the step still predicted)",
    )
    g.add_argument(
        "--link-probe",
        action=argparse.BooleanOptionalAction,
        default=plans.probe_links,
        help="measure the links to other peers for the planner; --no-link-probe: measure nothing, plan every link "
        "at the default speed (reproducible plans, e.g. for experiments)",
    )
    g.add_argument("--probe-bytes", type=int, default=plans.probe_bytes, help="bytes sent to measure a link's rate")
    g.add_argument(
        "--probe-peers-per-round", type=int, default=plans.peers_per_round, help="links measured per probing round"
    )
    g.add_argument("--probe-interval-s", type=float, default=plans.interval_s, help="seconds between probing rounds")
    g.add_argument(
        "--probe-refresh-s", type=float, default=plans.refresh_s, help="re-measure a link after this many seconds"
    )
    add_model_arguments(parser)
    add_precision_argument(parser)
    # defaults come from OptimConfig so a swarm and the in-process pipeline train alike unless told otherwise
    optim = OptimConfig()
    g = parser.add_argument_group("optimizer")
    g.add_argument("--lr", type=float, default=optim.lr_peak, help="peak learning rate (default: %(default)s)")
    g.add_argument("--warmup-steps", type=int, default=optim.warmup_steps, help="steps of linear learning-rate warm-up")
    g.add_argument("--total-steps", type=int, default=optim.total_steps, help="steps the cosine decay spans")
    g.add_argument(
        "--grad-clip",
        type=float,
        default=optim.grad_clip_norm or 0.0,
        help="clip the global gradient norm to this (0 = off)",
    )
    add_codec_arguments(parser)
    parser.add_argument_group("compression on the links").add_argument(
        "--buffer-dir", default=None, help="keep AQ-SGD buffers in memory-mapped files here (data larger than RAM)"
    )
    add_shaping_arguments(parser)
    g = parser.add_argument_group("checkpoints")
    g.add_argument(
        "--checkpoint-dir", default=d.checkpoint_dir, help="write a safetensors checkpoint of the stage here"
    )
    g.add_argument(
        "--checkpoint-every", type=int, default=d.checkpoint_every, help="steps between checkpoints (and one at exit)"
    )
    g.add_argument("--resume", action="store_true", help="start from the stage's checkpoint if there is one")
    g.add_argument(
        "--replicate-every",
        type=int,
        default=d.replicate_every,
        help="steps between copies of the buddy stage's state kept under --checkpoint-dir/held/",
    )
    g.add_argument(
        "--leave-timeout-s",
        type=float,
        default=d.leave_timeout_s,
        help="after SIGTERM, serve this peer's state at most this long for its successor, then exit",
    )
    add_metrics_arguments(parser)
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    return parser


def config_from_args(args: argparse.Namespace) -> PeerConfig:
    """The PeerConfig of swarm-peer's flags, the one place they are read (--log-level aside, main's)."""
    fw_codec, bw_codec = codec_configs(args)
    default_shape, per_link = link_shapes(args)
    return PeerConfig(
        # behind NAT nobody can dial the DHT node either: it joins in client mode (works on hivemind 1.1.12); under
        # auto too, until the dial-back finds it reachable (swarm.net.dhtmode upgrades it then)
        dht=dht_config(args, announce_ttl_s=args.announce_ttl_s, client_mode=args.reach in ("relay", "auto")),
        transport=TransportConfig(host=args.host, max_workers=args.max_workers),
        grpc_port=args.grpc_port,
        assign=args.assign,
        num_stages=args.num_stages,
        stage=args.stage,
        device=check_device(args.device),  # a clear DeviceError now when CUDA is asked for and absent
        precision=args.precision,
        threads=args.threads,
        compute_layers_per_s=args.compute_speed,
        assign_timeout_s=args.assign_timeout_s,
        planning=PlanningConfig(
            min_peers=args.min_peers,
            seed=args.plan_seed,
            probe_bytes=args.probe_bytes,
            peers_per_round=args.probe_peers_per_round,
            interval_s=args.probe_interval_s,
            refresh_s=args.probe_refresh_s,
            replicas=args.replicas,
            heartbeat_s=args.heartbeat_s,
            gone_after_s=args.gone_after_s,
            planner_lease_s=args.planner_lease_s,
            probe_links=args.link_probe,
            micro_batch_size=args.plan_micro_batch_size,
            micro_batches=args.plan_micro_batches,
            even_layers=args.plan_even_layers,
            codec_policy=args.codec_policy,
            calibrate_after_steps=args.calibrate_after_steps,
            precision_budget=args.precision_budget,
        ),
        model=model_config(args),
        optim=OptimConfig(
            lr_peak=args.lr,
            warmup_steps=args.warmup_steps,
            total_steps=args.total_steps,
            grad_clip_norm=args.grad_clip or None,
        ),
        fw_codec=fw_codec,
        bw_codec=bw_codec,
        link_shape=default_shape,
        link_shapes=tuple(per_link.items()),
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        resume=args.resume,
        replicate_every=args.replicate_every,
        leave_timeout_s=args.leave_timeout_s,
        metrics_port=args.metrics_port,
        announce_host=args.announce_host,
        auth=not args.no_auth,
        reach=args.reach,
        relay=not args.no_relay,
        relay_data_port=None if args.relay_data_port < 0 else args.relay_data_port,
        budget=StageBudget(
            max_batch=args.max_batch,
            max_micro_batches=args.max_micro_batches,
            max_wait_s=args.max_wait_s,
            # 8 of the server's threads stay free for control calls (Status, Probe, Grads, Step)
            data_calls=max(1, args.max_workers - 8),
        ),
    )
