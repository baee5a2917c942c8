"""The tied embedding's sum as rank-r factors (`lowrank`, a plan's epilogue "tied" codec): every copy of the
weight gets the same bits, the sum costs a fraction of gradq4's bytes, the warm start stays the encoder's own,
and a plan naming it is validated like any other epilogue codec."""

from __future__ import annotations

import math

import pytest
import torch

from swarm.compression import CodecConfig
from swarm.experiments.tied import split_tied
from swarm.peers.plan import PlanDocument
from swarm.peers.records import PlanRecord, validate_plan
from swarm.runtime.inprocess import LocalPipeline
from tests.unit.runtime.test_replicas import CFG, batch
from tests.unit.runtime.test_tied import GRADQ, tied_weights
from tests.unit.test_selective import PEERS, STAGES

torch.set_num_threads(1)

LOWRANK = CodecConfig.parse("lowrank4+ef")


def run(tied: CodecConfig | None, steps: int = 3, replicas=(2, 3)):
    pipe = LocalPipeline(CFG, 2, CodecConfig("aqsgd", bits=2), GRADQ, replicas=replicas)
    try:
        for host in (h for hs in pipe.replica_hosts for h in hs):
            host.averager.set_codecs(None, tied)
        results = []
        for step in range(steps):
            results.append(pipe.train_step(batch(n=24, seed=step), n_micro=6))
            copies = tied_weights(pipe)
            assert all(torch.equal(copies[0], c) for c in copies[1:]), f"tied copies differ after step {step}"
        return pipe, results
    finally:
        pipe.close()


def test_every_end_stage_replica_holds_the_same_tied_bits_at_a_fraction_of_gradq4s_bytes():
    pipe, low = run(LOWRANK)
    _, gradq = run(None)
    assert low[-1].traffic.tied_fp32_bytes == gradq[-1].traffic.tied_fp32_bytes
    # 5 members, 20 messages a step, each (vocab + hidden) x 4 fp16 factor elements and 8 column scales plus
    # framing: on this 64 x 32 weight a little under gradq4's 2,048 x 4 bits (the 256 x 128 one: a fifth)
    factors = (CFG.vocab_size + CFG.hidden_dim) * 4 * 2 + 8 * 4
    assert all(lo.sync_bytes < min(0.9 * g.sync_bytes, 20 * (factors + 400)) for lo, g in zip(low, gradq, strict=True))
    hosts = [h for s in (0, 1) for h in pipe.replica_hosts[s]]
    shape = hosts[0].worker.module.tied_parameter().shape  # (vocab, hidden): the factors' view of the weight
    assert hosts[0].averager._config(1, 0, tied=True).group_size == shape[-1]
    for h in hosts:  # each encoder keeps its own warm start and error feedback
        group = h.averager.groups[True]
        assert group.warm is not None and group.warm.shape == (shape[-1], 4)
        assert group.residual is not None and float(group.residual.abs().sum()) > 0


def test_a_plans_lowrank_tied_codec_is_validated_and_read_by_the_end_stages():
    def record(epilogue) -> PlanRecord:
        return PlanRecord(version=2, document={"stages": STAGES, "epilogue_codecs": epilogue}, created_at=1.0)

    good = {"average": [None, None], "tied": "lowrank4+ef+f8"}
    validate_plan(record(good), 4, PEERS)
    plan = PlanDocument.from_wire({"stages": STAGES, "epilogue_codecs": good})
    assert plan.epilogue_configs(1)[1] == CodecConfig.parse("lowrank4+ef+f8")
    for bad in ("lowrank0", "lowrank65", "lowrank4+f2", "gradq4+f8"):
        with pytest.raises(ValueError, match="epilogue_codecs"):
            validate_plan(record({"average": [None, None], "tied": bad}), 4, PEERS)


def test_the_convergence_setting_suffix():
    assert split_tied("a/b@lr4") == ("a/b", None, "lowrank4+ef")
    assert split_tied("a/b@w1@lr8+f8") == ("a/b@w1", None, "lowrank8+ef+f8")
    assert split_tied("a/b@t3") == ("a/b", 3, None) and split_tied("a/b") == ("a/b", None, None)
    for bad in ("a/b@lr", "a/b@lr0", "a/b@lr4+f4", "a/b@lr4@w1", "a/b@lrx"):
        with pytest.raises(ValueError):
            split_tied(bad)


def test_the_convergence_experiment_runs_the_tied_sum_low_rank(tmp_path, capsys):
    import json

    from swarm.cli import main
    from swarm.experiments.convergence import Setting

    assert Setting.parse("tern+ch/gradq2+ef+rot+nr+cs@lr4+f8").tied_codec == "lowrank4+ef+f8"
    assert Setting.parse("tern+ch/gradq2+ef+rot+nr+cs").tied_codec is None  # the default setting is unchanged
    out = tmp_path / "run"
    settings = "fp32/fp32,directq2/gradq2+ef+rot+nr+cs,directq2/gradq2+ef+rot+nr+cs@lr2+f8"
    argv = ["experiment", "convergence", "--quick", "--json", "--no-progress", "--out", str(out), "--epochs", "1"]
    assert main([*argv, "--settings", settings]) == 0
    _, gradq4, low = json.loads(capsys.readouterr().out)
    assert 0 < low["sync_bytes"] < gradq4["sync_bytes"] / 2 and math.isfinite(low["final_eval_loss"])
