"""A re-plan that switches a replicated stage's precision keeps its replicas identical, bit for bit.

A 3-peer local swarm (swarm-peer processes) follows the plans of one trusted planner, the trainer's own key: plan 1
has stage 0 on one peer and stage 1 on two replicas, all fp32; while the trainer runs, plan 2 gives stage 1 bf16.
Both replicas switch between two steps (same layers: no handover) under the same plan version, so no step sums
one replica's fp32 gradients with the other's bf16 ones into different weights: after the run both report 16
compute bits, the same steps and the same SHA-256 of their parameters (`StageStatus.weights_digest`). Every peer
also measured its stage's sensitivity from its real gradients and announced it (`PeerAnnouncement.sensitivity`,
for exactly its layers).
"""

from __future__ import annotations

import dataclasses
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

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

N_LAYERS = ModelConfig().n_layers
STEPS, SWITCH_AFTER = 12, 3


def _until(ready, deadline: float, what: str, stop: threading.Event):
    while not stop.is_set():
        got = ready()
        if got:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what}")
        stop.wait(0.2)
    return None


def test_a_precision_switch_on_a_replan_keeps_the_replicas_bit_identical(tmp_path, monkeypatch):
    started = time.monotonic()
    planner = Identity.generate()  # the trainer's key, and the one trusted planner
    monkeypatch.setattr(Identity, "generate", classmethod(lambda cls: planner))
    plans: list[dict] = []
    found = follower_module.discover_route
    never = threading.Event()

    def publish_then_discover(dht, *args, **kwargs):
        """Plan 1 (stage 1 replicated, fp32) once the 3 peers are announced, then the trainer's usual discovery."""
        monkeypatch.setattr(follower_module, "discover_route", found)
        dht.config = dataclasses.replace(dht.config, trusted_planners=(planner.peer_id,))
        three = lambda: sorted(p.peer_id for p in dht.peers()) if len(dht.peers()) == 3 else None  # noqa: E731
        ids = _until(three, time.monotonic() + 90, "3 peers", never)
        stages = [
            {"layer_start": 0, "layer_end": 1, "peer_ids": [ids[0]]},
            {"layer_start": 1, "layer_end": N_LAYERS, "peer_ids": ids[1:]},
        ]
        plans.append({"stages": stages, "trainer_ids": [dht.peer_id], "precisions": ["fp32", "fp32"]})
        dht.publish_plan(1, plans[0])
        return found(dht, 2, *args[1:], **kwargs)  # 2 stages of 3 peers (local_swarm asks for one per peer)

    monkeypatch.setattr(follower_module, "discover_route", publish_then_discover)
    out = tmp_path / "train"
    flags = ["--assign", "plan", "--trusted-planners", planner.peer_id, "--compute-speed", "40", "--no-link-probe"]
    flags += ["--sensitivity-every-steps", "2"]
    with local_swarm(tmp_path, 3, flags, timeout_s=90) as swarm:
        stop, errors, watcher = threading.Event(), [], GrpcConnector(signer=swarm.signer)

        def switch() -> None:
            try:
                first = plans[0]["stages"][0]["peer_ids"][0]
                address = {p.peer_id: p.address for p in swarm.dht.peers()}[first]
                stub = watcher.stage(address, first)
                steps = lambda: stub.Status(stage_pb2.Empty(), timeout=10).steps_done >= SWITCH_AFTER  # noqa: E731
                if _until(steps, time.monotonic() + 60, f"{SWITCH_AFTER} steps applied", stop):
                    plans.append({**plans[0], "precisions": ["fp32", "bf16"]})
                    swarm.dht.publish_plan(2, plans[1])
            except Exception as e:  # noqa: BLE001 - reported by the test
                errors.append(e)

        switcher = threading.Thread(target=switch, daemon=True)
        switcher.start()
        cfg = TrainConfig(train_samples=16, batch_size=8, micro_batches=2, steps=STEPS, eval_every=0, out=str(out))
        try:
            summary = train(cfg, swarm.path, quiet=True, signer=swarm.signer, dht=swarm.dht)
        finally:
            stop.set()
            switcher.join(30)
            watcher.close()
        assert not errors and not switcher.is_alive(), errors
        announced = {p.peer_id: p for p in swarm.dht.peers()}
        connector = GrpcConnector(signer=swarm.signer)
        replicas = plans[0]["stages"][1]["peer_ids"]
        status = [
            connector.stage(announced[pid].address, pid).Status(stage_pb2.Empty(), timeout=10) for pid in replicas
        ]
        connector.close()
    assert len(plans) == 2 and summary.steps == STEPS
    assert [(r.stage, r.plan_version, r.steps_done) for r in status] == [(1, 2, STEPS)] * 2
    assert [r.metrics["swarm_compute_bits"] for r in status] == [16.0, 16.0], "both replicas switched to bf16"
    assert status[0].weights_digest == status[1].weights_digest, "the replicas' weights are identical, bit for bit"
    for stage in plans[0]["stages"]:
        layers = (stage["layer_start"], stage["layer_end"])
        for pid in stage["peer_ids"]:
            figures = [f for a, b, p, f in announced[pid].sensitivity if (a, b, p) == (*layers, "bf16")]
            assert figures and 0 < figures[0] < 1, f"{pid} announced its measured bf16 sensitivity"
    print(f"precision switch on replicas: {time.monotonic() - started:.1f} s")
