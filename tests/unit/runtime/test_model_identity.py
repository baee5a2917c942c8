"""Peers and the trainer agree on the model: every stage reports its model's identity in Status, and a
trainer facing a stage of another model refuses it before any step, naming both models and the stage."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from swarm.model.gpt import ModelConfig
from swarm.model.spec import model_identity
from swarm.peers.plan import PlanDocument
from swarm.proto import stage_pb2
from swarm.runtime.inprocess import LocalPipeline
from swarm.runtime.modelcheck import ModelMismatch, check_status, model_label

torch.set_num_threads(1)

CFG = ModelConfig(vocab_size=64, seq_len_tokens=8, hidden_dim=16, n_layers=2, n_heads=2, init_seed=3)


def test_every_stage_reports_its_models_identity_and_the_driver_accepts_the_same_model():
    pipe = LocalPipeline(CFG, 2)
    identity = model_identity(CFG)
    assert [h.status().model_identity for h in pipe.hosts] == [identity, identity]
    pipe.driver(2).check_model(identity, model_label(CFG))  # no error


def test_a_stage_of_another_model_is_refused_naming_both_models_and_the_stage():
    pipe = LocalPipeline(CFG, 2)
    other = dataclasses.replace(CFG, init_seed=4)
    pipe.hosts[1].model_identity = model_identity(other)  # stage 1 was started with another --model-seed
    with pytest.raises(ModelMismatch) as err:
        pipe.driver(2).check_model(model_identity(CFG), model_label(CFG))
    text = str(err.value)
    assert "stage 1" in text and pipe.hosts[1].peer_id in text
    assert model_identity(other)[:16] in text and model_identity(CFG)[:16] in text and "gpt 2 layers" in text


def test_a_stage_that_reports_no_identity_is_refused():
    with pytest.raises(ModelMismatch, match="unknown"):
        check_status(stage_pb2.StatusReply(), model_identity(CFG), "", "stage 0")


def test_identity_depends_on_what_fixes_the_weights_not_on_anything_else():
    assert model_identity(CFG) == model_identity(dataclasses.replace(CFG))
    for change in ({"n_layers": 3}, {"seq_len_tokens": 16}, {"init_seed": 0}, {"hidden_dim": 32}):
        assert model_identity(dataclasses.replace(CFG, **change)) != model_identity(CFG)


def test_a_peer_names_each_plan_peer_that_serves_another_model():
    from swarm.runtime.modelcheck import foreign_models

    mine, other = model_identity(CFG), model_identity(dataclasses.replace(CFG, n_layers=3))
    replies = {
        "a:1": stage_pb2.StatusReply(model_identity=mine),
        "b:2": stage_pb2.StatusReply(model_identity=other),
        "c:3": stage_pb2.StatusReply(),  # serves no stage yet: not judged
        "d:4": None,  # does not answer: not judged
    }
    peers = {"pa": "a:1", "pb": "b:2", "pc": "c:3", "pd": "d:4"}
    problems = foreign_models(replies.get, peers, mine, model_label(CFG))
    assert len(problems) == 1
    assert "peer pb at b:2" in problems[0] and other[:16] in problems[0] and mine[:16] in problems[0]


def test_a_peer_following_a_plan_logs_each_plan_peer_of_another_model(monkeypatch, caplog):
    from types import SimpleNamespace

    from swarm.runtime import modelcheck

    mine, other = model_identity(CFG), model_identity(dataclasses.replace(CFG, init_seed=9))
    replies = {"b:2": stage_pb2.StatusReply(model_identity=other), "c:3": stage_pb2.StatusReply(model_identity=mine)}
    monkeypatch.setattr(modelcheck, "peer_status", lambda channels, address: replies.get(address))
    stages = [
        {"layer_start": 0, "layer_end": 1, "peer_ids": ["me", "pb"]},
        {"layer_start": 1, "layer_end": 2, "peer_ids": ["pc"]},
    ]
    record = SimpleNamespace(version=3, document=PlanDocument.from_wire({"stages": stages}))
    announced = [SimpleNamespace(peer_id=p, address=a) for p, a in (("me", "a:1"), ("pb", "b:2"), ("pc", "c:3"))]
    host = SimpleNamespace(model_identity=mine, model=CFG)
    with caplog.at_level("ERROR", logger="swarm.runtime.modelcheck"):
        modelcheck.check_plan_models(None, record, lambda: announced, "me", host).join(10)
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "plan 3: peer pb at b:2 serves model" in errors[0] and other[:16] in errors[0]
    assert modelcheck.check_plan_models(None, record, lambda: announced, "me", None) is None  # standby: nothing


def test_the_model_check_never_fails_the_plan_switch_on_a_slow_dht(caplog):
    from types import SimpleNamespace

    from swarm.runtime import modelcheck

    def announced():
        raise TimeoutError("DHT get timed out")

    stages = [{"layer_start": 0, "layer_end": 1, "peer_ids": ["me", "pb"]}]
    record = SimpleNamespace(version=4, document=PlanDocument.from_wire({"stages": stages}))
    host = SimpleNamespace(model_identity=model_identity(CFG), model=CFG)
    with caplog.at_level("WARNING", logger="swarm.runtime.modelcheck"):
        modelcheck.check_plan_models(None, record, announced, "me", host).join(10)
    assert any("could not read the announcements" in r.getMessage() for r in caplog.records)
