"""Per-peer precision switched live: a 3-peer local swarm (swarm-peer processes) follows the plans of one
trusted planner, the trainer's own key (`--trusted-planners`: the plans are this test's). Plan 1 computes every
stage in fp32; while the trainer runs, plan 2 gives stage 1 bf16 (`"precisions"`, swarm.scheduler.precision_choice).
The peer of stage 1 switches between two steps (same layers: no handover) and reports 16 compute bits in its
Status, and the trainer trains on across the switch without a gap."""

from __future__ import annotations

import csv
import dataclasses
import math
import threading
import time

import pytest

import swarm.train.follower as follower_module
from swarm.model.gpt import ModelConfig
from swarm.net.auth import Identity
from swarm.net.connect import GrpcConnector
from swarm.proto import stage_pb2
from swarm.testbed.local import local_swarm
from swarm.train.trainer import TrainConfig, train

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

N_LAYERS = ModelConfig().n_layers
STEPS, SWITCH_AFTER = 30, 4
BOUNDS = [(0, 1), (1, 2), (2, N_LAYERS)]


def _until(ready, deadline: float, what: str, stop: threading.Event | None = None):
    """Polls `ready` (a DHT read or a stage's Status) until it returns something, within the monotonic `deadline`."""
    stop = stop or threading.Event()
    while not stop.is_set():
        got = ready()
        if got:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what}")
        stop.wait(0.2)
    return None


def test_a_plan_that_switches_one_stage_to_bf16_keeps_the_swarm_training(tmp_path, monkeypatch):
    started = time.monotonic()
    planner = Identity.generate()  # the trainer's key, and the one trusted planner
    monkeypatch.setattr(Identity, "generate", classmethod(lambda cls: planner))
    plans: list[dict] = []
    found = follower_module.discover_route

    def publish_then_discover(dht, *args, **kwargs):
        """Plan 1 (fp32 everywhere) once the 3 peers are announced, then the trainer's usual discovery (which,
        like the peers, reads plans only from the trusted planner: this very key). Only local_swarm's call: the
        trainer's own discoveries on a re-plan are the real function's."""
        monkeypatch.setattr(follower_module, "discover_route", found)
        dht.config = dataclasses.replace(dht.config, trusted_planners=(planner.peer_id,))
        ids = _until(lambda: sorted(p.peer_id for p in dht.peers()) if len(dht.peers()) == 3 else None,
                     time.monotonic() + 90, "3 peers")  # fmt: skip
        stages = [{"layer_start": a, "layer_end": b, "peer_ids": [p]} for (a, b), p in zip(BOUNDS, ids, strict=True)]
        plans.append({"stages": stages, "trainer_ids": [dht.peer_id], "precisions": ["fp32"] * 3})
        dht.publish_plan(1, plans[0])
        return found(dht, *args, **kwargs)

    monkeypatch.setattr(follower_module, "discover_route", publish_then_discover)
    out = tmp_path / "train"
    flags = ["--assign", "plan", "--trusted-planners", planner.peer_id, "--compute-speed", "40", "--no-link-probe"]
    with local_swarm(tmp_path, 3, flags, timeout_s=90) as swarm:
        assert swarm.plan_version == 1
        stop, errors, watcher = threading.Event(), [], GrpcConnector(signer=swarm.signer)

        def switch() -> None:
            try:
                first = plans[0]["stages"][0]["peer_ids"][0]
                address = {p.peer_id: p.address for p in swarm.dht.peers()}[first]
                stub = watcher.stage(address, first)
                steps = lambda: stub.Status(stage_pb2.Empty(), timeout=10).steps_done >= SWITCH_AFTER  # noqa: E731
                if _until(steps, time.monotonic() + 60, f"{SWITCH_AFTER} steps applied", stop):
                    plans.append({**plans[0], "precisions": ["fp32", "bf16", "fp32"]})
                    swarm.dht.publish_plan(2, plans[1])
            except Exception as e:  # noqa: BLE001 - reported by the test
                errors.append(e)

        switcher = threading.Thread(target=switch, daemon=True)
        switcher.start()
        cfg = TrainConfig(train_samples=16, batch_size=8, micro_batches=2, steps=STEPS, out=str(out))
        try:
            summary = train(cfg, swarm.path, quiet=True, signer=swarm.signer, dht=swarm.dht)
        finally:
            stop.set()
            switcher.join(30)
            watcher.close()
        assert not errors and not switcher.is_alive(), errors
        addresses = {p.peer_id: p.address for p in swarm.dht.peers()}
        connector = GrpcConnector(signer=swarm.signer)
        status = [
            connector.stage(addresses[pid], pid).Status(stage_pb2.Empty(), timeout=10)
            for pid in (s["peer_ids"][0] for s in plans[-1]["stages"])
        ]
        connector.close()
    assert len(plans) == 2, "plan 2 was published while the trainer ran"
    assert [(r.stage, r.plan_version) for r in status] == [(0, 2), (1, 2), (2, 2)]
    assert [r.metrics["swarm_compute_bits"] for r in status] == [32.0, 16.0, 32.0], "stage 1 switched to bf16"
    with open(out / "steps.csv") as f:
        rows = list(csv.DictReader(f))
    assert summary.steps == STEPS and [int(r["step"]) for r in rows] == list(range(1, STEPS + 1))
    assert all(math.isfinite(float(r["train_loss"])) for r in rows)
    versions = [int(r["plan_version"]) for r in rows]
    assert versions[0] == 1 and versions[-1] == 2 and versions == sorted(versions), versions
    print(f"precision switch test: {time.monotonic() - started:.1f} s, switched at step {versions.index(2) + 1}")
