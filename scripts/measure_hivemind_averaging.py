"""Per-step cost of averaging one stage's gradients between two replicas on 127.0.0.1: hivemind's
DecentralizedAverager (matchmaking + all-reduce, a group of 2) against the stage service's Reduce/Average.

This is the measured reason for the choice in docs/reports/replicas.md. Prints one line per setting
(`--json`: one JSON object per line). hivemind's 8-bit codecs crash at decode under numpy 2, so it runs
uncompressed and with Float16Compression; Reduce runs with fp32 and with gradq (4 bits, error feedback).

    python scripts/measure_hivemind_averaging.py [--steps 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import torch

from swarm.compression import CodecConfig
from swarm.model.gpt import ModelConfig
from swarm.net.auth import CallSigner, CallVerifier, Identity
from swarm.net.connect import GrpcConnector
from swarm.net.stream import tokens_to_wire
from swarm.peers.transport import TransportConfig, make_server
from swarm.proto import stage_pb2, stage_pb2_grpc
from swarm.runtime.boundary import LinkEnds
from swarm.runtime.host import StageHost, StageRole
from swarm.runtime.policy import Roster
from swarm.runtime.service import StageServicer
from swarm.runtime.worker import StageConfig

MODEL = ModelConfig()  # the project's default model, as one stage: every parameter is averaged


def measure_reduce(codec: CodecConfig, steps: int) -> dict:
    """Two authenticated replicas behind real gRPC servers; each step trains one micro-batch on each, then times
    the two concurrent Reduce calls (the trainer's view of the averaging)."""
    ids = [Identity.generate() for _ in range(3)]
    peers, trainer = [i.peer_id for i in ids[:2]], ids[2]
    transport = TransportConfig()
    hosts, servers, addresses, servicers = [], [], [], []
    book: dict[str, str] = {}
    for r in range(2):
        connector = GrpcConnector(transport, CallSigner(ids[r]), book.get)
        role = StageRole(0, 1, 0, MODEL.n_layers, replica=r)
        host = StageHost(role, MODEL, StageConfig(), LinkEnds(CodecConfig("fp32"), codec), peers[r], connector)
        server, port = make_server(transport)
        servicer = StageServicer(host, CallVerifier(peers[r]))
        stage_pb2_grpc.add_StageServicer_to_server(servicer, server)
        server.start()
        hosts.append(host), servers.append(server), servicers.append(servicer), addresses.append(f"127.0.0.1:{port}")
    book.update(zip(addresses, peers, strict=True))
    roster = Roster((tuple(peers),), (tuple(addresses),), frozenset({trainer.peer_id}), ())
    for s in servicers:
        s.set_roster(roster)
    driver = GrpcConnector(transport, CallSigner(trainer), book.get)
    times, sent = [], 0
    try:
        for step in range(steps + 1):
            for r in range(2):
                _train(driver.stage(addresses[r]), step, r, addresses[r], peers[r])
            request = stage_pb2.ReduceRequest(
                step=step, stage=0, group_peers=peers, group_addresses=addresses, deadline_s=60
            )
            replies: list = [None, None]

            def run(r: int, request=request, replies=replies) -> None:
                replies[r] = driver.stage(addresses[r]).Reduce(request, timeout=60)

            start = time.perf_counter()
            threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if step:  # the first step warms channels up
                times.append(time.perf_counter() - start)
                sent = replies[0].wire_bytes
            for r in range(2):
                driver.stage(addresses[r]).Step(stage_pb2.StepRequest(step=step, global_grad_norm=1.0), timeout=60)
        digests = {driver.stage(a).Status(stage_pb2.Empty(), timeout=10).weights_digest for a in addresses}
    finally:
        for server in servers:
            server.stop(grace=None)
        for host in hosts:
            host.close()
        driver.close()
    numel = hosts[0].averager.numel
    return _row(f"swarm Reduce {codec.name}", numel, times, sent, same_weights=len(digests) == 1)


def _train(client, step: int, r: int, address: str, peer: str) -> None:
    info = stage_pb2.CallInfo(
        step=step, stage=0, num_micro_batches=1, schedule="gpipe", chain=r, route=[address], route_peers=[peer],
        deadline_s=60, loss_weight=0.5,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(step * 2 + r)
    w = torch.randint(0, MODEL.vocab_size, (4, MODEL.seq_len_tokens + 1), generator=gen)
    client.PutLabels(stage_pb2.LabelsRequest(info=info, labels=tokens_to_wire(w[:, 1:])), timeout=60)
    item = stage_pb2.StreamItem(info=info, tokens=tokens_to_wire(w[:, :-1], torch.arange(4)))
    client.Forward(iter([item.SerializeToString()]), timeout=60)
    client.Backward(iter([stage_pb2.StreamItem(info=info).SerializeToString()]), timeout=60)


def measure_hivemind(
    numel: int, compression: str, steps: int, min_matchmaking_time: float, skew_s: float = 0.0
) -> dict:
    """Two DecentralizedAveragers on two DHT nodes on 127.0.0.1, a group of 2; times each step() from the first
    replica's call to both results (matchmaking included, as a per-step use would pay it), the second replica
    calling `skew_s` later (replicas never finish their backward passes at the same instant). Also reports
    whether both replicas hold the same averaged bits afterwards."""
    import hivemind
    from hivemind.averaging import DecentralizedAverager
    from hivemind.compression import Float16Compression, NoCompression

    codec = Float16Compression() if compression == "float16" else NoCompression()
    first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    second = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=first.get_visible_maddrs())
    averagers = [
        DecentralizedAverager(
            [torch.randn(numel)],
            dht,
            start=True,
            prefix="measure",
            target_group_size=2,
            min_group_size=2,
            min_matchmaking_time=min_matchmaking_time,
            request_timeout=1.0,
            compression=codec,
        )  # fmt: skip
        for dht in (first, second)
    ]
    times, failures, first_s, diffs = [], 0, 0.0, []
    try:
        for step in range(steps + 1):
            for a in averagers:  # fresh, different gradients each step
                with a.get_tensors() as tensors:
                    tensors[0].copy_(torch.randn(numel))
            start = time.perf_counter()
            controls = [averagers[0].step(wait=False, timeout=60)]
            if skew_s:
                time.sleep(skew_s)  # measurement only: the second replica finishes its backward later
            controls.append(averagers[1].step(wait=False, timeout=60))
            results = [c.result() for c in controls]
            if any(r is None for r in results):
                failures += 1
            elapsed = time.perf_counter() - start
            if step:
                times.append(elapsed)
            else:
                first_s = elapsed
            with averagers[0].get_tensors() as t0, averagers[1].get_tensors() as t1:
                diffs.append(float((t0[0] - t1[0]).abs().max()))
    finally:
        for a in averagers:
            a.shutdown()
        for dht in (first, second):
            dht.shutdown()
    label = f"hivemind DecentralizedAverager {compression} min_matchmaking_time={min_matchmaking_time} skew={skew_s}"
    row = _row(label, numel, times, 2 * numel if compression == "float16" else 4 * numel)
    row.update(failed_steps=failures, first_step_s=round(first_s, 3), replicas_max_abs_diff=max(diffs))
    return row


def _row(setting: str, numel: int, times: list[float], sent: int, **extra) -> dict:
    return {
        "setting": setting,
        "numel": numel,
        "steps": len(times),
        "median_s": round(statistics.median(times), 4),
        "max_s": round(max(times), 4),
        "bytes_sent_per_replica": sent,
        **extra,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="timed steps per setting (one more warms up)")
    parser.add_argument("--json", action="store_true", help="print one JSON object per setting")
    parser.add_argument("--skip-hivemind", action="store_true", help="measure only the stage service's Reduce")
    args = parser.parse_args()
    torch.set_num_threads(1)

    def show(row: dict) -> dict:
        print(json.dumps(row) if args.json else "  ".join(f"{k}={v}" for k, v in row.items()), flush=True)
        return row

    fp32 = show(measure_reduce(CodecConfig("fp32"), args.steps))
    show(measure_reduce(CodecConfig("gradq"), args.steps))
    if not args.skip_hivemind:
        for compression, matchmaking_s, skew_s in (
            ("none", 5.0, 0.0),
            ("float16", 5.0, 0.0),
            ("float16", 1.0, 0.0),
            ("float16", 5.0, 0.5),
        ):
            show(measure_hivemind(fp32["numel"], compression, args.steps, matchmaking_s, skew_s))


if __name__ == "__main__":
    main()
