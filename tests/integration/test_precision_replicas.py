"""A re-plan that switches a replicated stage's precision keeps its replicas identical, bit for bit.

A 3-peer local swarm (swarm-peer processes) follows the plans of one trusted planner, the trainer's own key: plan 1
has stage 0 on one peer and stage 1 on two replicas, all fp32; while the trainer runs, plan 2 gives stage 1 bf16.
Both replicas switch between two steps (same layers: no handover) under the same plan version, so no step sums
one replica's fp32 gradients with the other's bf16 ones into different weights: after the run both report 16
compute bits, the same steps and the same SHA-256 of their parameters (`StageStatus.weights_digest`), stage 0
still computes in fp32, and the trainer trained on across the switch without a gap. Every peer also measured its
stage's sensitivity from its real gradients and announced it (`PeerAnnouncement.sensitivity`, for exactly its
layers). (A chain of one peer a stage whose middle stage switches was a test of its own: the same harness and
calls, one swarm more in the suite's time.)
"""

from __future__ import annotations

import csv
import math
import time

import pytest

from swarm.model.gpt import ModelConfig
from tests.integration.precision_switch import run_precision_switch

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

N_LAYERS = ModelConfig().n_layers
STEPS, SWITCH_AFTER = 12, 3


def test_a_precision_switch_on_a_replan_keeps_the_replicas_bit_identical(tmp_path, monkeypatch):
    started = time.monotonic()

    def replicated_stage_1(ids: list[str]) -> list[dict]:
        return [
            {"layer_start": 0, "layer_end": 1, "peer_ids": [ids[0]]},
            {"layer_start": 1, "layer_end": N_LAYERS, "peer_ids": ids[1:]},
        ]

    run = run_precision_switch(
        tmp_path, monkeypatch, 3, replicated_stage_1, ["fp32", "bf16"], STEPS, SWITCH_AFTER,
        extra_flags=("--sensitivity-every-steps", "2"), eval_every=0,
    )  # fmt: skip
    assert run.plan_version_at_start == 1
    assert [(r.stage, r.plan_version) for r in run.status[:1]] == [(0, 2)]
    assert run.status[0].metrics["swarm_compute_bits"] == 32.0, "stage 0 kept fp32"
    status = run.status[1:]  # stage 1's two replicas
    assert len(run.plans) == 2 and run.summary.steps == STEPS
    assert [(r.stage, r.plan_version, r.steps_done) for r in status] == [(1, 2, STEPS)] * 2
    assert [r.metrics["swarm_compute_bits"] for r in status] == [16.0, 16.0], "both replicas switched to bf16"
    assert status[0].weights_digest == status[1].weights_digest, "the replicas' weights are identical, bit for bit"
    for stage in run.plans[0]["stages"]:
        layers = (stage["layer_start"], stage["layer_end"])
        for pid in stage["peer_ids"]:
            figures = [f for a, b, p, f in run.announced[pid].sensitivity if (a, b, p) == (*layers, "bf16")]
            assert figures and 0 < figures[0] < 1, f"{pid} announced its measured bf16 sensitivity"
    with open(tmp_path / "train" / "steps.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(1, STEPS + 1)), "every step once, across the switch"
    assert all(math.isfinite(float(r["train_loss"])) for r in rows)
    versions = [int(r["plan_version"]) for r in rows]
    assert versions[0] == 1 and versions[-1] == 2 and versions == sorted(versions), versions
    print(f"precision switch on replicas: {time.monotonic() - started:.1f} s")
