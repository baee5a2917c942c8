"""`LinkProber`: a peer measures its links to the others (round-trip time, rate and a token bucket's burst)
with the stage service's Probe and Sink calls, through the same application-level shaper as its real traffic,
a few peers per round, and stores `LinkMeasurement`s in the DHT for the planner (`swarm.daemon.planning`)."""

from __future__ import annotations

import logging
import random
import time

import torch

from swarm.compression import CodecConfig, make_codec
from swarm.net.stream import TensorStreams, tensor_items
from swarm.peers.records import LinkMeasurement
from swarm.proto import stage_pb2, stage_pb2_grpc

log = logging.getLogger("swarm.daemon.planning")


class LinkProber:
    """Measures this peer's links to the others, a few per round, and stores the results in the DHT."""

    def __init__(
        self,
        dht,
        my_address: str,
        shaping,
        channels,
        probe_bytes: int = 256 << 10,
        peers_per_round: int = 4,
        refresh_s: float = 120.0,
    ):
        self.dht, self.my_address, self.shaping, self.channels = dht, my_address, shaping, channels
        self.probe_bytes, self.peers_per_round, self.refresh_s = probe_bytes, peers_per_round, refresh_s
        self._measured: dict[str, float] = {}  # peer id -> when
        self._rng = random.Random(dht.peer_id)
        self._fp32 = make_codec(CodecConfig("fp32"))
        self.found_peers = False
        """Whether the last round saw another peer. Until one does, the daemon asks again within a second, not
        its plan interval: a peer up before the others found nobody to probe, waited 30 s, and then probed its
        link in the middle of training (4 s of a 1 Mbit/s link's time taken from a step, a burst read from a
        bucket the traffic had emptied, and the first plan priced with that direction unmeasured)."""

    def measure(self, address: str, timeout_s: float = 30.0, answer_s: float = 3.0) -> tuple[float, float, float]:
        """(round-trip time in s, bytes/s, burst bytes) to the stage service at `address`.

        Two probes back to back: the second finds the link's bucket empty, so its time is the rate's alone; the
        first passed its burst at once, and what it beat the rate by is that burst (0 on an unshaped link).
        The empty Probes must answer within `answer_s`: behind NAT a dial into a peer's private address is
        dropped without a word, and the daemon's loop (plans, the planner) must not wait out `timeout_s` on it.
        """
        stub = stage_pb2_grpc.StageStub(self.channels.get(address))
        rtts = []
        for _ in range(3):
            start = time.perf_counter()
            stub.Probe(stage_pb2.ProbeRequest(reply_bytes=0), timeout=min(timeout_s, answer_s))
            rtts.append(time.perf_counter() - start)
        rtt = min(rtts)
        msg = self._fp32.encode(torch.rand(self.probe_bytes // 4))
        shaper = self.shaping.for_destination(address)
        sent, seconds = [], []
        for _ in range(2):
            start = time.perf_counter()
            reply = TensorStreams(self.channels.get(address)).Sink(
                tensor_items(stage_pb2.CallInfo(), msg, 0, shaper), timeout=timeout_s
            )
            seconds.append(max(time.perf_counter() - start - rtt / 2, 1e-6))
            sent.append(reply.wire_bytes)
        rate = sent[1] / seconds[1]
        return rtt, rate, max(0.0, sent[0] - rate * seconds[0])

    def round(self, now: float | None = None) -> int:
        """Probes up to `peers_per_round` peers, unmeasured ones first; returns how many were measured."""
        now = time.time() if now is None else now
        others = [p for p in self.dht.peers() if p.peer_id != self.dht.peer_id and p.address != self.my_address]
        self.found_peers = bool(others)
        due = [p for p in others if now - self._measured.get(p.peer_id, -1e18) >= self.refresh_s]
        self._rng.shuffle(due)
        due.sort(key=lambda p: p.peer_id in self._measured)  # never-measured peers first
        done = 0
        for ann in due[: self.peers_per_round]:
            try:
                rtt, rate, burst = self.measure(ann.address)
            except Exception as e:  # an unreachable or misbehaving peer is skipped, not fatal
                log.info("probe of %s at %s failed: %s", ann.peer_id, ann.address, e)
                continue
            self.dht.store_link(LinkMeasurement(self.dht.peer_id, ann.peer_id, rtt, rate, now, burst_bytes=burst))
            # what this peer's data path decides zstd by on that link (`Shaper.known_rate`): the kernel or the ISP
            # shapes a real link, so without it every link would look unshaped and nothing would be compressed
            self.shaping.for_destination(ann.address).measured_bytes_per_s = rate
            self._measured[ann.peer_id] = now
            log.info(
                "link to %s: rtt %.1f ms, %.1f Mbit/s, burst %.0f kB",
                ann.peer_id,
                rtt * 1e3,
                rate * 8 / 1e6,
                burst / 1e3,
            )
            done += 1
        return done
