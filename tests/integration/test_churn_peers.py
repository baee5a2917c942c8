"""Churn in a real local swarm (processes on loopback, --quick sized): 2 stages x 2 replicas + 1 standby.

- SIGKILL one replica: the trainer keeps going (a step takes 2 attempts on the surviving chain), the planner
  sees the peer silent to its heartbeats and repairs the plan with the standby, the standby takes the stage's
  state from the surviving replica, and both replicas hold equal weights again.
- SIGTERM one replica: it announces leaving, the planner repairs without it, it exits 0 once its successor
  serves its layers with its steps; no step is lost.
Every process is reaped (ProcessGroup), every wait has a deadline.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from swarm.testbed.procs import ProcessGroup, peer_command, swarm_command

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

MODEL_FLAGS = ["--layers", "2", "--hidden", "32", "--heads", "2", "--seq-len", "16"]
PEER_FLAGS = [
    *MODEL_FLAGS, "--fw-codec", "fp32", "--bw-codec", "fp32", "--compute-speed", "50", "--num-stages", "2",
    "--replicas", "2", "--min-peers", "5", "--replicate-every", "2", "--threads", "1",
]  # fmt: skip
N_PEERS = 5


def wait_until(what: str, cond, timeout_s: float, procs: ProcessGroup, poll_s: float = 0.2):
    """Polls `cond` until it returns something truthy; fails naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = cond()
        if found:
            return found
        time.sleep(poll_s)  # poll interval; `cond` is what synchronizes
    logs = "\n".join(f"--- {n}\n{procs.tail(n, 25)}" for n in procs.procs)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}\n{logs}")


def rows(out: Path) -> list[dict]:
    """The trainer's step rows so far (steps.jsonl while it runs, steps.csv once it closed)."""
    lines = out / "steps.jsonl"
    if lines.exists():
        return [json.loads(x) for x in lines.read_text().splitlines() if x.strip().endswith("}")]
    if (out / "steps.csv").exists():
        import csv

        with open(out / "steps.csv") as f:
            return list(csv.DictReader(f))
    return []


def peer_ids(procs: ProcessGroup) -> dict[str, str]:
    """peer id -> process name, from the peers' logs."""
    found = {}
    for name in procs.procs:
        m = re.search(r"joined the DHT as (\w+)", procs.tail(name, 400))
        if m:
            found[m[1]] = name
    return found


@contextlib.contextmanager
def churn_swarm(tmp_path: Path):
    """Bootstrap, N_PEERS peers (each with its own --checkpoint-dir) and a trainer, until it trained 3 steps."""
    from swarm.peers.dht import SwarmDHT
    from swarm.peers.dht_config import DHTConfig

    with ProcessGroup(tmp_path / "logs") as procs:
        address_file = tmp_path / "bootstrap.addr"
        procs.start("bootstrap", swarm_command("bootstrap", "--address-file", str(address_file)))
        procs.wait_for_file(address_file, 60)
        for i in range(N_PEERS):
            ck = tmp_path / f"ck{i}"
            procs.start(
                f"peer{i}", peer_command("--address-file", str(address_file), "--checkpoint-dir", str(ck), *PEER_FLAGS)
            )
        out = tmp_path / "train"
        procs.start(
            "trainer",
            swarm_command(
                "train", "--address-file", str(address_file), *MODEL_FLAGS, "--train-samples", "16",
                "--batch-size", "8", "--micro-batches", "2", "--steps", "100000", "--deadline-s", "30",
                "--out", str(out), "--wait-timeout-s", "200",
            ),
        )  # fmt: skip
        initial = [line for line in address_file.read_text().splitlines() if line.strip()]
        with SwarmDHT(DHTConfig(initial_peers=initial, client_mode=True)) as dht:

            def trained(n: int):
                procs.check_alive()
                return len(rows(out)) >= n

            wait_until("3 trained steps", lambda: trained(3), 240, procs)

            def settled():
                """The plan the DHT holds once the trainer made 3 steps on it: a plan repaired at start-up (a peer
                stalled under load and counted silent) would otherwise send the tests after a peer it no longer
                has (a killed peer outside the plan fails no step)."""
                procs.check_alive()
                record = plan_now(dht)
                if record is None:
                    return None
                return record if sum(int(r["plan_version"]) == record.version for r in rows(out)) >= 3 else None

            wait_until("3 steps on the plan the DHT holds", settled, 240, procs)
            yield procs, dht, out, trained


def plan_now(dht):
    return dht.get_plan(2, check_trainers=False)


def status_of(dht, address: str, peer_id: str):
    from swarm.runtime.driver import PipelineDriver

    watcher = PipelineDriver([address], [peer_id])
    try:
        return watcher.status()[0]
    finally:
        watcher.close()


def replicas_agree(dht):
    """The plan now, if every stage's replicas answer Status with the same steps (> 0) and the same weights' digest
    (None otherwise: a peer still switching, or replicas that disagree)."""
    from swarm.net.stream import StageCallError

    record = plan_now(dht)
    addresses = {p.peer_id: p.address for p in dht.peers()}
    try:
        for stage in record.document.stages:
            replies = [status_of(dht, addresses[p], p) for p in stage.peer_ids]
            if len({r.steps_done for r in replies}) != 1 or replies[0].steps_done <= 0:
                return None
            if len({r.weights_digest for r in replies}) != 1 or replies[0].weights_digest == "":
                return None
    except (StageCallError, KeyError):
        return None
    return record


def victim(dht, procs, stage: int) -> tuple[str, str, dict]:
    """A replica of `stage` that is not the elected planner: (peer id, process name, the plan's stages)."""
    from swarm.peers.records import elected_planner

    record = plan_now(dht)
    plan = record.document
    assert plan.replica_counts == (2, 2) and len(plan.unused_peer_ids) == 1, plan
    planner = elected_planner(dht.peers())
    pid = next(p for p in plan.stages[stage].peer_ids if p != planner)
    return pid, peer_ids(procs)[pid], record


def test_a_killed_replica_is_rerouted_around_and_replaced_by_the_standby(tmp_path):
    with churn_swarm(tmp_path) as (procs, dht, out, trained):
        pid, name, before = victim(dht, procs, 1)
        standby = before.document.unused_peer_ids[0]
        os.killpg(procs.procs[name].pid, signal.SIGKILL)  # the peer and its DHT helper, without warning
        procs.procs[name].wait(10)
        del procs.procs[name]  # reaped; check_alive watches the others

        def rerouted() -> bool:
            """A step that ran without the dead peer: one that failed on it and ran again (2 attempts), or one the
            trainer had already routed around (the peer among the step's dead, 1 attempt: its pings can see a
            SIGKILLed peer's closed connections between two steps; in a loaded suite run no step took 2 attempts in
            120 s while the trainer went on at 10 steps/s)."""
            return any(int(r["attempts"]) >= 2 or pid in str(r["dead_peers"]).split() for r in rows(out))

        wait_until("a step rerouted around the killed replica", rerouted, 120, procs)

        def repaired():
            record = plan_now(dht)
            return record if record is not None and standby in record.document.stages[1].peer_ids else None

        after = wait_until("the planner's repair with the standby", repaired, 120, procs)
        assert after.document.stages[0] == before.document.stages[0], "stage 0 did not move"
        column = before.document.stages[1].peer_ids.index(pid)
        assert after.document.stages[1].peer_ids[column] == standby, "the standby took the dead peer's column"
        n = len(rows(out))
        wait_until(
            "steps on the repaired plan",
            lambda: trained(n + 3) and rows(out)[-1]["plan_version"] >= after.version,
            180,
            procs,
        )
        procs.procs["trainer"].send_signal(signal.SIGTERM)  # stop between steps, then compare the replicas
        assert procs.procs["trainer"].wait(60) == 0, procs.tail("trainer", 40)
        # the replicas of the plan the peers follow now (under load a newer one than the repair may follow the
        # trainer's exit: CI once found a repaired stage-0 replica on standby under plan 3), stage 0 too: the dead
        # peer's partner sat out steps on its chain
        agreed = wait_until("the plan's replicas to agree", lambda: replicas_agree(dht), 60, procs)
        assert agreed.version >= after.version
        assert "took over" in procs.tail(peer_ids(procs)[standby], 400)
        steps = rows(out)
        assert [int(r["step"]) for r in steps] == list(range(1, len(steps) + 1)), "every step ran exactly once"
        assert all(len(str(r["sample_ids"]).split()) == 8 for r in steps), "every sample of every batch once"


def test_a_terminated_replica_hands_over_and_exits_0(tmp_path):
    with churn_swarm(tmp_path) as (procs, dht, out, trained):
        pid, name, before = victim(dht, procs, 0)
        standby = before.document.unused_peer_ids[0]
        addresses = {p.peer_id: p.address for p in dht.peers()}
        procs.procs[name].send_signal(signal.SIGTERM)
        code = procs.procs[name].wait(90)
        last = re.findall(r"took over .* \(step (\d+),", procs.tail(peer_ids(procs)[standby], 400))
        assert code == 0, procs.tail(name, 40)
        assert "left: plan" in procs.tail(name, 60), procs.tail(name, 60)
        del procs.procs[name]
        record = plan_now(dht)
        assert pid not in record.document.used_peers()
        assert standby in record.document.stages[0].peer_ids, record.document
        assert last, procs.tail(peer_ids(procs)[standby], 60)
        n = len(rows(out))
        wait_until("steps after the leave", lambda: trained(n + 3), 180, procs)
        successor = status_of(dht, addresses[standby], standby)
        assert successor.steps_done >= int(last[-1]) > 0, "the successor continued from the leaver's steps"
        procs.procs["trainer"].send_signal(signal.SIGTERM)
        assert procs.procs["trainer"].wait(60) == 0, procs.tail("trainer", 40)
        steps = rows(out)
        assert [int(r["step"]) for r in steps] == list(range(1, len(steps) + 1)), "no step lost or run twice"


if __name__ == "__main__":  # pragma: no cover
    sys.exit(subprocess.call([sys.executable, "-m", "pytest", __file__, "-x", "-q"]))
