"""`swarm-peer`: the daemon volunteers run. It joins the swarm, takes a stage, and serves it until stopped.

Lifecycle: join the DHT -> measure compute speed -> announce -> wait for a stage assignment -> load those
layers (from a checkpoint if one is there) -> serve forward/backward over gRPC, re-announcing on a
heartbeat -> on SIGINT/SIGTERM: stop taking calls, let the current one finish, write a final checkpoint,
leave. Checkpoints are written atomically, so a kill at any moment leaves the previous one intact.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from swarm.compression import CodecConfig
from swarm.metrics import Metrics, MetricsServer, serve_metrics
from swarm.model.gpt import ModelConfig
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
from swarm.peers.allocator import tune_allocator
from swarm.peers.shaper import LinkShape
from swarm.peers.transport import TransportConfig
from swarm.runtime.worker import OptimConfig

if TYPE_CHECKING:
    from swarm.peers.dht import DHTConfig

log = logging.getLogger("swarm.peer")


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

    def __post_init__(self) -> None:
        if self.min_peers < 0 or self.probe_bytes < 1 or self.peers_per_round < 1:
            raise ValueError("PlanningConfig: need min_peers >= 0, probe_bytes >= 1 and peers_per_round >= 1")
        if self.interval_s <= 0 or self.refresh_s <= 0:
            raise ValueError("PlanningConfig: interval_s and refresh_s must be > 0")


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
    threads: int = 1
    """torch intra-op threads."""
    compute_layers_per_s: float = 0.0
    """Declared forward+backward speed, layers/s; 0: measure it at start-up."""
    assign_timeout_s: float = 120.0
    """Leave if no stage is assigned within this many seconds."""
    planning: PlanningConfig = field(default_factory=PlanningConfig)
    """Link probing and planning (assign plan)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The model; every peer and the trainer must agree."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and learning-rate schedule of the stage."""
    fw_codec: CodecConfig = field(default_factory=lambda: CodecConfig.parse("aqsgd2"))
    """Activation codec of the links this peer sends forward on."""
    bw_codec: CodecConfig = field(default_factory=lambda: CodecConfig.parse("gradq4"))
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
    metrics_port: int | None = None
    """Serve the process's metrics at http://HOST:PORT/metrics (HOST: the transport's); None: off, 0: any port."""
    auth: bool = True
    """Authenticate every call and serve only the plan's peers and trainers; False only to measure its cost."""

    def __post_init__(self) -> None:
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
        if self.threads < 1 or self.checkpoint_every < 1:
            raise ValueError("PeerConfig: threads and checkpoint_every must be >= 1")
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
    g.add_argument("--device", default=d.device, help="torch device to compute on (cpu, cuda:0, ...)")
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
    g.add_argument("--announce-ttl-s", type=float, default=30.0, help="lifetime of this peer's DHT announcement")
    g.add_argument("--max-workers", type=int, default=32, help="threads serving gRPC calls")
    g.add_argument("--no-auth", action="store_true", help="serve anonymous calls from anyone (measurement only)")
    g = parser.add_argument_group("planning (--assign plan)")
    g.add_argument(
        "--min-peers", type=int, default=plans.min_peers, help="peers announced before the first plan (0: --num-stages)"
    )
    g.add_argument("--plan-seed", type=int, default=plans.seed, help="seed of the planner's search")
    g.add_argument("--probe-bytes", type=int, default=plans.probe_bytes, help="bytes sent to measure a link's rate")
    g.add_argument(
        "--probe-peers-per-round", type=int, default=plans.peers_per_round, help="links measured per probing round"
    )
    g.add_argument("--probe-interval-s", type=float, default=plans.interval_s, help="seconds between probing rounds")
    g.add_argument(
        "--probe-refresh-s", type=float, default=plans.refresh_s, help="re-measure a link after this many seconds"
    )
    add_model_arguments(parser)
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
    add_metrics_arguments(parser)
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    return parser


def config_from_args(args: argparse.Namespace) -> PeerConfig:
    """The PeerConfig of swarm-peer's flags, the one place they are read (--log-level aside, main's)."""
    fw_codec, bw_codec = codec_configs(args)
    default_shape, per_link = link_shapes(args)
    return PeerConfig(
        dht=dht_config(args, announce_ttl_s=args.announce_ttl_s),
        transport=TransportConfig(host=args.host, max_workers=args.max_workers),
        grpc_port=args.grpc_port,
        assign=args.assign,
        num_stages=args.num_stages,
        stage=args.stage,
        device=args.device,
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
        metrics_port=args.metrics_port,
        auth=not args.no_auth,
    )


def measure_compute(model, device: str, iters: int = 3) -> float:
    """Forward+backward throughput of one block on one reference micro-batch (layers per second)."""
    from swarm.model.gpt import Block

    block = Block(model).to(device)
    x = torch.randn(4, model.seq_len_tokens, model.hidden_dim, device=device, requires_grad=True)
    block(x).sum().backward()  # warm-up
    start = time.perf_counter()
    for _ in range(iters):
        block(x).sum().backward()
    return iters / (time.perf_counter() - start)


class PeerDaemon:
    """One peer's lifetime; `run()` blocks until `stop()` (or a signal) and returns the exit code."""

    def __init__(self, cfg: PeerConfig):
        self.cfg = cfg
        self._stop = threading.Event()
        self.following = None  # the PlanRecord this peer serves under, in --assign plan mode
        self.resumed = False
        self.metrics = Metrics()
        """This process's metrics, served with --metrics-port; what the stage host should count into."""
        self.metrics_server: MetricsServer | None = None

    def stop(self, *_):
        self._stop.set()

    def run(self) -> int:
        from swarm.daemon.roster import AddressBook, PeerAuth
        from swarm.net.connect import SignedChannels
        from swarm.peers.dht import Heartbeat, SwarmDHT
        from swarm.peers.records import PeerAnnouncement
        from swarm.peers.shaper import LinkShaping
        from swarm.peers.transport import Channels, make_server
        from swarm.proto import stage_pb2_grpc
        from swarm.runtime.service import StageServicer

        cfg = self.cfg
        torch.set_num_threads(cfg.threads)
        self.model = cfg.model
        self.codecs = (cfg.fw_codec, cfg.bw_codec)
        self.shaping = LinkShaping(cfg.link_shape, dict(cfg.link_shapes))
        auth = PeerAuth.load(cfg.dht)  # one key signs the DHT records and the calls: its hash is the peer id
        dht = SwarmDHT(cfg.dht, private_key=auth.identity.key)
        self.dht, self.signer, self.book = dht, auth.signer, AddressBook(dht, auth.allowed_trainers)
        server = None
        try:
            # the gRPC and metrics servers start after the DHT's process is forked: forking beside gRPC threads
            # is unsafe, and the DHT's process would hold a copy of the metrics port's listening socket
            if cfg.metrics_port is not None:
                try:
                    self.metrics_server = serve_metrics(self.metrics, cfg.metrics_port, cfg.transport.host)
                except OSError as e:
                    log.error("cannot serve metrics on %s:%d: %s", cfg.transport.host, cfg.metrics_port, e)
                    return 2
                log.info("metrics at %s", self.metrics_server.url)
            self.transport = cfg.transport
            self.channels = SignedChannels(Channels(self.transport), self.signer, self.book)
            server, port = make_server(self.transport, cfg.grpc_port)
            address = f"{cfg.transport.host}:{port}"
            self.servicer = StageServicer(None, auth.verifier() if cfg.auth else None)
            stage_pb2_grpc.add_StageServicer_to_server(self.servicer, server)
            server.start()
            log.info("stage service listening on %s", address)
            self.speed = cfg.compute_layers_per_s or measure_compute(self.model, cfg.device)
            log.info("joined the DHT as %s; compute %.1f layers/s", dht.peer_id, self.speed)
            self.announcement = PeerAnnouncement(
                peer_id=dht.peer_id,
                address=address,
                device=cfg.device,
                memory_bytes=_memory_bytes(),
                compute_layers_per_s=self.speed,
                started_at=time.time(),
                codec=self.codecs[0].label,
            )
            heartbeat = Heartbeat(dht, lambda: self.announcement).start()
            dht.announce(self.announcement)
            log.info("links shaped to %s", cfg.link_shape.describe())
            code = self._follow_plans(address) if cfg.assign == "plan" else self._serve_even_split()
            if code:
                return code
            log.info("stopping: finishing the current call")
            server.stop(grace=5).wait(10)
            host = self.servicer.host
            if host is not None:
                with host.compute_lock:
                    self._checkpoint(host, final=True)
            heartbeat.stop()
            return 0
        finally:
            if server is not None:
                server.stop(grace=None)
            if self.metrics_server is not None:
                self.metrics_server.close()
            dht.shutdown()

    # ---- roles ---------------------------------------------------------------------------------------------

    def _make_host(self, role):
        from swarm.net.connect import GrpcConnector
        from swarm.runtime.boundary import LinkEnds
        from swarm.runtime.host import StageHost
        from swarm.runtime.worker import StageConfig

        cfg = self.cfg
        host = StageHost(
            role,
            self.model,
            StageConfig(optim=cfg.optim),
            LinkEnds(*self.codecs, shaping=self.shaping),
            peer_id=self.dht.peer_id,
            connector=GrpcConnector(self.transport, self.signer, self.book),
            device=cfg.device,
            metrics=self.metrics,
        )
        host.compute_layers_per_s = self.speed
        self._setup_checkpoints(host)
        return host

    def _announce_role(self, role) -> None:
        self.announcement = dataclasses.replace(
            self.announcement,
            stage=None if role is None else role.stage,
            layer_start=None if role is None else role.layer_start,
            layer_end=None if role is None else role.layer_end,
            plan_version=self.following.version if self.following is not None else 0,
        )
        self.metrics.plan_version.set(self.announcement.plan_version)
        self.dht.announce(self.announcement)

    def _serve_even_split(self) -> int:
        from swarm.daemon.assign import EvenSplit

        assigner = EvenSplit(self.cfg.num_stages, self.model.n_layers, self.cfg.stage)
        role = self._wait_for_role(self.dht, assigner)
        if role is None:
            if self._stop.is_set():
                return 0
            log.error("no stage assigned within %.0f s; leaving", self.cfg.assign_timeout_s)
            return 3
        log.info("serving stage %d of %d: layers [%d, %d)", role.stage, role.n_stages, role.layer_start, role.layer_end)
        self.servicer.host = self._make_host(role)
        self._announce_role(role)
        log.info("ready")
        while not self._stop.wait(1.0):  # the split's peers announce one by one, and restart
            self.servicer.set_roster(self.book.even_roster(role.n_stages) or self.servicer.policy.roster)
        return 0

    def _follow_plans(self, address: str) -> int:
        """Probes links, plans when this peer leads, and serves whatever the newest plan gives it."""
        from swarm.daemon.planning import LinkProber, Planner, model_spec

        cfg, plans = self.cfg, self.cfg.planning
        spec = model_spec(self.model, *self.codecs)
        stages = cfg.num_stages or None
        prober = LinkProber(
            self.dht,
            address,
            self.shaping,
            self.channels,
            probe_bytes=plans.probe_bytes,
            peers_per_round=plans.peers_per_round,
            refresh_s=plans.refresh_s,
        )
        planner = Planner(self.dht, spec, stages, min_peers=plans.min_peers or stages or 1, seed=plans.seed)
        deadline = time.monotonic() + cfg.assign_timeout_s
        next_probe = 0.0
        while not self._stop.is_set():
            try:
                if time.monotonic() >= next_probe:
                    # probe often while peers are new to us, then only to refresh
                    next_probe = time.monotonic() + (1.0 if prober.round() else plans.interval_s)
                planner.round()
                record = self.dht.get_plan()
                if record is not None and (self.following is None or record.version > self.following.version):
                    self._apply_plan(record)
                elif self.following is not None and self.servicer.policy.roster is None:
                    self.servicer.set_roster(self.book.plan_roster(self.following, self.announcement))  # was unknown
            except TimeoutError as e:  # a slow DHT request: try again next tick
                log.warning("%s", e)
            if self.servicer.host is None and self.following is None and time.monotonic() > deadline:
                log.error("no plan gave this peer a stage within %.0f s; leaving", cfg.assign_timeout_s)
                return 3
            self._stop.wait(0.5)
        return 0

    def _apply_plan(self, record) -> None:
        """Switches to this peer's role under `record`, between two steps, with its layers handed over."""
        from swarm.daemon.planning import role_in_plan

        role = role_in_plan(record, self.dht.peer_id)
        roster = self.book.plan_roster(record, self.announcement)
        host = self.servicer.host
        same = (
            host is not None
            and role is not None
            and (host.role.stage, host.role.n_stages, host.role.layer_start, host.role.layer_end)
            == (role.stage, role.n_stages, role.layer_start, role.layer_end)
        )
        wait_s = 2 * 120.0
        if same:

            def bump(servicer) -> None:
                servicer.host.role = role  # same layers: only the plan version changes
                servicer.set_roster(roster)

            self.servicer.when_idle(bump, wait_s)
        else:
            new_host = None if role is None else self._make_host(role)
            if new_host is not None and self.following is not None:
                self._hand_over(new_host, self.following)
            self.servicer.swap(new_host, wait_s, plan_version=record.version, roster=roster)
            if roster is None:
                self.servicer.set_roster(None)  # no calls until every stage's address is known
        previous = self.following.version if self.following is not None else 0
        self.following = record
        self._announce_role(role)
        if role is None:
            log.info("plan %d (was %d) leaves this peer on standby", record.version, previous)
        else:
            log.info(
                "plan %d (was %d): serving stage %d of %d, layers [%d, %d)",
                record.version,
                previous,
                role.stage,
                role.n_stages,
                role.layer_start,
                role.layer_end,
            )

    def _hand_over(self, new_host, old) -> None:
        """Loads the layers `new_host` takes over from the peers that held them under the old plan."""
        from swarm.daemon.planning import fetch_state
        from swarm.daemon.roster import retry_refused

        role = new_host.role
        wanted = new_host.worker.module.state_dict()
        addresses = {p.peer_id: p.address for p in self.dht.peers()}
        old_stages = old.plan.get("stages", [])
        loaded: dict[str, torch.Tensor] = {}
        for index, stage in enumerate(old_stages):
            start, end = int(stage["layer_start"]), int(stage["layer_end"])
            overlaps = start < role.layer_end and role.layer_start < end
            ends = (index == 0 and role.is_first) or (index == len(old_stages) - 1 and role.is_last)
            if not (overlaps or ends):
                continue
            holder = stage["peer_ids"][0]
            try:
                if holder == self.dht.peer_id and self.servicer.host is not None:
                    state = self.servicer.host.worker.state_dict()
                elif holder in addresses:
                    # retried: the holder may not follow the new plan (nor serve us its state) yet
                    state = retry_refused(self._stop, fetch_state, self.channels, addresses[holder], index, old.version)
                else:
                    raise ConnectionError("it has left the swarm")
            except Exception as e:
                log.warning("could not take over stage %d of plan %d from %s: %s", index, old.version, holder, e)
                continue
            loaded.update({k: v for k, v in state.items() if k in wanted and v.shape == wanted[k].shape})
        missing = sorted(set(wanted) - set(loaded))
        if loaded:
            new_host.worker.module.load_state_dict(loaded, strict=False)
        log.info(
            "took over %d tensors from plan %d%s",
            len(loaded),
            old.version,
            f"; {len(missing)} start from the initial weights (optimizer state starts fresh)" if missing else "",
        )

    def _wait_for_role(self, dht, assigner):
        deadline = time.monotonic() + self.cfg.assign_timeout_s
        while time.monotonic() < deadline and not self._stop.is_set():
            role = assigner.assign(dht.peers(), dht.peer_id)
            if role is not None:
                return role
            self._stop.wait(0.5)
        return None

    def _setup_checkpoints(self, host) -> None:
        from swarm.runtime.checkpoint import checkpoint_path, load_stage

        cfg = self.cfg
        if not cfg.checkpoint_dir:
            return
        path = checkpoint_path(cfg.checkpoint_dir, host.role.stage)
        if cfg.resume and not self.resumed and path.exists():
            state = load_stage(path, host.worker.module.state_dict())
            host.worker.module.load_state_dict(state)
            self.resumed = True
            log.info("resumed stage %d from %s", host.role.stage, path)

        def on_step(h):
            if h.steps_done % cfg.checkpoint_every == 0:
                self._checkpoint(h)

        host.on_step = on_step

    def _checkpoint(self, host, final: bool = False) -> None:
        from swarm.runtime.checkpoint import checkpoint_path, save_stage

        if not self.cfg.checkpoint_dir:
            return
        path = checkpoint_path(self.cfg.checkpoint_dir, host.role.stage)
        meta = {"stage": str(host.role.stage), "steps_done": str(host.steps_done), "final": str(final)}
        if save_stage(path, host.worker.state_dict(), meta):
            log.info("checkpoint written: %s (step %d)", path, host.steps_done)


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg = config_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    tune_allocator()
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stdout,
    )
    for noisy in ("hivemind", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    daemon = PeerDaemon(cfg)
    signal.signal(signal.SIGINT, daemon.stop)
    signal.signal(signal.SIGTERM, daemon.stop)
    return daemon.run()


if __name__ == "__main__":
    sys.exit(main())
