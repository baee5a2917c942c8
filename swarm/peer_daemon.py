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
from swarm.stage import OptimConfig

log = logging.getLogger("swarm.peer")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="swarm-peer",
        description="Lend this machine to a swarm training run: join the DHT, take a pipeline stage, serve it.",
    )
    add_dht_arguments(parser)
    g = parser.add_argument_group("serving")
    g.add_argument("--grpc-port", type=int, default=0, help="port of the gRPC stage service (0 picks a free one)")
    g.add_argument("--num-stages", type=int, default=2, help="pipeline stages of the run (even split by join order)")
    g.add_argument("--stage", type=int, default=None, help="serve this stage instead of the one the split assigns")
    g.add_argument("--device", default="cpu", help="torch device to compute on (cpu, cuda:0, ...)")
    g.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    g.add_argument("--assign-timeout-s", type=float, default=120.0, help="give up if no stage is assigned by then")
    g.add_argument("--announce-ttl-s", type=float, default=30.0, help="lifetime of this peer's DHT announcement")
    g.add_argument("--max-workers", type=int, default=32, help="threads serving gRPC calls")
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
    from swarm.model import Block

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

    def stop(self, *_):
        self._stop.set()

    def run(self) -> int:
        from swarm.assign import EvenSplit
        from swarm.peers.dht import Heartbeat, SwarmDHT
        from swarm.peers.records import PeerAnnouncement
        from swarm.peers.shaper import LinkShaping
        from swarm.peers.transport import TransportConfig, make_server
        from swarm.proto import stage_pb2_grpc
        from swarm.stage import StageConfig
        from swarm.stage_service import LinkEnds, StageHost, StageServicer

        args = self.args
        torch.set_num_threads(args.threads)
        model = model_config(args)
        fw_cfg, bw_cfg = codec_configs(args)
        default_shape, per_link = link_shapes(args)
        assigner = EvenSplit(args.num_stages, model.n_layers, args.stage)
        dht = SwarmDHT(dht_config(args, announce_ttl_s=args.announce_ttl_s))
        server = None
        try:
            # the gRPC server starts after the DHT's process is forked: forking beside gRPC threads is unsafe
            transport = TransportConfig(host=args.host, max_workers=args.max_workers)
            server, port = make_server(transport, args.grpc_port)
            address = f"{args.host}:{port}"
            servicer = StageServicer(None)
            stage_pb2_grpc.add_StageServicer_to_server(servicer, server)
            server.start()
            log.info("stage service listening on %s", address)
            speed = measure_compute(model, args.device)
            log.info("joined the DHT as %s; compute %.1f layers/s", dht.peer_id, speed)
            started = time.time()
            self.announcement = PeerAnnouncement(
                peer_id=dht.peer_id,
                address=address,
                device=args.device,
                memory_bytes=_memory_bytes(),
                compute_layers_per_s=speed,
                started_at=started,
                codec=fw_cfg.label,
            )
            heartbeat = Heartbeat(dht, lambda: self.announcement).start()
            role = self._wait_for_role(dht, assigner)
            if role is None:
                log.error("no stage assigned within %.0f s; leaving", args.assign_timeout_s)
                return 3
            log.info(
                "serving stage %d of %d: layers [%d, %d)", role.stage, role.n_stages, role.layer_start, role.layer_end
            )
            optim = OptimConfig(
                lr_peak=args.lr,
                warmup_steps=args.warmup_steps,
                total_steps=args.total_steps,
                grad_clip_norm=args.grad_clip or None,
            )
            host = StageHost(
                role,
                model,
                StageConfig(optim=optim),
                LinkEnds(fw_cfg, bw_cfg),
                peer_id=dht.peer_id,
                transport=transport,
                shaping=LinkShaping(default_shape, per_link),
                device=args.device,
            )
            host.compute_layers_per_s = speed
            self._setup_checkpoints(host)
            servicer.host = host
            self.announcement = dataclasses.replace(
                self.announcement,
                stage=role.stage,
                layer_start=role.layer_start,
                layer_end=role.layer_end,
                plan_version=role.plan_version,
            )
            dht.announce(self.announcement)
            log.info("ready: links shaped to %s", default_shape.describe())
            while not self._stop.wait(1.0):
                pass
            log.info("stopping: finishing the current call")
            server.stop(grace=5).wait(10)
            with host.compute_lock:
                self._checkpoint(host, final=True)
            heartbeat.stop()
            return 0
        finally:
            if server is not None:
                server.stop(grace=None)
            dht.shutdown()

    def _wait_for_role(self, dht, assigner):
        deadline = time.monotonic() + self.args.assign_timeout_s
        while time.monotonic() < deadline and not self._stop.is_set():
            role = assigner.assign(dht.peers(), dht.peer_id)
            if role is not None:
                return role
            self._stop.wait(0.5)
        return None

    def _setup_checkpoints(self, host) -> None:
        from swarm.checkpoint import checkpoint_path, load_stage

        args = self.args
        if not args.checkpoint_dir:
            return
        path = checkpoint_path(args.checkpoint_dir, host.role.stage)
        if args.resume and path.exists():
            state = load_stage(path, host.worker.module.state_dict())
            host.worker.module.load_state_dict(state)
            log.info("resumed stage %d from %s", host.role.stage, path)

        def on_step(h):
            if h.steps_done % args.checkpoint_every == 0:
                self._checkpoint(h)

        host.on_step = on_step

    def _checkpoint(self, host, final: bool = False) -> None:
        from swarm.checkpoint import checkpoint_path, save_stage

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
