"""`swarm bench relay`'s flood cases (issue 27): what a stranger's flood costs a relay, a NAT'd peer, the
metrics port and a dial-back helper, and whether the honest peer still gets in.

Each case runs in this process on loopback (a relay servicer, an attached peer, a trainer named by the plan,
strangers), and reads this process's threads and descriptors with psutil before the flood and at its peak
(sampled every few milliseconds while it runs):

- `connect_fill`: 4 stranger keys open 4 `Connect`s each to one NAT'd peer; how many the relay admits, and
  whether the plan's trainer still reaches the peer.
- `attach_fill`: 7 strangers announced with this relay attach; how many it holds, and whether a NAT'd peer the
  plan names still attaches (evicting one) and how long that took.
- `attachdown_flood`: a relay answers an Attach with 2,000 `AttachDown`s; the attached peer's threads and
  descriptors, and whether it left the relay.
- `metrics_idle`: 400 idle connections to the `/metrics` port; its threads, and whether a scrape is answered.
- `dialback_timing`: answer times of dial-backs aimed at an open (silent) and at a closed port.
"""

from __future__ import annotations

import socket
import statistics
import threading
import time
import urllib.request
from collections.abc import Callable
from contextlib import contextmanager

__all__ = ["CASES", "run_floods"]


def _usage() -> tuple[int, int]:
    import psutil

    me = psutil.Process()
    return me.num_threads(), me.num_fds()


class _Peak:
    """The most threads and descriptors of this process while it runs, and the figures before."""

    def __init__(self):
        self.threads_before, self.fds_before = _usage()
        self.threads, self.fds = self.threads_before, self.fds_before
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-peak", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            threads, fds = _usage()
            self.threads, self.fds = max(self.threads, threads), max(self.fds, fds)

    def __enter__(self) -> _Peak:
        self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        self._stop.set()
        self._thread.join(5)

    def row(self) -> dict:
        return {
            "threads_before": self.threads_before, "threads_peak": self.threads,
            "fds_before": self.fds_before, "fds_peak": self.fds,
        }  # fmt: skip


def _wait(predicate: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@contextmanager
def _server(*servicers, workers: int):
    from swarm.peers.transport import TransportConfig, make_server
    from swarm.proto import stage_pb2_grpc

    server, port = make_server(TransportConfig(max_workers=workers))
    for servicer in servicers:
        if isinstance(servicer, stage_pb2_grpc.RelayServicer):
            stage_pb2_grpc.add_RelayServicer_to_server(servicer, server)
        else:
            stage_pb2_grpc.add_StageServicer_to_server(servicer, server)
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(grace=None)


def probe_stage(peer_id: str, answer=lambda request: bytes(request.payload)):
    """A stage servicer answering only `Probe`, with `answer(request)` as its payload (default: an echo), after
    checking the call's token and proof as a real stage does."""
    import grpc

    from swarm.net.auth import AuthError, CallVerifier
    from swarm.net.connect import method_path
    from swarm.proto import stage_pb2, stage_pb2_grpc

    verifier, path = CallVerifier(peer_id), method_path("Probe")

    class ProbeStage(stage_pb2_grpc.StageServicer):
        def Probe(self, request, context):  # checked as a stage checks its calls: token and this call's proof
            try:
                verifier.call(context.invocation_metadata(), path, request)
            except AuthError as e:
                context.abort(grpc.StatusCode.UNAUTHENTICATED, f"not authenticated: {e}")
            return stage_pb2.ProbeReply(payload=answer(request))

    return ProbeStage()


def connect_fill() -> dict:
    import grpc

    from swarm.net.auth import CallSigner, CallVerifier, Identity
    from swarm.net.connect import method_path
    from swarm.net.relay import Attachment, RelayLimits, RelayRoute, RelayServicer, Tunnels, relay_metadata
    from swarm.proto import stage_pb2, stage_pb2_grpc

    relay_id, peer, trainer = Identity.generate(), Identity.generate(), Identity.generate()
    strangers = [CallSigner(Identity.generate()) for _ in range(4)]
    limits = RelayLimits()
    relay = RelayServicer(
        relay_id.peer_id, CallVerifier(relay_id.peer_id), {peer.peer_id}.__contains__, limits,
        planned={trainer.peer_id}.__contains__,
    )  # fmt: skip
    release, calls, row = threading.Event(), [], {}
    with (
        _server(relay, workers=limits.threads() + 8) as relay_address,
        _server(probe_stage(peer.peer_id), workers=16) as peer_address,
    ):
        attachment = Attachment(lambda: (relay_id.peer_id, relay_address), CallSigner(peer), peer_address, limits)
        attachment.start().attached.wait(10)
        channel = grpc.insecure_channel(relay_address)
        try:
            with _Peak() as peak:
                first = stage_pb2.RelayFrame(target=peer.peer_id)

                def frames():
                    yield first
                    release.wait(60)

                admitted = 0
                for who in strangers:
                    for _ in range(4):
                        calls.append(
                            stage_pb2_grpc.RelayStub(channel).Connect(
                                frames(), metadata=relay_metadata(who, relay_id.peer_id, "Connect", first), timeout=60
                            )
                        )
                        try:
                            next(calls[-1])
                            admitted += 1
                        except grpc.RpcError:
                            pass
                route = RelayRoute(peer.peer_id, relay_id.peer_id, relay_address)
                tunnels = Tunnels(CallSigner(trainer), lambda a: route)
                try:
                    with grpc.insecure_channel(tunnels.dial("p:1")) as ch:
                        step = stage_pb2.ProbeRequest(payload=b"step")
                        md = CallSigner(trainer).metadata(peer.peer_id, method_path("Probe"), step)
                        reply = stage_pb2_grpc.StageStub(ch).Probe(step, timeout=10, metadata=md)
                    trainer_ok = reply.payload == b"step"
                except grpc.RpcError:
                    trainer_ok = False
                finally:
                    tunnels.close()
            row = {"stranger_connects": 16, "admitted": admitted, "trainer_connects": trainer_ok} | peak.row()
        finally:
            release.set()
            for call in calls:
                call.cancel()
            channel.close()
            attachment.close()
    return row


def attach_fill() -> dict:
    from swarm.net.auth import CallSigner, CallVerifier, Identity
    from swarm.net.relay import Attachment, RelayLimits, RelayServicer, Standing

    relay_id = Identity.generate()
    standing: dict[str, Standing] = {}
    limits = RelayLimits()
    relay = RelayServicer(
        relay_id.peer_id, CallVerifier(relay_id.peer_id), lambda p: standing.get(p, Standing.STRANGER), limits
    )
    attachments: list[Attachment] = []
    with _server(relay, workers=limits.threads() + 8) as address:

        def attach(kind: Standing) -> str:
            ident = Identity.generate()
            standing[ident.peer_id] = kind
            attachments.append(Attachment(lambda: (relay_id.peer_id, address), CallSigner(ident), "127.0.0.1:9"))
            attachments[-1].start()
            return ident.peer_id

        try:
            with _Peak() as peak:
                strangers = {attach(Standing.ANNOUNCED) for _ in range(7)}
                _wait(lambda: len(relay.attached()) >= limits.open_attached, 10)
                held = len(relay.attached())
                for _ in range(limits.reserved_attached):  # the plan's NAT'd peers take the reserved slots
                    attach(Standing.PLANNED)
                    attachments[-1].attached.wait(10)
                started = time.monotonic()
                attach(Standing.PLANNED)  # the relay is full now: it evicts a stranger
                planned_ok = attachments[-1].attached.wait(10)
                seconds = time.monotonic() - started
            row = {
                "stranger_attaches": 7, "strangers_held": held, "planned_attaches": limits.reserved_attached + 1,
                "planned_attached": planned_ok, "planned_attach_s": round(seconds, 3),
                "strangers_after": len(set(relay.attached()) & strangers),
            } | peak.row()  # fmt: skip
        finally:
            for a in attachments:
                a.close()
    return row


def attachdown_flood(asked: int = 2000) -> dict:
    from swarm.net.auth import CallSigner, Identity
    from swarm.net.relay import Attachment, RelayLimits
    from swarm.proto import stage_pb2, stage_pb2_grpc

    done = threading.Event()
    accepts = [0]

    class Flooding(stage_pb2_grpc.RelayServicer):
        def Attach(self, request_iterator, context):
            yield stage_pb2.AttachDown(conn_id=0)
            for conn_id in range(1, asked + 1):
                yield stage_pb2.AttachDown(conn_id=conn_id)
            done.wait(30)

        def Accept(self, request_iterator, context):
            accepts[0] += 1
            done.wait(30)
            return iter(())

    peer, relay_id = Identity.generate(), Identity.generate().peer_id
    limits = RelayLimits()
    failed: list = []
    with (
        _server(Flooding(), workers=limits.accepts_per_attach + 8) as relay_address,
        _server(probe_stage(peer.peer_id), workers=16) as peer_address,
        _Peak() as peak,
    ):
        attachment = Attachment(
            lambda: None if failed else (relay_id, relay_address), CallSigner(peer), peer_address, limits,
            on_fail=lambda r, c: failed.append(c),
        ).start()  # fmt: skip
        try:
            _wait(lambda: bool(failed), 20)
            _wait(lambda: accepts[0] >= limits.accepts_per_attach, 5)
        finally:
            done.set()
            attachment.close()
    return {
        "attach_downs": asked, "taken": accepts[0], "bound": limits.accepts_per_attach,
        "dropped": attachment.dropped, "left_relay": bool(failed),
    } | peak.row()  # fmt: skip


def metrics_idle(connections: int = 400) -> dict:
    from swarm.metrics import Metrics, MetricsServerLimits, serve_metrics

    limits = MetricsServerLimits(read_timeout_s=2.0)
    with serve_metrics(Metrics(), 0, limits=limits) as server, _Peak() as peak:
        idle = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(connections)]
        try:
            _wait(lambda: server.dropped >= connections - limits.max_connections, 10)
            try:
                with urllib.request.urlopen(server.url, timeout=10) as reply:
                    scraped = reply.status == 200
            except OSError:
                scraped = False
            open_now = server.open_connections()
            closed_in_time = _wait(lambda: server.open_connections() == 0, 3 * limits.read_timeout_s)
        finally:
            for sock in idle:
                sock.close()
    return {
        "idle_connections": connections, "open_at_once": open_now, "bound": limits.max_connections,
        "scrape_answered": scraped, "idle_closed_by_deadline": closed_in_time,
    } | peak.row()  # fmt: skip


def dialback_timing(rounds: int = 6, timeout_s: float = 1.0) -> dict:
    from swarm.net.auth import CallSigner, Identity
    from swarm.net.reach import DialBackHelper

    silent = socket.create_server(("127.0.0.1", 0), backlog=64)
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        open_address = f"127.0.0.1:{silent.getsockname()[1]}"
        closed_address = f"127.0.0.1:{closed.getsockname()[1]}"
        callers = {f"asker-{i}": (open_address if i % 2 else closed_address) for i in range(2 * rounds)}
        helper = DialBackHelper(
            callers.get, CallSigner(Identity.generate()), timeout_s=timeout_s, max_dials=4 * rounds, interval_s=0.0
        )
        times: dict[str, list[float]] = {open_address: [], closed_address: []}
        try:
            for caller, address in callers.items():
                started = time.perf_counter()
                helper.dial_back(caller, b"n" * 32)
                times[address].append(time.perf_counter() - started)
        finally:
            helper.close()
            silent.close()
    return {
        "dial_timeout_s": timeout_s,
        "open_answer_ms_median": 1e3 * statistics.median(times[open_address]),
        "closed_answer_ms_median": 1e3 * statistics.median(times[closed_address]),
    }


CASES: dict[str, Callable[[], dict]] = {
    "connect_fill": connect_fill,
    "attach_fill": attach_fill,
    "attachdown_flood": attachdown_flood,
    "metrics_idle": metrics_idle,
    "dialback_timing": dialback_timing,
}


def run_floods() -> dict[str, dict]:
    """Every flood case's row, by case name (a case that raised: its error). The relay's own warnings about
    the strangers it refuses are what the cases provoke: kept out of the bench's output."""
    import logging

    quiet = logging.getLogger("swarm.relay")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    rows = {}
    try:
        for name, case in CASES.items():
            try:
                rows[name] = case()
            except Exception as e:  # one broken case does not hide the others' figures
                rows[name] = {"error": f"{type(e).__name__}: {e}"}
    finally:
        quiet.setLevel(level)
    return rows
