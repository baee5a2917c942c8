"""Mixed precision's parts on their own: the autocast context, the dynamic loss scaler (backoff, growth, bounds,
its state checked whole), the Step checks, the worker's scaled backward, and the codecs fed fp32 or bf16/fp16."""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from swarm.compression import CodecConfig, decoder_for, make_codec
from swarm.model.gpt import build_stage
from swarm.runtime.precision import (
    PRECISIONS,
    LossScaler,
    ScalerConfig,
    add_precision_argument,
    autocast,
    scale_mismatch,
    step_mismatch,
)
from swarm.runtime.worker import StageConfig, StageWorker
from tests.unit.runtime.test_replicas import CFG

torch.set_num_threads(1)


@pytest.mark.parametrize(
    ("precision", "dtype"), [("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)]
)
def test_autocast_runs_matmuls_in_the_precision_on_cpu(precision, dtype):
    with autocast(precision, "cpu"):
        out = torch.nn.Linear(4, 4)(torch.randn(2, 4))
    assert out.dtype == dtype  # CPU autocast takes fp16 too (torch 2.13)


def test_autocast_bf16_keeps_meaning_bf16_and_cannot_mean_fp16():
    assert StageConfig(autocast_bf16=True).compute_precision == "bf16"
    assert StageConfig(precision="fp16").compute_precision == "fp16"
    with pytest.raises(ValueError, match="autocast_bf16"):
        StageConfig(autocast_bf16=True, precision="fp16")
    with pytest.raises(ValueError, match="precision"):
        StageConfig(precision="fp8")


def test_precision_argument():
    parser = argparse.ArgumentParser()
    add_precision_argument(parser)
    assert parser.parse_args([]).precision == "fp32"
    assert parser.parse_args(["--precision", "fp16"]).precision == "fp16"
    assert set(PRECISIONS) == {"fp32", "bf16", "fp16"}
    with pytest.raises(SystemExit):
        parser.parse_args(["--precision", "int8"])


def test_scaler_backs_off_grows_and_stays_in_bounds():
    s = LossScaler(ScalerConfig(init_scale=8.0, growth_interval=3, min_scale=2.0, max_scale=16.0))
    s.update(skipped=True)
    assert (s.scale, s.good_steps) == (4.0, 0)
    s.update(skipped=False)
    s.update(skipped=False)
    assert s.scale == 4.0 and s.good_steps == 2
    s.update(skipped=False)  # the third good step in a row
    assert (s.scale, s.good_steps) == (8.0, 0)
    for _ in range(6):
        s.update(skipped=False)
    assert s.scale == 16.0  # max
    s.update(skipped=False)
    s.update(skipped=True)  # a skip restarts the count
    assert (s.scale, s.good_steps) == (8.0, 0)
    for _ in range(5):
        s.update(skipped=True)
    assert s.scale == 2.0  # min


def test_scaler_state_round_trips_and_is_checked_whole():
    a = LossScaler(ScalerConfig(growth_interval=10))
    a.update(True)
    a.update(False)
    b = LossScaler(ScalerConfig(growth_interval=10))
    b.load_tensors(a.state_tensors())
    assert (b.scale, b.good_steps) == (a.scale, a.good_steps) == (2.0**15, 1)
    bad = [
        {"amp.scale": torch.tensor([float("nan")]), "amp.good_steps": torch.tensor([0.0])},
        {"amp.scale": torch.tensor([3.0]), "amp.good_steps": torch.tensor([0.0])},  # not a power of two
        {"amp.scale": torch.tensor([2.0**40]), "amp.good_steps": torch.tensor([0.0])},  # above max
        {"amp.scale": torch.tensor([4.0]), "amp.good_steps": torch.tensor([10.0])},  # not below the interval
        {"amp.scale": torch.tensor([4.0]), "amp.good_steps": torch.tensor([1.5])},
        {"amp.scale": torch.tensor([4.0, 4.0]), "amp.good_steps": torch.tensor([0.0])},  # wrong shape
        {"amp.scale": torch.tensor([4.0])},  # missing
    ]
    for state in bad:
        with pytest.raises(ValueError):
            b.load_tensors(state)
        assert (b.scale, b.good_steps) == (2.0**15, 1)  # unchanged


def test_scaler_config_wants_powers_of_two():
    with pytest.raises(ValueError):
        ScalerConfig(init_scale=1000.0)
    with pytest.raises(ValueError):
        ScalerConfig(backoff_factor=2.0, growth_factor=0.5)


def test_step_checks():
    assert step_mismatch(1.0, skip=False, found_inf=False) is None
    assert step_mismatch(math.inf, skip=True, found_inf=True) is None
    assert step_mismatch(math.nan, skip=True, found_inf=False) is None
    assert "disagrees" in step_mismatch(math.nan, skip=False, found_inf=False)  # NaN norm, no skip
    assert "disagrees" in step_mismatch(1.0, skip=True, found_inf=False)  # skip with a finite norm
    assert "cannot be finite" in step_mismatch(1.0, skip=False, found_inf=True)  # the norm lies about this stage
    assert "negative" in step_mismatch(-1.0, skip=False, found_inf=False)
    assert scale_mismatch(0.0, 1024.0, True) is None  # not known yet: Grads checks agreement
    assert scale_mismatch(1024.0, 1024.0, True) is None
    assert "1024" in scale_mismatch(2048.0, 1024.0, True)
    assert "no loss scaling" in scale_mismatch(2048.0, 1.0, False)


def _worker(precision: str, is_last=True, **scaler) -> StageWorker:
    module = build_stage(CFG, 0, CFG.n_layers, True, is_last)
    return StageWorker(module, StageConfig(precision=precision, scaler=ScalerConfig(**scaler)))


def _tokens(seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randint(0, CFG.vocab_size, (4, CFG.seq_len_tokens + 1), generator=gen)
    return w[:, :-1], w[:, 1:]


def test_scaled_backward_gives_the_unscaled_gradients():
    """fp16's gradients, accumulated over micro-batches, are the true (unscaled) gradients: equal for two scales
    (scaling by a power of two is exact where nothing under- or overflows) and close to fp32's; the scale never
    leaks into what is clipped, summed or sent."""
    grads = {}
    for precision, scale in (("fp32", 1.0), ("fp16", 2.0**12), ("fp16", 2.0**16)):
        torch.manual_seed(0)
        w = _worker(precision, init_scale=scale, min_scale=1.0)
        for mb in range(2):
            x, y = _tokens(mb)
            w.forward(mb, x, targets=y)
            w.backward(mb, torch.tensor(0.5))
        grads[(precision, scale)] = torch.cat([p.grad.reshape(-1) for p in w.module.parameters()])
        assert not w.found_inf
    a, b, ref = grads[("fp16", 2.0**12)], grads[("fp16", 2.0**16)], grads[("fp32", 1.0)]
    torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-7)
    assert float((b - ref).norm() / ref.norm()) < 0.02


def test_master_weights_and_optimizer_state_stay_fp32():
    for precision in ("bf16", "fp16"):
        w = _worker(precision)
        x, y = _tokens()
        loss = w.forward(0, x, targets=y)
        assert loss.dtype == torch.float32
        w.backward(0, torch.tensor(1.0))
        assert w.step(None) > 0
        assert {p.dtype for p in w.module.parameters()} == {torch.float32}
        assert {p.grad is None for p in w.module.parameters()} == {True}
        moments = [v for s in w.optimizer.state.values() for k, v in s.items() if k != "step"]
        assert moments and {v.dtype for v in moments} == {torch.float32}


def test_middle_stage_sends_fp32_activations_and_input_gradients():
    module = build_stage(CFG, 1, 3, False, False)
    w = StageWorker(module, StageConfig(precision="fp16"))
    x = torch.randn(2, CFG.seq_len_tokens, CFG.hidden_dim)
    out = w.forward(0, x)
    assert out.dtype == torch.float32
    g = w.backward(0, torch.randn_like(out) * 1e-3)
    assert g.dtype == torch.float32 and bool(torch.isfinite(g).all()) and not w.found_inf


def test_overflow_in_a_stage_zeroes_what_it_sends_and_reports_inf():
    module = build_stage(CFG, 1, 3, False, False)
    w = StageWorker(module, StageConfig(precision="fp16"))
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    out = w.forward(0, torch.randn(2, CFG.seq_len_tokens, CFG.hidden_dim))
    g = w.backward(0, torch.full_like(out, 1e30))  # x scale overflows
    assert w.found_inf and torch.equal(g, torch.zeros_like(g))
    assert w.grad_sq_norm() == math.inf
    assert w.step(math.inf) == 0.0  # skipped
    assert w.step_count == 0 and w.skipped_steps == 1 and w.loss_scale == 2.0**15 and not w.found_inf
    assert all(torch.equal(p, before[n]) for n, p in module.named_parameters())


@pytest.mark.parametrize("label", ["fp32", "bf16", "gradq4+nr"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_codecs_take_half_precision_tensors_as_well(label, dtype):
    """The stages hand the codecs fp32; a caller handing them bf16/fp16 gets the same decoded values."""
    config = CodecConfig.parse(label)
    x = torch.randn(2, 8, 32).to(dtype)
    decoded = []
    for t in (x, x.float()):
        msg = make_codec(config).encode(t)
        decoded.append(decoder_for(msg, config).decode(msg).float())
    torch.testing.assert_close(decoded[0], decoded[1], rtol=1e-2, atol=1e-2)
