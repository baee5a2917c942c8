"""Per-call latency behind the NAT router (`swarm experiment nat --netns --ping`): a signed `Ping` to each
stage, through the same dial path as the trainer's (`swarm.net.relay.Tunnels`: a tunnel through the stage's relay
where it is NAT'd, else direct), timed call by call.

Run inside a testbed namespace as `python -m swarm.experiments.nat_ping CALLS TARGETS_JSON`; TARGETS_JSON is a
list of {"name", "address", "peer_id", "relay_id", "relay_address"} (relay_* null: dial directly). Prints one JSON
object: name -> {"median_ms", "p90_ms", "calls", "path"} where path is "direct" or "relay:<relay name>". The
first call of each target (channel and tunnel set-up) is not timed. From the trainer's namespace a NAT'd stage
is two legs (trainer -> relay -> stage); from its relay's namespace it is the reverse connection's one network
leg (plus a hop over the relay's loopback: an upper bound on the in-process reverse connection).
"""

from __future__ import annotations

import json
import statistics
import sys
import time


def ping_targets(targets: list[dict], calls: int) -> dict:
    import grpc

    from swarm.net.auth import CallSigner, Identity
    from swarm.net.connect import method_path
    from swarm.net.relay import RelayRoute, Tunnels
    from swarm.proto import stage_pb2, stage_pb2_grpc

    signer = CallSigner(Identity.generate())
    routes = {
        t["address"]: RelayRoute(t["peer_id"], t["relay_id"], t["relay_address"]) if t.get("relay_id") else None
        for t in targets
    }
    tunnels = Tunnels(signer, routes.get)
    out = {}
    try:
        for t in targets:
            with grpc.insecure_channel(tunnels.dial(t["address"])) as channel:
                stub, ping = stage_pb2_grpc.StageStub(channel), method_path("Ping")
                times = []
                for _ in range(calls + 1):
                    start = time.perf_counter()
                    try:  # each call carries its own proof: a stage refuses one sent twice
                        request = stage_pb2.PingRequest()
                        metadata = signer.metadata(t["peer_id"], ping, request)
                        stub.Ping(request, metadata=metadata, timeout=5.0)
                    except grpc.RpcError as e:
                        out[t["name"]] = {"error": str(e.code())}
                        break
                    times.append(time.perf_counter() - start)
                else:
                    timed = sorted(times[1:])
                    out[t["name"]] = {
                        "median_ms": 1e3 * statistics.median(timed),
                        "p90_ms": 1e3 * timed[int(0.9 * (len(timed) - 1))],
                        "calls": len(timed),
                        "path": f"relay:{t['relay_name']}" if t.get("relay_id") else "direct",
                    }
    finally:
        tunnels.close()
    return out


def main(argv: list[str]) -> int:
    calls, targets = int(argv[0]), json.loads(argv[1])
    print(json.dumps(ping_targets(targets, max(1, min(calls, 1000)))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
