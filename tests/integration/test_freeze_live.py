"""Freezing and the elastic repack live: a 4-peer local swarm (4 stages of one layer), a trainer with `--freeze`
tuned to freeze early. Every stage reports the prefix it applied; once they all report 3 frozen layers the
planner publishes the repacked plan (2 stages, `frozen_layers` 3, 2 replicas each: the peers name hardware of
their own), the peers move their layers through the usual handover, and the trainer follows it and trains on without
a gap; the frozen first stage answers from its activation cache (the model is tied: the tied pair froze with the
prefix). Peers that share hardware stand by instead of replicating: that rule is the planner's
(tests/unit/test_freeze_repack.py, on the keys tests/unit/runtime/test_device.py derives), and its live run here
was the replicas' run without the state copies, one swarm more in the suite's time."""

from __future__ import annotations

import csv
import math

import pytest

from swarm.model.gpt import ModelConfig
from swarm.net.connect import GrpcConnector
from swarm.proto import stage_pb2
from swarm.testbed.local import local_swarm
from swarm.train.freezing import FreezeConfig
from swarm.train.trainer import TrainConfig, train

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

N_LAYERS = ModelConfig().n_layers


def test_the_planner_repacks_a_frozen_prefix_and_the_trainer_trains_on_the_repacked_plan(tmp_path):
    flags = ["--assign", "plan", "--plan-even-layers", "--compute-speed", "40", "--no-link-probe"]
    # tolerance far above any change: every decision freezes (alpha 1: up to the block that changed least)
    freeze = FreezeConfig(interval=2, tolerance=1e6, max_fraction=0.75, alpha=1.0)
    out = tmp_path / "train"
    # each peer names hardware of its own (as on 4 machines), so the freed peers become replicas
    own = [["--compute-group", f"machine-{i}"] for i in range(4)]
    with local_swarm(tmp_path, 4, flags, timeout_s=120, per_peer_flags=own) as swarm:
        first = swarm.dht.get_plan(N_LAYERS)
        cfg = TrainConfig(train_samples=16, batch_size=8, micro_batches=2, steps=24, out=str(out), freeze=freeze)
        summary = train(cfg, swarm.path, quiet=True, signer=swarm.signer, dht=swarm.dht)
        record = swarm.dht.get_plan(N_LAYERS)
        addresses = {p.peer_id: p.address for p in swarm.dht.peers()}
        connector = GrpcConnector(signer=swarm.signer)
        status = {
            pid: connector.stage(addresses[pid], pid).Status(stage_pb2.Empty(), timeout=10)
            for s in record.document.stages
            for pid in s.peer_ids
        }
        connector.close()
    assert first.document.n_stages == 4 and not first.document.frozen_layers
    assert record.document.frozen_layers == 3, record.document
    assert record.document.replica_counts == (2, 2), record.document
    assert not record.document.unused_peer_ids, "every freed peer replicates"
    # the trainer followed the repacked plan and kept training: every step numbered, losses finite
    assert summary.steps == 24 and summary.stages == 2 and first.version < summary.plan_version <= record.version
    with open(out / "steps.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(1, 25))
    assert all(math.isfinite(float(r["train_loss"])) for r in rows)
    # the tied pair froze with the prefix, so the repacked stage 0 (layers 0-2, all frozen) runs forward only and
    # answers samples it already sent from its activation cache (each peer's counter, over Status)
    hits = [status[pid].metrics["swarm_frozen_cache_hits_total"] for pid in record.document.stages[0].peer_ids]
    assert sum(hits) > 0, hits
    # the replicas of each repacked stage took the same state and applied the same steps: equal weights
    for index, stage in enumerate(record.document.stages):
        replies = [status[pid] for pid in stage.peer_ids]
        assert all(r.stage == index and r.layer_end == stage.layer_end for r in replies), replies
        figures = [(r.weights_digest, r.last_step, r.steps_done) for r in replies]
        assert len(set(figures)) == 1, figures
    versions = [int(r["plan_version"]) for r in rows]
    # the switch is quick: the peers retire their old hosts first, so none waits on another's announcement
    # (before: each waited out _settled_replicas' 30 s for holders that were themselves switching)
    switch = versions.index(versions[-1])
    assert float(rows[switch]["time"]) - float(rows[switch - 1]["time"]) < 25.0
    assert versions[0] == first.version and versions[-1] == summary.plan_version and versions == sorted(versions)


def test_a_prefix_that_moves_no_layer_is_held_and_a_trainer_that_connects_later_follows_the_stages(tmp_path):
    """The trainer freezes 1 layer of 4 one-layer stages (its cap), which allows no fewer stages: the planner
    publishes no plan version for it (the stages applied it; the planner holds it). A trainer that connects then
    (a restart, without --freeze) reads the stages' prefix and trains at it: its plan says 0."""
    flags = ["--assign", "plan", "--plan-even-layers", "--compute-speed", "40", "--no-link-probe"]
    freeze = FreezeConfig(interval=2, tolerance=1e6, max_fraction=0.25, alpha=1.0)
    with local_swarm(tmp_path, 4, flags, timeout_s=120) as swarm:
        first = swarm.dht.get_plan(N_LAYERS)
        cfg = TrainConfig(train_samples=16, batch_size=8, micro_batches=2, steps=12, out=str(tmp_path / "a"),
                          freeze=freeze)  # fmt: skip
        frozen_run = train(cfg, swarm.path, quiet=True, signer=swarm.signer, dht=swarm.dht)
        held = swarm.dht.get_plan(N_LAYERS)
        later = TrainConfig(train_samples=16, batch_size=8, micro_batches=2, steps=4, out=str(tmp_path / "b"))
        summary = train(later, swarm.path, quiet=True, signer=swarm.signer, dht=swarm.dht)
    assert frozen_run.steps == 12 and summary.steps == 4
    assert held.version == first.version and not held.document.frozen_layers, "held, not published"
    with open(tmp_path / "a" / "steps.csv") as f:
        assert int(list(csv.DictReader(f))[-1]["frozen_layers"]) == 1
    with open(tmp_path / "b" / "steps.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["frozen_layers"]) for r in rows] == [1] * 4, "the later trainer drove at the stages' prefix"
    assert all(math.isfinite(float(r["train_loss"])) for r in rows)
