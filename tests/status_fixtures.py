"""A status view of a small run made of real records (2 stages, one replicated, one peer behind a relay), with a
hostile run name, bootstrap address and steps error, for the status page's HTTP and browser tests."""

from __future__ import annotations

import json
from pathlib import Path

from swarm.daemon.status_view import PlanHistory, Probe, StepCurves, status_snapshot
from swarm.peers.plan import PlanDocument, PlanStage
from swarm.peers.records import LinkMeasurement, PeerAnnouncement, PlanRecord, TrainerAnnouncement

XSS = '<img src=x onerror="document.title=\'pwned\'"><script>document.title="pwned"</script>'
"""What a hostile name or address tries: markup that runs script if the page inserted it as HTML."""

NOW = 1_800_000_000.0
A, B, C, R, T = "QmPeerAaaaaaaa", "QmPeerBbbbbbbb", "QmPeerCcccccccc", "QmRelayRrrrrrr", "QmTrainerTttt"


def records():
    peers = [
        PeerAnnouncement(A, "127.0.0.1:4001", "cpu", 1 << 30, 40.0, 0, 0, 2, 0.5, 3, NOW - 120, planner_until=NOW + 3),
        PeerAnnouncement(B, "127.0.0.1:4002", "cpu", 1 << 30, 35.0, 1, 2, 4, 0.4, 3, NOW - 100),
        PeerAnnouncement(
            C, "10.0.0.3:4003", "cuda:0", 1 << 30, 90.0, 1, 2, 4, 0.2, 3, NOW - 90, reach="relay", relay=R
        ),
        PeerAnnouncement(R, "127.0.0.1:4009", "cpu", 1 << 30, 20.0, started_at=NOW - 300),
    ]
    links = [
        LinkMeasurement(A, B, 0.004, 12.5e6, NOW - 5),
        LinkMeasurement(A, C, 0.030, 2.5e6, NOW - 7),
    ]
    doc = PlanDocument(
        stages=(PlanStage(0, 2, (A,)), PlanStage(2, 4, (B, C))), unused_peer_ids=(R,), trainer_ids=(T,), step_time_s=0.8
    )
    return peers, links, PlanRecord(3, doc, NOW - 60), [TrainerAnnouncement(T, NOW - 80)]


def write_steps(out: Path, n: int = 40, held_every: int = 10) -> Path:
    """A trainer's steps.jsonl of `n` steps (loss falling, a held-out loss every `held_every`, plan 2 then 3)."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "steps.jsonl", "w") as f:
        for step in range(1, n + 1):
            row = {
                "step": step,
                "train_loss": 5.0 / (1 + step / 10),
                "step_s": 0.5,
                "sample_ids": " ".join(str(i) for i in range(8)),
                "plan_version": 2 if step <= n // 2 else 3,
                "time": NOW - n + step,
            }
            if step % held_every == 0:
                row["held_out_loss"] = 5.2 / (1 + step / 10)
            f.write(json.dumps(row) + "\n")
    return out


def snapshot(steps_dir: Path | None = None, hostile: bool = True) -> dict:
    """The view a reader of `records()` makes: the bootstrap peers' probes (one alive, one down), the relay's
    probe, and the steps under `steps_dir`."""
    peers, links, plan, trainers = records()
    history = PlanHistory()
    history.see(plan, NOW - 50)
    curves = None
    if steps_dir is not None:
        curves = StepCurves(steps_dir)
        curves.refresh()
    boot = [
        Probe("/ip4/127.0.0.1/tcp/4000/p2p/QmBoot1", True, 0.3, checked_at=NOW),
        Probe(XSS if hostile else "/ip4/10.9.9.9/tcp/4000/p2p/QmBoot2", False, error="timed out", checked_at=NOW),
    ]
    return status_snapshot(
        XSS if hostile else "demo",
        NOW,
        peers,
        links,
        plan,
        trainers,
        {A: {"swarm_steps_total": 40.0, 'swarm_wire_bytes_total{direction="forward",link="0"}': 3.2e6}},
        bootstrap=boot,
        relay_probes={R: Probe("127.0.0.1:4009", True, 0.2, checked_at=NOW)},
        plan_history=history.to_json(),
        steps=None if curves is None else curves.to_json(),
    )
