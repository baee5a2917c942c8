"""`swarm bench relay`: what the relay hop costs a call, on loopback, as three processes.

P serves a stage-like service (its Probe reads a payload and answers `reply_bytes`) and attaches to relay R
(another process); the caller C (this process) calls P directly, and through R (`Connect`: C -> R -> P over a
tunnel). Alternating rounds of each: the latency of a small call (median, p90) and the bytes/s of large
one-way payloads. Loopback and Python piping only: the hop's CPU cost, not a network's.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--calls", type=int, default=300, help="small calls per path and round")
    parser.add_argument("--payload-mib", type=float, default=4.0, help="size of one large call's payload")
    parser.add_argument("--large-calls", type=int, default=10, help="large calls per path and round")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (direct, relayed)")
    parser.add_argument("--quick", action="store_true", help="a few calls only (a smoke run)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _serve(role: str, conn, relay: tuple[str, str] | None) -> None:
    """A child process: P (a Probe service, attached to `relay`) or R (a relay for any caller); sends back
    (peer id, address, key bytes), then serves until told to stop."""
    from swarm.net.auth import CallSigner, CallVerifier, Identity
    from swarm.net.relay import Attachment, RelayServicer
    from swarm.peers.transport import TransportConfig, make_server
    from swarm.proto import stage_pb2, stage_pb2_grpc

    identity = Identity.generate()
    me = identity.peer_id
    server, port = make_server(TransportConfig(max_workers=16))
    address = f"127.0.0.1:{port}"
    attachment = None
    if role == "relay":
        stage_pb2_grpc.add_RelayServicer_to_server(RelayServicer(me, CallVerifier(me), lambda peer: True), server)
    else:
        verifier = CallVerifier(me)

        class Stage(stage_pb2_grpc.StageServicer):
            def Probe(self, request, context):
                verifier.caller(context.invocation_metadata())
                return stage_pb2.ProbeReply(payload=b"x" * request.reply_bytes)

        stage_pb2_grpc.add_StageServicer_to_server(Stage(), server)
    server.start()
    if relay is not None:
        attachment = Attachment(lambda: relay, CallSigner(identity), address).start()
        attachment.attached.wait(30)
    conn.send((me, address))
    conn.recv()  # stop
    if attachment is not None:
        attachment.close()
    server.stop(grace=None)


def _time(stub, metadata, payload: bytes, calls: int, reply_bytes: int = 16) -> list[float]:
    from swarm.proto import stage_pb2

    request = stage_pb2.ProbeRequest(payload=payload, reply_bytes=reply_bytes)
    out = []
    for _ in range(calls):
        started = time.perf_counter()
        stub.Probe(request, timeout=60, metadata=metadata)
        out.append(time.perf_counter() - started)
    return out


def run(args: argparse.Namespace) -> int:
    import grpc

    from swarm.net.auth import CallSigner, Identity
    from swarm.net.relay import RelayRoute, Tunnels
    from swarm.peers.transport import TransportConfig
    from swarm.proto import stage_pb2_grpc

    if args.quick:
        args.calls, args.large_calls, args.rounds, args.payload_mib = 50, 3, 2, 1.0
    ctx = mp.get_context("spawn")
    ends, procs = [], []
    try:
        r_end, child = ctx.Pipe()
        procs.append(ctx.Process(target=_serve, args=("relay", child, None), daemon=True))
        procs[-1].start()
        relay_id, relay_address = r_end.recv()
        p_end, child = ctx.Pipe()
        procs.append(ctx.Process(target=_serve, args=("stage", child, (relay_id, relay_address)), daemon=True))
        procs[-1].start()
        peer_id, peer_address = p_end.recv()
        ends = [r_end, p_end]
        signer = CallSigner(Identity.generate())
        metadata = signer.metadata(peer_id)
        tunnels = Tunnels(signer, lambda a: RelayRoute(peer_id, relay_id, relay_address))
        options = TransportConfig().channel_options()
        paths = {
            "direct": grpc.insecure_channel(peer_address, options=options),
            "relayed": grpc.insecure_channel(tunnels.dial("p:1"), options=options),
        }
        small, large = b"s" * 64, b"L" * int(args.payload_mib * (1 << 20))
        lat: dict[str, list[float]] = {k: [] for k in paths}
        bulk: dict[str, list[float]] = {k: [] for k in paths}
        for channel in paths.values():  # warm up: connect, first token check
            _time(stage_pb2_grpc.StageStub(channel), metadata, small, 5)
        for _ in range(args.rounds):
            for name, channel in paths.items():
                stub = stage_pb2_grpc.StageStub(channel)
                lat[name] += _time(stub, metadata, small, args.calls)
                bulk[name] += _time(stub, metadata, large, args.large_calls)
        rows = {}
        for name in paths:
            ordered = sorted(lat[name])
            rows[name] = {
                "latency_ms_median": 1e3 * statistics.median(ordered),
                "latency_ms_p90": 1e3 * ordered[int(0.9 * (len(ordered) - 1))],
                "mbyte_per_s": len(large) * len(bulk[name]) / sum(bulk[name]) / 1e6,
            }
        rows["relayed_over_direct"] = {
            "latency": rows["relayed"]["latency_ms_median"] / rows["direct"]["latency_ms_median"],
            "bytes_per_s": rows["relayed"]["mbyte_per_s"] / rows["direct"]["mbyte_per_s"],
        }
        for channel in paths.values():
            channel.close()
        tunnels.close()
    finally:
        for end in ends:
            end.send("stop")
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()
    if args.json:
        print(json.dumps(rows))
    else:
        print(f"{'path':<10} {'median ms':>10} {'p90 ms':>8} {'MB/s':>8}   ({args.payload_mib:g} MiB calls)")
        for name in ("direct", "relayed"):
            r = rows[name]
            print(f"{name:<10} {r['latency_ms_median']:>10.3f} {r['latency_ms_p90']:>8.3f} {r['mbyte_per_s']:>8.1f}")
        ratio = rows["relayed_over_direct"]
        print(f"relayed/direct: latency x{ratio['latency']:.2f}, bytes/s x{ratio['bytes_per_s']:.2f}")
    return 0
