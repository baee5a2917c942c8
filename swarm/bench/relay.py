"""`swarm bench relay`: what the relay hop costs a call, on loopback, as four processes.

Two stage-like peers P (each serves a Probe that reads a payload and answers `reply_bytes`) attach to a relay R
(another process) and to the caller C (this process, which relays too). One P takes relayed connections by the
relays' raw data ports (`swarm.net.splice`: plain TCP), the other by Accept streams (every socket read a gRPC
frame, as before the data port). C calls P directly; through R (`Connect`: C -> R -> P, two legs); and as P's
relay itself (the reverse connection, no extra hop), each path by frames and by the data port. Alternating
rounds of each: the latency of a small call (median, p90) and the bytes/s of large one-way payloads. Loopback
and Python piping only: the hop's CPU cost, not a network's.

Then (`--floods`, on by default) the flood cases of `swarm.bench.relay_floods` (issue 27): strangers filling a
relay's Connects and Attaches, a relay flooding its peer with AttachDowns, idle connections to the metrics port,
and dial-back answer times for an open and a closed port; threads and descriptors before and at the peak, and
whether the honest peer still gets in. In the JSON under "floods".
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing as mp
import statistics
import time
from dataclasses import dataclass, replace

from swarm.flags import Flags

__all__ = ["add_arguments", "run"]

PATHS = ("direct", "two-legs frames", "two-legs raw", "reverse frames", "reverse raw")


@dataclass(frozen=True)
class RelayBench:
    """`swarm bench relay`: latency and bytes/s of a call through a relay against a direct one."""

    calls: int = 300
    """small calls per path and round"""
    payload_mib: float = 4.0
    """size of one large call's payload"""
    large_calls: int = 10
    """large calls per path and round"""
    rounds: int = 3
    """alternating rounds (direct, relayed)"""
    quick: bool = False
    """a few calls only (a smoke run)"""
    floods: bool = True
    """also run the flood cases (strangers against the relay's, the attached peer's and the metrics port's bounds)"""
    json: bool = False
    """print one JSON object"""

    def run_config(self) -> RelayBench:
        """The run the flags give: --quick is 50 small and 3 large calls of 1 MiB, in 2 rounds."""
        return replace(self, calls=50, large_calls=3, rounds=2, payload_mib=1.0) if self.quick else self


_FLAGS = Flags(RelayBench)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _FLAGS.add_to(parser)


def _serve(role: str, conn, relays: list[tuple[str, str]]) -> None:
    """A child process: R (a relay for any caller, with a data port) or P (a Probe service attached to every relay
    in `relays`; role "raw": by data ports, "frames": by Accept streams); sends back (peer id, address), then
    serves until told to stop."""
    from swarm.net.auth import CallSigner, CallVerifier, Identity
    from swarm.net.relay import Attachment, RelayServicer
    from swarm.peers.transport import TransportConfig, make_server
    from swarm.proto import stage_pb2_grpc

    identity = Identity.generate()
    me = identity.peer_id
    server, port = make_server(TransportConfig(max_workers=16))
    address = f"127.0.0.1:{port}"
    relay = None
    if role == "relay":
        relay = RelayServicer(me, CallVerifier(me), lambda peer: True)
        relay.listen_raw("127.0.0.1")
        stage_pb2_grpc.add_RelayServicer_to_server(relay, server)
    else:
        from swarm.bench.relay_floods import probe_stage

        stage = probe_stage(me, lambda request: b"x" * request.reply_bytes)
        stage_pb2_grpc.add_StageServicer_to_server(stage, server)
    server.start()
    attachments = []
    for target in relays:
        attachment = Attachment(lambda t=target: t, CallSigner(identity), address, raw=role == "raw").start()
        attachment.attached.wait(30)
        attachments.append(attachment)
    conn.send((me, address))
    conn.recv()  # stop
    for attachment in attachments:
        attachment.close()
    if relay is not None:
        relay.close()
    server.stop(grace=None)


def _time(stub, sign, payload: bytes, calls: int, reply_bytes: int = 16) -> list[float]:
    """Times of `calls` Probes, each signed for itself by `sign(request)` (a call's proof is good once), the
    signing included as a real call's is."""
    from swarm.proto import stage_pb2

    request = stage_pb2.ProbeRequest(payload=payload, reply_bytes=reply_bytes)
    out = []
    for _ in range(calls):
        started = time.perf_counter()
        stub.Probe(request, timeout=60, metadata=sign(request))
        out.append(time.perf_counter() - started)
    return out


def run(args: argparse.Namespace) -> int:
    bench = _FLAGS.from_args(args)
    import grpc

    from swarm.net.auth import CallSigner, CallVerifier, Identity
    from swarm.net.connect import method_path
    from swarm.net.relay import RelayRoute, RelayServicer, Tunnels
    from swarm.peers.transport import TransportConfig, make_server
    from swarm.proto import stage_pb2_grpc

    bench = bench.run_config()
    ctx = mp.get_context("spawn")
    identity = Identity.generate()
    me = identity.peer_id
    local = RelayServicer(me, CallVerifier(me), lambda peer: True)  # C relays too: the reverse connection
    local.listen_raw("127.0.0.1")
    server, port = make_server(TransportConfig(max_workers=16))
    stage_pb2_grpc.add_RelayServicer_to_server(local, server)
    server.start()
    c_relay = (me, f"127.0.0.1:{port}")
    ends, procs, channels, tunnels = [], [], {}, []
    try:

        def spawn(role: str, relays: list) -> tuple[str, str]:
            end, child = ctx.Pipe()
            procs.append(ctx.Process(target=_serve, args=(role, child, relays), daemon=True))
            procs[-1].start()
            ends.append(end)
            return end.recv()

        relay_id, relay_address = spawn("relay", [])
        peers = {kind: spawn(kind, [(relay_id, relay_address), c_relay]) for kind in ("frames", "raw")}
        signer = CallSigner(identity)
        routes = {
            f"{kind}.two-legs:1": RelayRoute(peer_id, relay_id, relay_address) for kind, (peer_id, _) in peers.items()
        }
        routes |= {f"{kind}.reverse:1": RelayRoute(peer_id, me, "unused:1") for kind, (peer_id, _) in peers.items()}
        remote, reverse = Tunnels(signer, routes.get), Tunnels(signer, routes.get, local=local)
        tunnels += [remote, reverse]
        options = TransportConfig().channel_options()
        targets = {"direct": (peers["raw"][1], peers["raw"][0])}
        for kind, (peer_id, _) in peers.items():
            targets[f"two-legs {kind}"] = (remote.dial(f"{kind}.two-legs:1"), peer_id)
            targets[f"reverse {kind}"] = (reverse.dial(f"{kind}.reverse:1"), peer_id)
        small, large = b"s" * 64, b"L" * int(bench.payload_mib * (1 << 20))
        lat: dict[str, list[float]] = {k: [] for k in PATHS}
        bulk: dict[str, list[float]] = {k: [] for k in PATHS}
        stubs = {}
        for name in PATHS:  # warm up: connect, first token check
            address, peer_id = targets[name]
            channels[name] = grpc.insecure_channel(address, options=options)
            sign = functools.partial(signer.metadata, peer_id, method_path("Probe"))
            stubs[name] = (stage_pb2_grpc.StageStub(channels[name]), sign)
            _time(*stubs[name], small, 5)
        for _ in range(bench.rounds):
            for name in PATHS:
                lat[name] += _time(*stubs[name], small, bench.calls)
                bulk[name] += _time(*stubs[name], large, bench.large_calls)
        rows = {}
        for name in PATHS:
            ordered = sorted(lat[name])
            rows[name] = {
                "latency_ms_median": 1e3 * statistics.median(ordered),
                "latency_ms_p90": 1e3 * ordered[int(0.9 * (len(ordered) - 1))],
                "mbyte_per_s": len(large) * len(bulk[name]) / sum(bulk[name]) / 1e6,
            }
        direct = rows["direct"]
        for name in PATHS[1:]:
            rows[name]["extra_ms_over_direct"] = rows[name]["latency_ms_median"] - direct["latency_ms_median"]
            rows[name]["bytes_per_s_over_direct"] = rows[name]["mbyte_per_s"] / direct["mbyte_per_s"]
    finally:
        for channel in channels.values():
            channel.close()
        for t in tunnels:
            t.close()
        for end in ends:
            end.send("stop")
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        local.close()
        server.stop(grace=None)
    if bench.floods:
        from swarm.bench.relay_floods import run_floods

        rows["floods"] = run_floods()
    if bench.json:
        print(json.dumps(rows))
    else:
        head = f"{'path':<16} {'median ms':>10} {'p90 ms':>8} {'extra ms':>9} {'MB/s':>8}"
        print(f"{head}   ({bench.payload_mib:g} MiB calls)")
        for name in PATHS:
            r = rows[name]
            extra = r.get("extra_ms_over_direct", 0.0)
            print(
                f"{name:<16} {r['latency_ms_median']:>10.3f} {r['latency_ms_p90']:>8.3f} {extra:>9.3f} "
                f"{r['mbyte_per_s']:>8.1f}"
            )
        for case, row in rows.get("floods", {}).items():
            print(
                f"flood {case}: "
                + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())
            )
    return 0
