"""Mixed precision across the stages of a LocalPipeline: bf16 and fp16 train close to fp32; an Inf in one stage's
gradient makes every stage and replica skip the step together (weights and optimizer bit for bit unchanged, the
scale halved everywhere) and the next step applies; the scale grows after N good steps, survives a checkpoint
and a handover; and Steps or calls that disagree about the skip or the scale are refused with nothing changed."""

from __future__ import annotations

import math
import threading

import grpc
import pytest
import torch

from swarm.net.connect import LocalRpcError
from swarm.net.stream import StageCallError
from swarm.proto import stage_pb2
from swarm.runtime.checkpoint import handover_tensors, load_worker, save_worker, take_over
from swarm.runtime.inprocess import LocalPipeline
from swarm.runtime.precision import LossScaler, ScalerConfig
from swarm.runtime.worker import OptimConfig, StageConfig, StageWorker
from tests.unit.runtime.test_replicas import CFG, FP32, batch
from tests.unit.runtime.test_tied import as_host, trainer

torch.set_num_threads(1)


def pipeline(precision: str, n_stages: int = 3, replicas: int = 1, optim=None, **scaler) -> LocalPipeline:
    cfg = StageConfig(optim=optim or OptimConfig(), precision=precision, scaler=ScalerConfig(**scaler))
    return LocalPipeline(CFG, n_stages, FP32, FP32, stage_cfg=cfg, replicas=replicas)


def hosts(pipe: LocalPipeline):
    return [h for row in pipe.replica_hosts for h in row]


def snapshot(pipe: LocalPipeline):
    """Every host's weights and optimizer moments, cloned."""
    out = []
    for h in hosts(pipe):
        w = h.worker
        params = {n: p.detach().clone() for n, p in w.module.named_parameters()}
        state = w.optimizer.state
        moments = {(n, k): v.clone() for n, p in w.module.named_parameters() for k, v in state.get(p, {}).items()}
        out.append((params, moments, w.step_count))
    return out


def same(a, b) -> bool:
    return all(
        pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa) and ma.keys() == mb.keys()
        and all(torch.equal(ma[k], mb[k]) for k in ma) and ca == cb
        for (pa, ma, ca), (pb, mb, cb) in zip(a, b, strict=True)
    )  # fmt: skip


class Poison:
    """Turns one parameter's gradient into Inf while armed (a hook on the parameter, as an fp16 overflow)."""

    def __init__(self, param: torch.nn.Parameter):
        self.armed = False
        param.register_hook(lambda g: g * math.inf if self.armed else g)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_trains_close_to_fp32(precision):
    losses = {}
    for p in ("fp32", precision):
        pipe = pipeline(p, optim=OptimConfig(lr_peak=1e-2, warmup_steps=1, total_steps=6))
        try:
            losses[p] = [pipe.train_step(batch(seed=s % 2), n_micro=2).loss for s in range(6)]
            if p != "fp32":
                assert all(h.worker.precision == precision for h in hosts(pipe))
        finally:
            pipe.close()
    ref, half = losses["fp32"], losses[precision]
    assert half != ref  # autocast is on
    assert half[-1] < half[0] - 0.05  # it learns
    assert max(abs(a - b) for a, b in zip(ref, half, strict=True)) < 0.02


def test_inf_in_one_stage_skips_the_step_on_every_stage_and_replica():
    pipe = pipeline("fp16", n_stages=3, replicas=2)
    try:
        first = pipe.train_step(batch(seed=0), n_micro=4)
        assert not first.skipped and first.loss_scale == 2.0**16 and first.lr > 0
        poison = Poison(next(pipe.replica_hosts[1][1].worker.module.parameters()))  # a middle stage, replica 1
        before = snapshot(pipe)
        poison.armed = True
        skipped = pipe.train_step(batch(seed=1), n_micro=4)
        poison.armed = False
        assert skipped.skipped and not math.isfinite(skipped.grad_norm) and skipped.lr == 0.0
        assert same(before, snapshot(pipe))  # nothing applied anywhere, bit for bit; no lr step either
        assert {h.worker.loss_scale for h in hosts(pipe)} == {2.0**15} and skipped.loss_scale == 2.0**15
        assert all(p.grad is None for h in hosts(pipe) for p in h.worker.module.parameters())
        assert {h.ledger.last_step for h in hosts(pipe)} == {1}
        after = pipe.train_step(batch(seed=1), n_micro=4)  # the next step applies, at the lowered scale
        assert not after.skipped and after.lr == pytest.approx(first.lr * 2)  # warm-up resumed where it was
        assert {h.worker.step_count for h in hosts(pipe)} == {2}
        assert not same(before, snapshot(pipe))
        for row in pipe.replica_hosts:  # the replicas still agree
            assert len({h.status().weights_digest for h in row}) == 1
    finally:
        pipe.close()


def test_scale_grows_after_n_good_steps():
    pipe = pipeline("fp16", n_stages=2, init_scale=2.0**10, growth_interval=2)
    try:
        scales = [pipe.train_step(batch(seed=s), n_micro=2).loss_scale for s in range(5)]
        assert scales == [2.0**10, 2.0**11, 2.0**11, 2.0**12, 2.0**12]
        assert {h.worker.loss_scale for h in hosts(pipe)} == {2.0**12}
    finally:
        pipe.close()


def test_scaler_round_trips_through_a_checkpoint_and_a_handover(tmp_path):
    def fp16_worker() -> StageWorker:
        from swarm.model.gpt import build_stage

        return StageWorker(build_stage(CFG, 0, 2, True, False), StageConfig(precision="fp16"))

    a = fp16_worker()
    a.scaler.update(True)
    a.scaler.update(False)
    path = save_worker(tmp_path, a, 0, 2, steps_done=2)
    b = fp16_worker()
    load_worker(path, b, 0, 2)
    assert (b.scaler.scale, b.scaler.good_steps) == (2.0**15, 1)
    c = fp16_worker()
    take_over(c, handover_tensors(a, 2))
    assert (c.scaler.scale, c.scaler.good_steps) == (2.0**15, 1)
    # an fp32 stage reads an fp16 checkpoint (the scale is ignored), an fp16 stage an fp32 one (fresh scale)
    from swarm.model.gpt import build_stage

    d = StageWorker(build_stage(CFG, 0, 2, True, False))
    load_worker(path, d, 0, 2)
    save_worker(tmp_path / "fp32", d, 0, 2, steps_done=2)
    e = fp16_worker()
    load_worker(tmp_path / "fp32" / path.name, e, 0, 2)
    assert e.scaler.scale == 2.0**16
    # a stranger's handover with a bad scale changes nothing
    bad = handover_tensors(a, 2)
    bad["amp.scale"] = torch.tensor([float("nan")])
    f = fp16_worker()
    weights = {n: p.detach().clone() for n, p in f.module.named_parameters()}
    with pytest.raises(ValueError, match="amp.scale"):
        take_over(f, bad)
    assert f.scaler.scale == 2.0**16 and all(torch.equal(p, weights[n]) for n, p in f.module.named_parameters())


def _open_reduced_step(pipe: LocalPipeline, step: int):
    """Runs step `step`'s forward, backward and Reduce, leaving it open for a hand-made Step."""
    driver = pipe.driver(2)
    driver.forward_backward(step, batch(seed=step))
    driver._reduce(step, driver.routes, threading.Event())
    return driver


def _step(pipe, s, **fields):
    return trainer(pipe, s).Step(stage_pb2.StepRequest(**fields), timeout=10)


def test_disagreeing_steps_are_refused_and_change_nothing():
    pipe = pipeline("fp16", n_stages=2)
    try:
        pipe.train_step(batch(seed=0), n_micro=2)
        _open_reduced_step(pipe, 1)
        before = snapshot(pipe)
        scale = pipe.hosts[0].worker.loss_scale
        cases = [
            ({"global_grad_norm": math.nan}, grpc.StatusCode.INVALID_ARGUMENT, "disagrees"),  # NaN without skip
            ({"global_grad_norm": 1.0, "skip": True}, grpc.StatusCode.INVALID_ARGUMENT, "disagrees"),
            ({"global_grad_norm": -1.0}, grpc.StatusCode.INVALID_ARGUMENT, "negative"),
            ({"global_grad_norm": 1.0, "loss_scale": scale * 2}, grpc.StatusCode.FAILED_PRECONDITION, "loss_scale"),
        ]
        for fields, code, words in cases:
            with pytest.raises(LocalRpcError) as e:
                _step(pipe, 0, step=1, **{"loss_scale": scale, **fields})
            assert e.value.code() == code and words in e.value.details()
        # a stranger (a stage host, not the trainer) may not step at all, even with a well-formed skip
        with pytest.raises(LocalRpcError) as e:
            as_host(pipe, (1, 0), (0, 0)).Step(
                stage_pb2.StepRequest(step=1, global_grad_norm=math.inf, skip=True), timeout=10
            )
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert same(before, snapshot(pipe)) and pipe.hosts[0].worker.loss_scale == scale
        # the well-formed skip applies once; its replay changes nothing (the scale is not halved twice)
        for _ in range(2):
            reply = _step(pipe, 0, step=1, global_grad_norm=math.inf, skip=True, loss_scale=scale)
            assert reply.skipped and reply.loss_scale == scale / 2
        assert pipe.hosts[0].worker.loss_scale == scale / 2 and pipe.hosts[0].worker.skipped_steps == 1
        pipe.driver(2).abandon(1)
    finally:
        pipe.close()


def test_a_stage_that_found_inf_refuses_a_finite_norm():
    pipe = pipeline("fp16", n_stages=2)
    try:
        poison = Poison(next(pipe.hosts[1].worker.module.parameters()))
        poison.armed = True
        _open_reduced_step(pipe, 0)
        before = snapshot(pipe)
        with pytest.raises(LocalRpcError) as e:
            _step(pipe, 1, step=0, global_grad_norm=1.0, loss_scale=2.0**16)
        assert "cannot be finite" in e.value.details()
        assert same(before, snapshot(pipe))
        pipe.driver(2).abandon(0)
    finally:
        pipe.close()


def test_a_stage_with_another_scale_is_refused_before_it_computes():
    """A stage that restarted without its scaler's state holds the initial scale: the trainer's calls name the
    agreed one and are refused; a trainer that has not heard a scale yet finds the disagreement in Grads and
    abandons the step. Either way nothing is applied."""
    pipe = pipeline("fp16", n_stages=3)
    try:
        pipe.train_step(batch(seed=0), n_micro=2)
        for h in hosts(pipe):
            h.worker.scaler.update(True)  # as after a skip: 2**15 everywhere ...
        pipe.driver(2).loss_scale = 2.0**15
        pipe.hosts[1].worker.scaler = LossScaler(pipe.hosts[1].worker.cfg.scaler)  # ... but a restarted stage 1
        before = snapshot(pipe)
        with pytest.raises(StageCallError, match="loss_scale"):
            pipe.train_step(batch(seed=1), n_micro=2)
        assert same(before, snapshot(pipe))
        fresh = pipe.driver(2, deadline_s=30.0)  # a new trainer: knows no scale yet
        assert fresh.loss_scale == 0.0
        # the two other stages agree: the odd one is struck (evicted after 3) and the step skipped, not the run
        assert pipe.train_step(batch(seed=1), n_micro=2).skipped
        assert fresh.suspects.strikes(pipe.replica_peers[1][0]) == 1
        assert same(before, snapshot(pipe))
        assert all(h.open_step is None for h in hosts(pipe))  # abandoned everywhere
    finally:
        pipe.close()


def test_an_unscaled_stage_refuses_a_scaled_call():
    pipe = pipeline("fp32", n_stages=2)
    try:
        pipe.driver(2).loss_scale = 2.0**16
        with pytest.raises(StageCallError, match="no loss scaling"):
            pipe.train_step(batch(seed=0), n_micro=2)
        pipe.driver(2).loss_scale = 0.0
        r = pipe.train_step(batch(seed=0), n_micro=2)
        assert r.loss_scale == 1.0 and not r.skipped
    finally:
        pipe.close()


def test_a_held_copy_keeps_the_loss_scale(tmp_path):
    """A peer holding a stage's copy for takeover (swarm.daemon.held) keeps its scaler's state with it."""
    from swarm.daemon.held import HeldStore
    from swarm.model.gpt import build_stage

    a = StageWorker(build_stage(CFG, 0, 2, True, False), StageConfig(precision="fp16"))
    a.scaler.update(True)
    store = HeldStore(tmp_path)
    assert store.save(0, 2, handover_tensors(a, 3))
    b = StageWorker(build_stage(CFG, 0, 2, True, False), StageConfig(precision="fp16"))
    take_over(b, HeldStore(tmp_path).load(0, 2))
    assert b.scaler.scale == 2.0**15


def test_a_skip_with_the_default_codecs_keeps_the_links_in_step():
    """With AQ-SGD activations and gradq gradients on the boundary, an overflowed stage sends zeros (the codecs
    refuse Inf/NaN): both ends' buffers move alike, the step is skipped, and the next steps train on."""
    from swarm.compression import DEFAULT_BACKWARD_CODEC, DEFAULT_FORWARD_CODEC, CodecConfig

    cfg = StageConfig(precision="fp16")
    fw, bw = CodecConfig.parse(DEFAULT_FORWARD_CODEC), CodecConfig.parse(DEFAULT_BACKWARD_CODEC)
    pipe = LocalPipeline(CFG, 2, fw, bw, stage_cfg=cfg)
    try:
        pipe.train_step(batch(seed=0), n_micro=2)
        poison = Poison(next(pipe.hosts[1].worker.module.parameters()))
        poison.armed = True
        before = snapshot(pipe)
        assert pipe.train_step(batch(seed=0), n_micro=2).skipped  # the same samples: AQ-SGD deltas
        assert same(before, snapshot(pipe))
        poison.armed = False
        results = [pipe.train_step(batch(seed=0), n_micro=2) for _ in range(2)]
        assert not any(r.skipped for r in results) and all(math.isfinite(r.loss) for r in results)
        assert {h.worker.loss_scale for h in pipe.hosts} == {2.0**15}
    finally:
        pipe.close()


@pytest.mark.parametrize("named", [math.nan, math.inf, -1.0, 2.0**17])
def test_a_call_naming_a_malformed_scale_is_refused(named):
    pipe = pipeline("fp16", n_stages=2)
    try:
        pipe.driver(2).loss_scale = named
        with pytest.raises(StageCallError, match="loss_scale") as e:
            pipe.train_step(batch(seed=0), n_micro=2)
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert all(h.worker.step_count == 0 and h.open_step is None for h in hosts(pipe))
    finally:
        pipe.close()
