"""The side `swarm bench hostile` attacks: a local 3-stage pipeline's stage servers, in a child process (spawned:
gRPC's threads do not survive a fork), and the identities of its stages, its trainer and a stranger (`Keys`, the one
adapter to `swarm.net.auth`). `Servers` owns the child: its addresses, its RSS, its held handlers, a restart."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from pathlib import Path

import grpc

__all__ = ["HANDLER_SETTLE_S", "N_STAGES", "Keys", "Servers", "codecs", "tiny_model"]

N_STAGES = 3
BUDGET_MAX_WAIT_S = 5.0
"""The stage servers' wait cap (StageBudget.max_wait_s; a swarm-peer's default is 120 s, --max-wait-s): short
here so a case that parks calls ends in seconds."""
BUDGET_ITEM_TIMEOUT_S = 2.0
"""The stage servers' read deadline slack per stream item (StageBudget.item_timeout_s; swarm-peer's: 10 s)."""
BUDGET_LINK_RATE = 100e6
"""The slowest link the servers allow for (StageBudget.min_link_rate_bytes_per_s; swarm-peer's: 1 Mbit/s): loopback,
so a stalled stream is cancelled after about BUDGET_ITEM_TIMEOUT_S, not the half minute a 1 Mbit/s link needs."""
MAX_WORKERS = 32
"""gRPC handler threads per stage server, as swarm-peer's default --max-workers"""
HANDLER_SETTLE_S = 1.0
"""how long a handler may take to end after its reply reached the client before it counts as held"""


# ---- identities: the one adapter to swarm.net.auth -----------------------------------------------------------


class Keys:
    """The identities of the stages, the plan's trainer and a stranger, kept as key files in `directory` so the
    server process loads the same ones. Without `swarm.net.auth` on this tree, peers are named peer0.. and no
    call carries metadata."""

    def __init__(self, directory: Path):
        try:
            from swarm.net import auth
        except ImportError:
            auth = None
        self.auth, self.directory = auth, directory
        if auth is None:
            self.stage_ids = [f"peer{i}" for i in range(N_STAGES)]
            self.trainer_id = self.stranger_id = ""
            return
        self._stages = [auth.Identity.load(directory / f"stage{i}.key") for i in range(N_STAGES)]
        self._trainer = auth.Identity.load(directory / "trainer.key")
        self._stranger = auth.Identity.generate()
        self.stage_ids = [i.peer_id for i in self._stages]
        self.trainer_id, self.stranger_id = self._trainer.peer_id, self._stranger.peer_id
        self._signers = {"trainer": auth.CallSigner(self._trainer), "stranger": auth.CallSigner(self._stranger)}
        self._stage_signers = [auth.CallSigner(i) for i in self._stages]

    def metadata(
        self, who: str, stage: int, method: str | None = None, fields=None, signed: bool = False, now=None
    ) -> tuple[tuple[str, bytes], ...] | None:
        """What a call from `who` ("trainer", "stranger" or "none") to `stage` carries. "trainer" stands for the
        caller the plan allows: the trainer, or for a Forward into stage k > 0 (a Backward into k < last) the
        plan's peer of stage k-1 (k+1), so in-plan cases reach the checks behind authorization. `signed`: with
        the call's proof over `method` and `fields` (its request or first stream item), dated `now` (None: the
        present), else the token alone."""
        if self.auth is None or who == "none":
            return None
        audience = self.stage_ids[stage]
        if who == "trainer" and method == "Forward" and stage > 0:
            signer = self._stage_signers[stage - 1]
        elif who == "trainer" and method == "Backward" and stage < N_STAGES - 1:
            signer = self._stage_signers[stage + 1]
        else:
            signer = self._signers[who]
        if not signed or method is None:
            return signer.metadata(audience)
        from swarm.net.connect import method_path

        return signer.metadata(audience, method_path(method), fields, now=now)

    def token(self, who: str, stage: int, issued_ago_s: float = 0.0) -> tuple[tuple[str, bytes], ...] | None:
        """A token `who` signed `issued_ago_s` seconds ago (an expired one, for a long enough age); None
        without auth."""
        if self.auth is None:
            return None
        signer = self._signers[who]
        token = signer.token(self.stage_ids[stage], now=time.time() - issued_ago_s)
        return ((self.auth.TOKEN_KEY, token),)

    def connector(self, who: str | int):
        """A gRPC connector whose calls carry `who`'s tokens (a stage number: that stage's identity)."""
        from swarm.net.connect import GrpcConnector

        if self.auth is None:
            return GrpcConnector()
        identity = self._stages[who] if isinstance(who, int) else self._trainer
        return GrpcConnector(signer=self.auth.CallSigner(identity))

    def servicer(self, host, stage: int):
        from swarm.runtime.service import StageServicer

        if self.auth is None:
            return StageServicer(host)
        return StageServicer(host, verifier=self.auth.CallVerifier(self.stage_ids[stage]))

    def set_rosters(self, servicers: list, addresses: list[str]) -> None:
        if self.auth is None:
            return
        from swarm.runtime.policy import Roster

        roster = Roster(
            tuple(self.stage_ids), tuple(addresses), frozenset({self.trainer_id}), frozenset(self.stage_ids)
        )
        for servicer in servicers:
            servicer.set_roster(roster)


# ---- the stage servers, in a child process ------------------------------------------------------------------


def tiny_model():
    from swarm.model.gpt import ModelConfig

    return ModelConfig(vocab_size=256, seq_len_tokens=16, hidden_dim=32, n_layers=3, n_heads=2)


def codecs():
    from swarm.compression import CodecConfig

    return CodecConfig.parse("aqsgd2"), CodecConfig.parse("gradq4")


class _CountingExecutor(futures.ThreadPoolExecutor):
    """The servers' handler pool, started full (so spare threads are not mistaken for held ones), counting the
    handlers running now."""

    def __init__(self, max_workers: int):
        super().__init__(max_workers=max_workers, thread_name_prefix="grpc")
        self.busy = 0
        self._lock = threading.Condition()
        barrier = threading.Barrier(max_workers + 1)
        for _ in range(max_workers):
            super().submit(barrier.wait)
        barrier.wait()

    def submit(self, fn, /, *args, **kwargs):
        def counted():
            with self._lock:
                self.busy += 1
            try:
                return fn(*args, **kwargs)
            finally:
                with self._lock:
                    self.busy -= 1
                    self._lock.notify_all()

        return super().submit(counted)

    def held(self, settle_s: float) -> int:
        """Handlers still running after up to `settle_s` for them to end: a handler's reply reaches the client
        a moment before its thread is free again."""
        with self._lock:
            self._lock.wait_for(lambda: self.busy == 0, settle_s)
            return self.busy


def _serve(conn, key_dir: str) -> None:
    """The server process: one gRPC server per stage on 127.0.0.1, answering stats until told to stop."""
    import torch

    from swarm.model.gpt import split_layers
    from swarm.peers.transport import TransportConfig
    from swarm.proto import stage_pb2_grpc
    from swarm.runtime.boundary import LinkEnds
    from swarm.runtime.budget import StageBudget
    from swarm.runtime.host import StageHost, StageRole
    from swarm.runtime.worker import StageConfig

    torch.set_num_threads(1)
    keys, model, (forward, backward) = Keys(Path(key_dir)), tiny_model(), codecs()
    deadlines = dict(item_timeout_s=BUDGET_ITEM_TIMEOUT_S, min_link_rate_bytes_per_s=BUDGET_LINK_RATE)
    budget = StageBudget(max_wait_s=BUDGET_MAX_WAIT_S, **deadlines)
    transport = TransportConfig(max_workers=MAX_WORKERS)
    pools, servers, servicers, addresses = [], [], [], []
    for stage, (start, end) in enumerate(split_layers(model.n_layers, N_STAGES)):
        host = StageHost(
            StageRole(stage, N_STAGES, start, end), model, StageConfig(), LinkEnds(forward, backward),
            keys.stage_ids[stage], keys.connector(stage), budget=budget,
        )  # fmt: skip
        pool = _CountingExecutor(MAX_WORKERS)
        # make_server's options, with a counting pool in place of its HotPool (which thread serves is not measured here)
        server = grpc.server(pool, options=transport.server_options(), maximum_concurrent_rpcs=MAX_WORKERS * 4)
        port = server.add_insecure_port("127.0.0.1:0")
        servicer = keys.servicer(host, stage)
        stage_pb2_grpc.add_StageServicer_to_server(servicer, server)
        server.start()
        pools.append(pool)
        servers.append(server)
        servicers.append(servicer)
        addresses.append(f"127.0.0.1:{port}")
    keys.set_rosters(servicers, addresses)
    conn.send(addresses)
    while True:
        try:
            command = conn.recv()
        except EOFError:
            break
        if command == "stop":
            break
        conn.send({"busy": sum(p.held(HANDLER_SETTLE_S) for p in pools), "threads": threading.active_count()})
    for server in servers:
        server.stop(None)


class Servers:
    """The child process serving the stages; `restart()` replaces it with a fresh one."""

    def __init__(self, key_dir: Path):
        self.key_dir = key_dir
        self._start()

    def _start(self) -> None:
        import multiprocessing

        import psutil

        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(target=_serve, args=(child, str(self.key_dir)), daemon=True, name="bench-stages")
        self._process.start()
        if not self._conn.poll(120):
            self.close()
            raise RuntimeError(f"the stage servers did not start (exit code {self._process.exitcode})")
        self.addresses: list[str] = self._conn.recv()
        self.process = psutil.Process(self._process.pid)

    def stats(self) -> dict:
        """Server RSS (MiB), threads, and handlers running now; {} if the process is gone."""
        try:
            rss = self.process.memory_info().rss / 2**20
            self._conn.send("stats")
            if not self._conn.poll(10 + N_STAGES * HANDLER_SETTLE_S):
                return {"rss_mib": rss}
            return {"rss_mib": rss, **self._conn.recv()}
        except Exception:  # the process died (e.g. killed for memory): the row says so through missing figures
            return {}

    def restart(self) -> None:
        self.close()
        self._start()

    def close(self) -> None:
        try:
            self._conn.send("stop")
        except (BrokenPipeError, OSError):
            pass
        self._process.join(15)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5)
