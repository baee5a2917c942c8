"""`--codec-policy per-link` live: a 3-stage local swarm where one peer's outgoing links are slow (1 Mbit/s) and
the others' are not plans different codecs on its two boundaries from the probed rates, and trains on them."""

from __future__ import annotations

import math

import pytest

from swarm.compression import CodecConfig
from swarm.model.gpt import ModelConfig
from swarm.peers.dht import wait_for
from swarm.scheduler.bits import BACKWARD_LADDER, FORWARD_LADDER, TIED_LADDER
from swarm.testbed.local import local_swarm
from swarm.train.trainer import TrainConfig, train

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]


def bits(label: str) -> int:
    return 32 if label == "fp32" else CodecConfig.parse(label).bits


def floored(record) -> bool:
    """Whether `record` chose per-link codecs with some direction at the 2-bit floor."""
    codecs = record.document.codecs if record is not None else None
    return bool(codecs) and min(bits(label) for c in codecs for label in (c.forward_label, c.backward_label)) == 2


def test_a_slow_and_a_fast_link_get_different_codecs_and_train(tmp_path):
    flags = ["--assign", "plan", "--codec-policy", "per-link", "--plan-even-layers", "--compute-speed", "40"]
    slow = [["--rate-mbit", "1"], [], []]  # peer 0 sends at 1 Mbit/s to everyone; the others unshaped
    with local_swarm(tmp_path, 3, flags, per_peer_flags=slow, timeout_s=240) as swarm:
        # the first plan may come before the slow link's probe: its codecs are chosen again once it is measured
        # (a loaded machine probes late), and the trainer then follows that plan
        wait_for(lambda: floored(swarm.dht.get_plan(ModelConfig().n_layers)), 120, what="a plan with a floor codec")
        cfg = TrainConfig(train_samples=16, batch_size=8, micro_batches=4, steps=4, out=str(tmp_path / "train"))
        summary = train(cfg, swarm.path, quiet=True, signer=swarm.signer, dht=swarm.dht)
        record = swarm.dht.get_plan(ModelConfig().n_layers)
    assert summary.steps == 4 and math.isfinite(summary.final_loss)
    pairs = [(c.forward_label, c.backward_label) for c in record.document.codecs]
    assert len(pairs) == 2 and all(fw in FORWARD_LADDER and bw in BACKWARD_LADDER for fw, bw in pairs)
    assert pairs[0] != pairs[1], pairs
    labels = [label for pair in pairs for label in pair]
    # the slow peer's outgoing direction is at the floor; some direction between the unshaped peers carries more
    assert min(map(bits, labels)) == 2 and max(map(bits, labels)) > 2, pairs
    # the tied sync's codec is chosen per link too (selective compression), and the peers trained with it
    epilogue = record.document.epilogue
    assert epilogue.average_labels == (None, None, None) and epilogue.tied_label in TIED_LADDER, epilogue


def test_the_selective_policy_plans_only_the_replicas_sums_and_trains_on_them(tmp_path):
    # --codec-policy selective: 2 stages x 2 replicas on loopback; the links keep the flags' codecs, each stage's
    # sum and the tied sync get the planner's codecs (from the probed links and this machine's codec speed)
    import csv

    from swarm.scheduler.bits import AVERAGE_LADDER

    flags = ["--assign", "plan", "--codec-policy", "selective", "--plan-even-layers", "--compute-speed", "40",
             "--replicas", "2", "--min-peers", "4"]  # fmt: skip
    with local_swarm(tmp_path, 4, flags, timeout_s=240, n_stages=2) as swarm:
        record = swarm.dht.get_plan(ModelConfig().n_layers)
        cfg = TrainConfig(train_samples=16, batch_size=8, micro_batches=4, steps=4, out=str(tmp_path / "train"))
        summary = train(cfg, swarm.path, quiet=True, signer=swarm.signer, dht=swarm.dht)
    assert summary.steps == 4 and math.isfinite(summary.final_loss)
    document = record.document
    assert [len(st.peer_ids) for st in document.stages] == [2, 2]
    assert not document.codecs, "the boundaries keep --fw-codec/--bw-codec"
    epilogue = document.epilogue
    assert all(label in AVERAGE_LADDER for label in epilogue.average_labels), epilogue
    assert epilogue.tied_label in TIED_LADDER and "share" in epilogue.why
    with open(tmp_path / "train" / "steps.csv") as f:
        rows = list(csv.DictReader(f))
    assert rows and all(int(r["reduce_bytes"]) > 0 for r in rows), "every step summed the replicas' gradients"


def test_the_planner_chooses_epilogue_only_compression_and_the_peers_train_on_it(tmp_path):
    # --plan-epilogue-only: the plan carries which backward messages go compressed, from the announced speeds and
    # the probed links; at 1 Mbit/s every backward message is on the critical path, so every one stays compressed
    from swarm.runtime.boundary import EpilogueOnly

    flags = ["--assign", "plan", "--plan-epilogue-only", "--plan-even-layers", "--compute-speed", "40",
             "--rate-mbit", "1"]  # fmt: skip
    with local_swarm(tmp_path, 2, flags, timeout_s=240) as swarm:
        record = swarm.dht.get_plan(ModelConfig().n_layers)
        cfg = TrainConfig(train_samples=16, batch_size=8, micro_batches=4, steps=4, out=str(tmp_path / "train"))
        summary = train(cfg, swarm.path, quiet=True, signer=swarm.signer, dht=swarm.dht)
    assert summary.steps == 4 and math.isfinite(summary.final_loss)
    chosen = EpilogueOnly.parse(record.document.bw_epilogue)
    assert chosen.precise.label == "fp32" and chosen.plan.tails == (4,) and chosen.plan.n_micro == 4, chosen
