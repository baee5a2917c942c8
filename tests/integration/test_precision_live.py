"""Per-peer precision switched live: a 3-peer local swarm (swarm-peer processes) follows the plans of one
trusted planner, the trainer's own key (`--trusted-planners`: the plans are this test's). Plan 1 computes every
stage in fp32; while the trainer runs, plan 2 gives stage 1 bf16 (`"precisions"`, swarm.scheduler.precision_choice).
The peer of stage 1 switches between two steps (same layers: no handover) and reports 16 compute bits in its
Status, and the trainer trains on across the switch without a gap."""

from __future__ import annotations

import csv
import math
import time

import pytest

from swarm.model.gpt import ModelConfig
from tests.integration.precision_switch import run_precision_switch

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

N_LAYERS = ModelConfig().n_layers
STEPS, SWITCH_AFTER = 30, 4
BOUNDS = [(0, 1), (1, 2), (2, N_LAYERS)]


def test_a_plan_that_switches_one_stage_to_bf16_keeps_the_swarm_training(tmp_path, monkeypatch):
    started = time.monotonic()

    def one_peer_a_stage(ids: list[str]) -> list[dict]:
        return [{"layer_start": a, "layer_end": b, "peer_ids": [p]} for (a, b), p in zip(BOUNDS, ids, strict=True)]

    run = run_precision_switch(
        tmp_path, monkeypatch, 3, one_peer_a_stage, ["fp32", "bf16", "fp32"], STEPS, SWITCH_AFTER
    )
    assert run.plan_version_at_start == 1
    assert len(run.plans) == 2, "plan 2 was published while the trainer ran"
    assert [(r.stage, r.plan_version) for r in run.status] == [(0, 2), (1, 2), (2, 2)]
    assert [r.metrics["swarm_compute_bits"] for r in run.status] == [32.0, 16.0, 32.0], "stage 1 switched to bf16"
    with open(tmp_path / "train" / "steps.csv") as f:
        rows = list(csv.DictReader(f))
    assert run.summary.steps == STEPS and [int(r["step"]) for r in rows] == list(range(1, STEPS + 1))
    assert all(math.isfinite(float(r["train_loss"])) for r in rows)
    versions = [int(r["plan_version"]) for r in rows]
    assert versions[0] == 1 and versions[-1] == 2 and versions == sorted(versions), versions
    print(f"precision switch test: {time.monotonic() - started:.1f} s, switched at step {versions.index(2) + 1}")
