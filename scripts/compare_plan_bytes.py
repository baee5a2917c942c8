"""Prints the plan texts the live planner publishes in a set of scenarios, one JSON line per publication, so two
checkouts' outputs can be compared byte for byte (`diff`): run it under each checkout's venv.

It drives `swarm.daemon.planning.Planner` against a SwarmDHT whose records live in memory (no DHT process) and
records the JSON text the DHT would store (`PlanRecord.to_wire()["plan"]`, key order included). It adapts to
the planner's constructor of either side of the plan-document refactor (a `PlanningConfig` first, or unpacked
parameters), so the same scenarios run on both.

Usage (each venv imports its own checkout's swarm; the old one e.g. `git worktree add ../before bfebab1` and
`bash scripts/env.sh` there):
    ../before/.venv/bin/python scripts/compare_plan_bytes.py > old.jsonl
    .venv/bin/python scripts/compare_plan_bytes.py > new.jsonl && cmp old.jsonl new.jsonl
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import sys

import torch

from swarm.compression import CodecConfig
from swarm.daemon.planning import Planner
from swarm.model.gpt import ModelConfig
from swarm.peers.dht import SwarmDHT
from swarm.peers.dht_config import DHTConfig
from swarm.peers.entries import RunKeys
from swarm.peers.records import LinkMeasurement, PeerAnnouncement, PlanRecord, TrainerAnnouncement
from swarm.scheduler.bits import BitsPolicy, codec_sizes

try:
    from swarm.scheduler.precision_choice import precision_planner
    from swarm.scheduler.sizes import model_spec
except ImportError:  # before the refactor
    from swarm.daemon.planning import model_spec
    from swarm.scheduler.precision import precision_planner

IDS = [f"0{c}0000000000" for c in "abcdefgh"]


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def announce(pid: str, speed: float, version: int = 0, **extra) -> PeerAnnouncement:
    address = f"127.0.0.1:{5000 + IDS.index(pid)}"
    return PeerAnnouncement(pid, address, "cpu", 1 << 30, speed, plan_version=version, **extra)


def links(ids: list[str], slow: set[frozenset], fast_mbit: float = 1000.0, slow_mbit: float = 10.0) -> list:
    out = []
    for a in ids:
        for b in ids:
            if a != b:
                mbit = slow_mbit if frozenset((a, b)) in slow else fast_mbit
                rtt = 0.04 if frozenset((a, b)) in slow else 0.002
                out.append(LinkMeasurement(a, b, rtt, mbit * 1e6 / 8, 1.0))
    return out


def fake_dht(me: str, records: dict) -> tuple[SwarmDHT, list[str]]:
    texts: list[str] = []
    dht = SwarmDHT.__new__(SwarmDHT)
    dht.config, dht.peer_id, dht._warned, dht._keys = DHTConfig(), me, set(), RunKeys.of_run("run")
    dht._parse_all = lambda key, kind: list(records.get(kind, []))
    dht.links = lambda: list(records.get("links", []))

    def publish_plan(version, plan):
        record = PlanRecord(version, plan, 1e6)  # positional: `plan` before the refactor, `document` after
        texts.append(json.dumps({"version": version, "plan": record.to_wire()["plan"]}))
        records.setdefault("plan", []).append((me, record))

    dht.publish_plan = publish_plan
    return dht, texts


def make_planner(dht, spec, n_stages, *, min_peers, replicas=1, seed=0, even_layers=False, clock, **kw) -> Planner:
    if "cfg" in inspect.signature(Planner.__init__).parameters:
        try:
            from swarm.daemon.peer_config import PlanningConfig
        except ImportError:  # between the config and the rename commits
            from swarm.daemon.config import PlanningConfig

        cfg = PlanningConfig(min_peers=min_peers, replicas=replicas, seed=seed, even_layers=even_layers)
        return Planner(cfg, dht, spec, n_stages, clock=clock, **kw)
    return Planner(
        dht, spec, n_stages, min_peers, replicas=replicas, seed=seed, even_layers=even_layers, clock=clock, **kw
    )


class Status:
    """A StatusReply stand-in: what `RepackWatch` reads of a peer."""

    def __init__(self, peer_id, stage, plan_version, frozen):
        self.peer_id, self.stage, self.plan_version = peer_id, stage, plan_version
        self.metrics = {"swarm_frozen_layers": float(frozen)}


def scenario(name, *, n_layers=4, n_stages, peers, slow=(), replicas=1, per_link=False, precision=0.0,
             trainers=("t1",), even_layers=False, steps=(), repack=None):  # fmt: skip
    torch.manual_seed(0)
    model = ModelConfig(n_layers=n_layers, hidden_dim=32, n_heads=2, seq_len_tokens=16)
    spec = model_spec(model, CodecConfig("fp32"), CodecConfig("fp32"))
    records = {
        "peers": list(peers),
        "trainers": [TrainerAnnouncement(t) for t in trainers],
        "links": links([p.peer_id for p in peers], set(slow)),
    }
    dht, texts = fake_dht(IDS[0], records)
    clock = Clock()
    kw = {"settle_s": 1.0, "probe_wait_s": 0.0}
    if per_link:
        kw |= {"codec_bytes": codec_sizes(model, 2), "bits": BitsPolicy()}
    if precision:
        kw["precisions"] = precision_planner(model, precision, 2)
    if repack is not None:
        from swarm.daemon.repack import RepackWatch

        kw["repack"] = RepackWatch(lambda pid: repack.get(pid), every_s=0.0, clock=clock)
    planner = make_planner(dht, spec, n_stages, min_peers=len(peers), replicas=replicas, even_layers=even_layers,
                           clock=clock, **kw)  # fmt: skip
    for step in (None, *steps):
        if step is not None:
            step(records, clock)
        planner.round()  # sees the change (a search waits settle_s for the set to settle)
        clock.t += 5
        planner.round()
    for text in texts:
        print(json.dumps({"scenario": name, "published": json.loads(text)}))


def follow(records, clock):
    """Every peer announces that it follows the newest plan in the stage it names."""
    record = records["plan"][-1][1]
    plan = record.to_wire()["plan"]
    stages = json.loads(plan)["stages"]
    serves = {
        pid: {"stage": s, "layer_start": st["layer_start"], "layer_end": st["layer_end"]}
        for s, st in enumerate(stages)
        for pid in st["peer_ids"]
    }
    records["peers"] = [
        dataclasses.replace(p, plan_version=record.version, **serves.get(p.peer_id, {})) for p in records["peers"]
    ]


def main() -> None:
    logging.disable(logging.CRITICAL)
    a, b, c, d, e, f, g, h = IDS
    four = [announce(p, s) for p, s in zip((a, b, c, d), (10.0, 12.0, 8.0, 11.0), strict=True)]
    six = [announce(p, s) for p, s in zip((a, b, c, d, e, f), (10.0, 12.0, 8.0, 11.0, 9.0, 10.0), strict=True)]
    scenario("two stages", n_stages=2, peers=four[:2])
    scenario("three stages even layers", n_layers=6, n_stages=3, peers=four[:3], even_layers=True)
    scenario("four stages", n_stages=4, peers=four)
    scenario("two stages x2 replicas", n_stages=2, peers=four, replicas=2)
    scenario("three stages x2 replicas + standby", n_layers=6, n_stages=3, peers=six + [announce(g, 7.0)], replicas=2)
    slow = {frozenset((a, b)), frozenset((b, c))}
    scenario("per-link codecs 3 stages", n_layers=6, n_stages=3, peers=four[:3], slow=slow, per_link=True)
    scenario("per-link codecs 4 stages", n_stages=4, peers=four, slow={frozenset((c, d))}, per_link=True)
    scenario("per-link codecs + replicas (epilogue)", n_stages=2, peers=four, replicas=2, per_link=True,
             slow={frozenset((a, c)), frozenset((b, d)), frozenset((a, b))})  # fmt: skip

    def rechoose(records, clock):
        follow(records, clock)
        ids = [p.peer_id for p in records["peers"]]
        records["links"] = links(ids, {frozenset((x, y)) for x in ids for y in ids if x != y}, slow_mbit=2.0)

    scenario("codecs chosen again", n_layers=6, n_stages=3, peers=four[:3], per_link=True, slow=slow,
             steps=[rechoose])  # fmt: skip
    fast = [announce(p, s, speeds=(("bf16", 3 * s),)) for p, s in zip((a, b, c), (10.0, 12.0, 8.0), strict=True)]
    scenario("precision budget", n_layers=6, n_stages=3, peers=fast, precision=0.5)
    scenario("precision budget + per-link", n_layers=6, n_stages=3, peers=fast, precision=0.5, per_link=True,
             slow={frozenset((a, b))})  # fmt: skip

    def kill(pid):
        def step(records, clock):
            follow(records, clock)
            records["peers"] = [p for p in records["peers"] if p.peer_id != pid]

        return step

    def join(ann):
        def step(records, clock):
            follow(records, clock)
            records["peers"] = [*records["peers"], ann]
            records["links"] = links([p.peer_id for p in records["peers"]], set())

        return step

    scenario("repair after a death", n_stages=2, peers=six[:5], replicas=2, steps=[kill(b)])
    scenario("repair, growth, trainer change", n_stages=2, peers=six[:5], replicas=2, per_link=True,
             steps=[kill(c), join(announce(h, 9.5)), lambda r, _: r.__setitem__("trainers", [])])  # fmt: skip
    scenario("full re-search after losing a stage", n_stages=2, peers=four[:2], steps=[kill(b)])

    statuses: dict = {}

    def freeze(layers: int):
        """The stages report `layers` frozen under the newest plan (the repack's trigger)."""

        def step(records, clock):
            follow(records, clock)
            record = records["plan"][-1][1]
            stages = json.loads(record.to_wire()["plan"])["stages"]
            for s, st in enumerate(stages):
                for pid in st["peer_ids"]:
                    statuses[pid] = Status(pid, s, record.version, layers)

        return step

    two = freeze(2)
    scenario("repack with frozen layers", n_stages=4, peers=four, repack=statuses, steps=[two, two, kill(d)])
    statuses.clear()
    three = freeze(3)  # 4 stages become 2 x 2 replicas: the per-stage parts go
    scenario("repack + per-link codecs", n_stages=4, peers=four, repack=statuses, per_link=True, steps=[three, three])
    relayed = [
        announce(a, 10.0),
        announce(b, 12.0),
        announce(c, 8.0, reach="relay", relay=a),
        announce(d, 11.0, reach="relay", relay=a),
    ]
    scenario("NAT'd peers (relay_extra_s)", n_stages=2, peers=relayed, per_link=True, slow={frozenset((a, c))})
    scenario("NAT'd peers 4 stages", n_stages=4, peers=relayed)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
