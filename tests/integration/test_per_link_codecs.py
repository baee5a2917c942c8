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
