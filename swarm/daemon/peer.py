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

import torch

from swarm.options import (
    add_codec_arguments,
    add_dht_arguments,
    add_model_arguments,
    add_shaping_arguments,
    codec_configs,
    dht_config,
    link_shapes,
    model_config,
)
from swarm.peers.allocator import tune_allocator
from swarm.runtime.worker import OptimConfig

log = logging.getLogger("swarm.peer")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="swarm-peer",
        description="Lend this machine to a swarm training run: join the DHT, take a pipeline stage, serve it.",
    )
    add_dht_arguments(parser)
    g = parser.add_argument_group("serving")
    g.add_argument("--grpc-port", type=int, default=0, help="port of the gRPC stage service (0 picks a free one)")
    g.add_argument(
        "--assign",
        choices=["plan", "even"],
        default="plan",
        help="plan: follow the scheduler's plans from the DHT (re-planned on join/leave); "
        "even: an even split by join order, fixed for the run",
    )
    g.add_argument(
        "--num-stages", type=int, default=2, help="pipeline stages of the run (0 with --assign plan: the planner picks)"
    )
    g.add_argument("--stage", type=int, default=None, help="--assign even: serve this stage instead of the split's")
    g.add_argument("--device", default="cpu", help="torch device to compute on (cpu, cuda:0, ...)")
    g.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    g.add_argument(
        "--compute-speed",
        type=float,
        default=0.0,
        help="declare this peer's layers/s instead of measuring it at start-up (0: measure)",
    )
    g.add_argument("--assign-timeout-s", type=float, default=120.0, help="give up if no stage is assigned by then")
    g.add_argument("--announce-ttl-s", type=float, default=30.0, help="lifetime of this peer's DHT announcement")
    g.add_argument("--max-workers", type=int, default=32, help="threads serving gRPC calls")
    g = parser.add_argument_group("planning (--assign plan)")
    g.add_argument("--min-peers", type=int, default=0, help="peers announced before the first plan (0: --num-stages)")
    g.add_argument("--plan-seed", type=int, default=0, help="seed of the planner's search")
    g.add_argument("--probe-bytes", type=int, default=256 << 10, help="bytes sent to measure a link's rate")
    g.add_argument("--probe-peers-per-round", type=int, default=4, help="links measured per probing round")
    g.add_argument("--probe-interval-s", type=float, default=30.0, help="seconds between probing rounds")
    g.add_argument("--probe-refresh-s", type=float, default=240.0, help="re-measure a link after this many seconds")
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
    g.add_argument("--checkpoint-dir", default=None, help="write a safetensors checkpoint of the stage here")
    g.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints (and one at exit)")
    g.add_argument("--resume", action="store_true", help="start from the stage's checkpoint if there is one")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    return parser


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

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self._stop = threading.Event()
        self.following = None  # the PlanRecord this peer serves under, in --assign plan mode
        self.resumed = False

    def stop(self, *_):
        self._stop.set()

    def run(self) -> int:
        from swarm.peers.dht import Heartbeat, SwarmDHT
        from swarm.peers.records import PeerAnnouncement
        from swarm.peers.shaper import LinkShaping
        from swarm.peers.transport import Channels, TransportConfig, make_server
        from swarm.proto import stage_pb2_grpc
        from swarm.runtime.service import StageServicer

        args = self.args
        torch.set_num_threads(args.threads)
        self.model = model_config(args)
        self.codecs = codec_configs(args)
        default_shape, per_link = link_shapes(args)
        self.shaping = LinkShaping(default_shape, per_link)
        dht = SwarmDHT(dht_config(args, announce_ttl_s=args.announce_ttl_s))
        self.dht = dht
        server = None
        try:
            # the gRPC server starts after the DHT's process is forked: forking beside gRPC threads is unsafe
            self.transport = TransportConfig(host=args.host, max_workers=args.max_workers)
            self.channels = Channels(self.transport)
            server, port = make_server(self.transport, args.grpc_port)
            address = f"{args.host}:{port}"
            self.servicer = StageServicer(None)
            stage_pb2_grpc.add_StageServicer_to_server(self.servicer, server)
            server.start()
            log.info("stage service listening on %s", address)
            self.speed = args.compute_speed or measure_compute(self.model, args.device)
            log.info("joined the DHT as %s; compute %.1f layers/s", dht.peer_id, self.speed)
            self.announcement = PeerAnnouncement(
                peer_id=dht.peer_id,
                address=address,
                device=args.device,
                memory_bytes=_memory_bytes(),
                compute_layers_per_s=self.speed,
                started_at=time.time(),
                codec=self.codecs[0].label,
            )
            heartbeat = Heartbeat(dht, lambda: self.announcement).start()
            dht.announce(self.announcement)
            log.info("links shaped to %s", default_shape.describe())
            code = self._follow_plans(address) if args.assign == "plan" else self._serve_even_split()
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
            dht.shutdown()

    # ---- roles ---------------------------------------------------------------------------------------------

    def _make_host(self, role):
        from swarm.net.connect import GrpcConnector
        from swarm.runtime.boundary import LinkEnds
        from swarm.runtime.host import StageHost
        from swarm.runtime.worker import StageConfig

        args = self.args
        optim = OptimConfig(
            lr_peak=args.lr,
            warmup_steps=args.warmup_steps,
            total_steps=args.total_steps,
            grad_clip_norm=args.grad_clip or None,
        )
        host = StageHost(
            role,
            self.model,
            StageConfig(optim=optim),
            LinkEnds(*self.codecs, shaping=self.shaping),
            peer_id=self.dht.peer_id,
            connector=GrpcConnector(self.transport),
            device=args.device,
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
        self.dht.announce(self.announcement)

    def _serve_even_split(self) -> int:
        from swarm.daemon.assign import EvenSplit

        assigner = EvenSplit(self.args.num_stages, self.model.n_layers, self.args.stage)
        role = self._wait_for_role(self.dht, assigner)
        if role is None:
            if self._stop.is_set():
                return 0
            log.error("no stage assigned within %.0f s; leaving", self.args.assign_timeout_s)
            return 3
        log.info("serving stage %d of %d: layers [%d, %d)", role.stage, role.n_stages, role.layer_start, role.layer_end)
        self.servicer.host = self._make_host(role)
        self._announce_role(role)
        log.info("ready")
        while not self._stop.wait(1.0):
            pass
        return 0

    def _follow_plans(self, address: str) -> int:
        """Probes links, plans when this peer leads, and serves whatever the newest plan gives it."""
        from swarm.daemon.planning import LinkProber, Planner, model_spec

        args = self.args
        spec = model_spec(self.model, *self.codecs)
        stages = args.num_stages or None
        prober = LinkProber(
            self.dht,
            address,
            self.shaping,
            self.channels,
            probe_bytes=args.probe_bytes,
            peers_per_round=args.probe_peers_per_round,
            refresh_s=args.probe_refresh_s,
        )
        planner = Planner(self.dht, spec, stages, min_peers=args.min_peers or stages or 1, seed=args.plan_seed)
        deadline = time.monotonic() + args.assign_timeout_s
        next_probe = 0.0
        while not self._stop.is_set():
            try:
                if time.monotonic() >= next_probe:
                    # probe often while peers are new to us, then only to refresh
                    next_probe = time.monotonic() + (1.0 if prober.round() else args.probe_interval_s)
                planner.round()
                record = self.dht.get_plan()
                if record is not None and (self.following is None or record.version > self.following.version):
                    self._apply_plan(record)
            except TimeoutError as e:  # a slow DHT request: try again next tick
                log.warning("%s", e)
            if self.servicer.host is None and self.following is None and time.monotonic() > deadline:
                log.error("no plan gave this peer a stage within %.0f s; leaving", args.assign_timeout_s)
                return 3
            self._stop.wait(0.5)
        return 0

    def _apply_plan(self, record) -> None:
        """Switches to this peer's role under `record`, between two steps, with its layers handed over."""
        from swarm.daemon.planning import role_in_plan

        role = role_in_plan(record, self.dht.peer_id)
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

            self.servicer.when_idle(bump, wait_s)
        else:
            new_host = None if role is None else self._make_host(role)
            if new_host is not None and self.following is not None:
                self._hand_over(new_host, self.following)
            self.servicer.swap(new_host, wait_s, plan_version=record.version)
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
                    state = fetch_state(self.channels, addresses[holder], index, old.version)
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
        deadline = time.monotonic() + self.args.assign_timeout_s
        while time.monotonic() < deadline and not self._stop.is_set():
            role = assigner.assign(dht.peers(), dht.peer_id)
            if role is not None:
                return role
            self._stop.wait(0.5)
        return None

    def _setup_checkpoints(self, host) -> None:
        from swarm.runtime.checkpoint import checkpoint_path, load_stage

        args = self.args
        if not args.checkpoint_dir:
            return
        path = checkpoint_path(args.checkpoint_dir, host.role.stage)
        if args.resume and not self.resumed and path.exists():
            state = load_stage(path, host.worker.module.state_dict())
            host.worker.module.load_state_dict(state)
            self.resumed = True
            log.info("resumed stage %d from %s", host.role.stage, path)

        def on_step(h):
            if h.steps_done % args.checkpoint_every == 0:
                self._checkpoint(h)

        host.on_step = on_step

    def _checkpoint(self, host, final: bool = False) -> None:
        from swarm.runtime.checkpoint import checkpoint_path, save_stage

        if not self.args.checkpoint_dir:
            return
        path = checkpoint_path(self.args.checkpoint_dir, host.role.stage)
        meta = {"stage": str(host.role.stage), "steps_done": str(host.steps_done), "final": str(final)}
        if save_stage(path, host.worker.state_dict(), meta):
            log.info("checkpoint written: %s (step %d)", path, host.steps_done)


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    tune_allocator()
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stdout,
    )
    for noisy in ("hivemind", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    daemon = PeerDaemon(args)
    signal.signal(signal.SIGINT, daemon.stop)
    signal.signal(signal.SIGTERM, daemon.stop)
    return daemon.run()


if __name__ == "__main__":
    sys.exit(main())
