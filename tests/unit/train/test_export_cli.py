"""`swarm export` from checkpoints and from stages (GetState, in process), then `swarm eval` and `swarm generate` on
what it wrote: the held-out loss is the pipeline's, a missing layer or an unreachable stage is named."""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import pytest
import torch

from swarm.compression import CodecConfig, frame, make_codec
from swarm.model.export import model_to_json
from swarm.model.gpt import ModelConfig, build_stage, split_layers
from swarm.model.heldout import held_out_loss, held_out_windows
from swarm.peers.plan import PlanStage
from swarm.proto import stage_pb2
from swarm.runtime.checkpoint import handover_tensors, save_worker
from swarm.runtime.worker import StageWorker
from swarm.train.evaluate import EvalConfig, evaluate_dir
from swarm.train.export_cli import ExportError, save_model, weights_from_checkpoints, weights_from_stages
from swarm.train.generate import GenerateConfig, generate_text

CFG = ModelConfig(vocab_size=256, seq_len_tokens=32, hidden_dim=32, n_layers=4, n_heads=4, init_seed=7)
HELD = {"train_samples": 16, "eval_samples": 4}


def _workers(n_stages: int, cfg: ModelConfig = CFG) -> list[StageWorker]:
    """A pipeline's stages with weights moved off the init."""
    workers = []
    gen = torch.Generator().manual_seed(n_stages)
    for i, (start, end) in enumerate(split_layers(cfg.n_layers, n_stages)):
        stage = build_stage(cfg, start, end, i == 0, i == n_stages - 1)
        with torch.no_grad():
            for p in stage.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
            if i == n_stages - 1 and i > 0:
                stage.head_weight.copy_(workers[0].module.tok_emb.weight)  # the tied copies agree
        workers.append(StageWorker(stage))
    return workers


def _pipeline_loss(workers) -> float:
    windows = held_out_windows(None, CFG.seq_len_tokens, **HELD)

    def logits(tokens):
        x = tokens
        for w in workers:
            x = w.module(x)
        return x

    with torch.no_grad():
        return held_out_loss(logits, windows)


def _save(directory, workers, steps_done=3, model=True):
    ranges = split_layers(CFG.n_layers, len(workers))
    for w, (start, end) in zip(workers, ranges, strict=True):
        save_worker(directory, w, start, end, steps_done, model=model_to_json(CFG) if model else None)


def test_export_from_checkpoints_then_eval_gives_the_pipelines_held_out_loss(tmp_path):
    workers = _workers(2)
    _save(tmp_path / "ck", workers)
    out = save_model(CFG, tmp_path / "model", checkpoint_dir=tmp_path / "ck", **HELD)
    assert out is not None
    result = evaluate_dir(EvalConfig(model=str(out)))
    assert result["eval_samples"] == 4 and result["windows"] == "the run's (recorded)"
    want = _pipeline_loss(workers)
    assert abs(result["held_out_loss"] - want) <= 1e-4 * want
    text = generate_text(GenerateConfig(model=str(out), prompt="def ", max_new_tokens=8))
    assert isinstance(text, str) and len(text.encode("utf-8", "replace")) >= 1


def test_checkpoints_of_two_splits_export_the_newest_layers(tmp_path):
    old, new = _workers(2), _workers(3)
    _save(tmp_path, old, steps_done=3)
    _save(tmp_path, new, steps_done=5)  # a restart under 3 stages, further on: every layer is newer there
    model, weights, info = weights_from_checkpoints(tmp_path)
    assert model == CFG and info["steps_done"] == 5
    torch.testing.assert_close(weights["blocks.1.attn.qkv.weight"], new[0].module.blocks["1"].attn.qkv.weight)
    assert "layers-0000-0002" in info["from"] and "layers-0003-0004" in info["from"]


def test_a_layer_no_checkpoint_holds_is_named_and_nothing_is_written(tmp_path, capsys):
    workers = _workers(2)
    _save(tmp_path / "ck", workers[:1])  # the last stage's disk is gone
    with pytest.raises(ExportError, match=r"no checkpoint holds layers 2, 3, norm\.bias and norm\.weight"):
        weights_from_checkpoints(tmp_path / "ck")
    assert save_model(CFG, tmp_path / "model", checkpoint_dir=tmp_path / "ck") is None
    assert "--save-model" in capsys.readouterr().err and not (tmp_path / "model").exists()


def test_checkpoints_without_a_model_record_need_the_model(tmp_path):
    _save(tmp_path, _workers(2), model=False)
    with pytest.raises(ExportError, match="do not record their model"):
        weights_from_checkpoints(tmp_path)
    assert weights_from_checkpoints(tmp_path, CFG)[0] == CFG
    with pytest.raises(ExportError, match="no stage checkpoint"):
        weights_from_checkpoints(tmp_path / "absent")


class _Stages:
    """An in-process connector: each address streams its stage's GetState items, or fails as told."""

    def __init__(self, workers, broken=(), liar=None):
        self.workers, self.broken, self.liar, self.asked = workers, set(broken), liar, []

    def stage(self, address, peer_id=None):
        return SimpleNamespace(GetState=lambda request, timeout=None: self._items(address, request))

    def _items(self, address, request):
        self.asked.append((address, request.stage, request.plan_version))
        if address in self.broken:
            raise ConnectionError("UNAVAILABLE: connection refused")
        worker = self.workers[int(address.split(":")[1])]
        codec = make_codec(CodecConfig("fp32"))
        tensors = handover_tensors(worker, 3)
        if address == self.liar:  # a weight of another stage's name
            tensors = {"model.blocks.9.ln1.weight": torch.ones(4), **tensors}
        return (
            stage_pb2.StateItem(name=name, chunk=chunk)
            for name, t in tensors.items()
            for chunk in frame(codec.encode(t.float()), zstd_level=0)
        )


def _plan(n_stages, replicas=1):
    stages = [
        PlanStage(start, end, tuple(f"peer{i}r{r}" for r in range(replicas)))
        for i, (start, end) in enumerate(split_layers(CFG.n_layers, n_stages))
    ]
    return SimpleNamespace(stages=stages)


def test_export_from_stages_fetches_each_stage_and_skips_a_dead_replica(tmp_path):
    workers = _workers(2)
    plan = _plan(2, replicas=2)
    addresses = {f"peer{i}r{r}": f"{'dead' if r == 0 and i == 1 else 'host'}{r}:{i}" for i in range(2) for r in (0, 1)}
    connector = _Stages(workers, broken={"dead0:1"})
    weights = weights_from_stages(plan, addresses, CFG, connector, plan_version=4)
    assert [a[1:] for a in connector.asked] == [(0, 4), (1, 4), (1, 4)]  # stage 1's first replica failed
    from swarm.model.export import write_hf_dir

    out = write_hf_dir(CFG, weights, tmp_path / "m", {"held_out": HELD})
    result = evaluate_dir(EvalConfig(model=str(out)))
    assert abs(result["held_out_loss"] - _pipeline_loss(workers)) <= 1e-4 * result["held_out_loss"]


def test_a_stage_none_of_whose_replicas_answers_is_named():
    workers = _workers(3)
    plan = _plan(3)
    addresses = {"peer0r0": "a:0", "peer1r0": "b:1"}  # stage 2's peer is not announced
    connector = _Stages(workers, broken={"b:1"})
    with pytest.raises(ExportError) as e:
        weights_from_stages(plan, addresses, CFG, connector, plan_version=1)
    assert "stage 1 (layers [2, 3)): peer1r0: UNAVAILABLE" in str(e.value)
    assert "stage 2 (layers [3, 4)): peer2r0: not announced" in str(e.value)
    assert "stage 0" not in str(e.value)


class _Refused(Exception):
    """What grpc raises for a refused call: a status code and details, and a many-line repr."""

    def code(self):
        import grpc

        return grpc.StatusCode.PERMISSION_DENIED

    def details(self):
        return "not authorized: GetState only to a peer of the plan or a trainer it names"

    def __str__(self):
        return "<_MultiThreadedRendezvous of RPC that terminated with:\n\tstatus = ...>"


def test_a_refused_fetch_is_one_line_with_the_way_out():
    connector = _Stages(_workers(2))
    connector._items = lambda address, request: (_ for _ in ()).throw(_Refused())
    with pytest.raises(ExportError) as e:
        weights_from_stages(_plan(2), {"peer0r0": "a:0", "peer1r0": "b:1"}, CFG, connector, plan_version=1)
    text = str(e.value)
    assert "\n" not in text and "peer0r0: PERMISSION_DENIED: not authorized" in text
    assert text.endswith("export with the run's trainer key (--identity)")


def test_a_stage_that_sends_foreign_weights_is_refused_by_name():
    workers = _workers(2)
    connector = _Stages(workers, liar="x:0")
    with pytest.raises(ExportError, match=r"stage 0 .*blocks\.9\.ln1\.weight"):
        weights_from_stages(_plan(2), {"peer0r0": "x:0", "peer1r0": "y:1"}, CFG, connector, plan_version=1)


def test_the_commands_report_errors_in_one_line(tmp_path, capsys):
    from swarm.train import evaluate, export_cli, generate

    assert evaluate.run(_args(evaluate, "--model", str(tmp_path))) == 2
    assert "no config.json" in capsys.readouterr().err
    assert generate.run(_args(generate, "--prompt", "x")) == 2
    assert "--model DIR is required" in capsys.readouterr().err
    assert export_cli.run(_args(export_cli, "--out", str(tmp_path / "o"), "--checkpoint-dir", str(tmp_path))) == 2
    assert "no stage checkpoint" in capsys.readouterr().err


def test_the_export_command_writes_a_directory_eval_reads(tmp_path, capsys):
    from swarm.train import evaluate, export_cli

    _save(tmp_path / "ck", _workers(2))
    argv = ["--checkpoint-dir", str(tmp_path / "ck"), "--out", str(tmp_path / "m"), "--train-samples", "16"]
    assert export_cli.run(_args(export_cli, *argv, "--eval-samples", "4", "--json")) == 0
    assert json.loads(capsys.readouterr().out)["family"] == "gpt2"
    assert evaluate.run(_args(evaluate, "--model", str(tmp_path / "m"), "--json")) == 0
    assert json.loads(capsys.readouterr().out)["eval_samples"] == 4


def _args(module, *argv):
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_generate_keeps_within_the_positions_and_samples_by_seed(tmp_path):
    from swarm.model.export import write_hf_dir

    weights = {}
    for w in _workers(1):
        weights.update(w.module.state_dict())
    out = write_hf_dir(CFG, weights, tmp_path / "m")
    long = generate_text(GenerateConfig(model=str(out), prompt="x" * 100, max_new_tokens=20))
    assert len(long.encode("utf-8", "replace")) >= 20 // 3  # the prompt's last 12 bytes, then 20 new (U+FFFD: 3)
    most = generate_text(GenerateConfig(model=str(out), prompt="x" * 100, max_new_tokens=500))
    assert len(most.encode("utf-8", "replace")) <= 3 * 31  # at most the 32 positions less one of prompt
    sampled = [
        generate_text(GenerateConfig(model=str(out), prompt="def ", max_new_tokens=6, temperature=1.0, seed=s))
        for s in (1, 1, 2)
    ]
    assert sampled[0] == sampled[1]
    with pytest.raises(ValueError):
        GenerateConfig(model=str(out), max_new_tokens=0)


def test_export_without_a_source_says_what_to_give(tmp_path, capsys):
    from swarm.train import export_cli

    assert export_cli.run(_args(export_cli, "--out", str(tmp_path / "o"))) == 2
    assert "give --checkpoint-dir DIR, or a live swarm to join" in capsys.readouterr().err
    assert export_cli.run(_args(export_cli, "--checkpoint-dir", str(tmp_path))) == 2
    assert "--out DIR is required" in capsys.readouterr().err


def test_a_live_export_reads_the_plan_again_when_the_stages_serve_a_newer_one(monkeypatch):
    """The demo's planner republished plan 2 as training ended; the trainer's DHT still read plan 1 (and a plan that
    names the finished trainer must not be skipped): the stages' refusal sends the export back to the plan."""
    import swarm.daemon.nat
    import swarm.net.connect
    from swarm.train import export_cli

    seen = []

    class FakeDht:
        versions = iter([1, 2])

        def get_plan(self, n_layers, check_trainers=True):
            seen.append(check_trainers)
            return SimpleNamespace(version=next(self.versions), document=SimpleNamespace(stages=[]))

        def peers(self):
            return []

    def fetch(document, addresses, model, connector, version, timeout_s):
        if version == 1:
            raise ExportError(  # the stages' shared marker (swarm.net.stream.PLAN_MISMATCH), not the wording
                "could not fetch stage 0: FAILED_PRECONDITION: plan-mismatch: this peer holds stage 0 of plan 2, "
                "not stage 0 of plan 1"
            )
        return {"w": torch.zeros(1)}

    monkeypatch.setattr(export_cli, "weights_from_stages", fetch)
    monkeypatch.setattr(export_cli, "PLAN_RETRY_S", 0.0)
    monkeypatch.setattr(swarm.net.connect, "GrpcConnector", lambda **kw: SimpleNamespace(close=lambda: None))
    monkeypatch.setattr(swarm.daemon.nat, "announced_dial", lambda *a: None)
    weights, info = export_cli.weights_from_swarm(FakeDht(), ModelConfig(), signer=None)
    assert info["plan_version"] == 2 and list(weights) == ["w"] and seen == [False, False]


def test_a_live_export_gives_up_on_other_refusals_at_once(monkeypatch):
    import swarm.daemon.nat
    import swarm.net.connect
    from swarm.train import export_cli

    calls = []

    class FakeDht:
        def get_plan(self, n_layers, check_trainers=True):
            calls.append(1)
            return SimpleNamespace(version=3, document=SimpleNamespace(stages=[]))

        def peers(self):
            return []

    def fetch(*args):
        raise ExportError(reason)

    monkeypatch.setattr(export_cli, "weights_from_stages", fetch)
    monkeypatch.setattr(swarm.net.connect, "GrpcConnector", lambda **kw: SimpleNamespace(close=lambda: None))
    monkeypatch.setattr(swarm.daemon.nat, "announced_dial", lambda *a: None)
    reason = "could not fetch stage 1: PERMISSION_DENIED"
    with pytest.raises(ExportError, match="PERMISSION_DENIED"):
        export_cli.weights_from_swarm(FakeDht(), ModelConfig(), signer=None)
    assert calls == [1]
    # a refusal that says "not stage" without the plan marker (a call routed to the wrong stage) is no newer plan
    reason = "could not fetch stage 1: FAILED_PRECONDITION: this peer serves stage 0, not stage 1"
    with pytest.raises(ExportError, match="serves stage 0"):
        export_cli.weights_from_swarm(FakeDht(), ModelConfig(), signer=None)
    assert calls == [1, 1]


def test_held_out_of_a_train_config_names_its_windows_and_the_default_where_it_held_none_out():
    from swarm.model.heldout import DEFAULT_EVAL_SAMPLES
    from swarm.train.export_cli import held_out_of
    from swarm.train.trainer import TrainConfig

    cfg = TrainConfig(data="corpus.txt", train_samples=32, eval_samples=7)
    assert held_out_of(cfg) == {"data": "corpus.txt", "train_samples": 32, "eval_samples": 7}
    assert held_out_of(TrainConfig(eval_samples=0))["eval_samples"] == DEFAULT_EVAL_SAMPLES
    with pytest.raises(AttributeError):  # not a TrainConfig: no silent default for a field every config has
        held_out_of(SimpleNamespace(data=None, train_samples=32))


def test_generate_samples_by_default_and_is_greedy_at_temperature_zero(tmp_path):
    """`swarm demo`'s model answered "def " with 64 spaces under the old greedy default; the default now samples
    (0.8, top 40), the same text for the same seed; temperature 0 is the greedy argmax chain."""
    from dataclasses import replace

    from swarm.model.export import write_hf_dir
    from swarm.train.evaluate import load_exported

    weights = {}
    for w in _workers(1):
        weights.update(w.module.state_dict())
    out = write_hf_dir(CFG, weights, tmp_path / "m")
    cfg = GenerateConfig(model=str(out), prompt="def ", max_new_tokens=12)
    assert (cfg.temperature, cfg.top_k) == (0.8, 40)
    by_seed = {s: generate_text(replace(cfg, seed=s)) for s in range(4)}
    assert generate_text(cfg) == by_seed[0] and len(set(by_seed.values())) > 1  # seeded, and not one fixed chain
    greedy = generate_text(replace(cfg, temperature=0.0))
    model, _ = load_exported(str(out))
    ids = list(b"def ")
    for _ in range(12):
        with torch.no_grad():
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert greedy == bytes(ids[4:]).decode("utf-8", "replace")
