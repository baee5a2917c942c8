"""Epilogue-only compression: which backward messages the schedule exposes (derived on a clock, checked here for
GPipe and 1F1B), the plan a stage reads its own choice from, and the runtime sending each message at its codec."""

import math

import pytest
import torch

from swarm.compression import CodecConfig, WireLimits
from swarm.experiments.selective import apply_epilogue_only
from swarm.model.data import Batch
from swarm.model.gpt import ModelConfig
from swarm.runtime.boundary import EpilogueOnly, LinkEnds
from swarm.runtime.epilogue import (
    EpiloguePlan,
    StageTimes,
    backward_order,
    derive_tails,
    exposed_messages,
    step_time_s,
)
from swarm.runtime.inprocess import LocalPipeline
from swarm.runtime.schedules import SCHEDULES, linearize

torch.set_num_threads(1)

SHAPES = [(2, 4), (3, 6), (4, 8), (4, 2), (2, 1)]


def _every(n_stages: int, n_micro: int) -> set[tuple[int, int]]:
    return {(b, m) for b in range(n_stages - 1) for m in range(n_micro)}


def _slow_last(n_stages: int, slow: float, precise_s: float, compressed_s: float = 0.05) -> StageTimes:
    forward, backward = [1.0] * n_stages, [2.0] * n_stages
    forward[-1], backward[-1] = slow, 2 * slow
    b = n_stages - 1
    return StageTimes(tuple(forward), tuple(backward), (0.1,) * b, (precise_s,) * b, (compressed_s,) * b)


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("n_stages,n_micro", SHAPES)
def test_free_transfers_and_unit_actions_take_as_many_ticks_as_linearize(schedule, n_stages, n_micro):
    times = StageTimes.uniform(n_stages, 1.0, 1.0, 0.0, 0.0, 0.0)
    ticks = linearize(SCHEDULES[schedule](n_stages, n_micro))
    assert step_time_s(schedule, n_micro, times, set()) == len(ticks)


@pytest.mark.parametrize("n_stages,n_micro", SHAPES)
@pytest.mark.parametrize("precise_s", [0.1, 0.5, 3.0])
def test_gpipe_exposes_every_backward_message(n_stages, n_micro, precise_s):
    times = StageTimes.uniform(n_stages, 1.0, 2.0, 0.1, precise_s, 0.05)
    assert derive_tails("gpipe", n_micro, times) == (n_micro,) * (n_stages - 1)


@pytest.mark.parametrize("n_stages,n_micro", [(2, 4), (3, 6), (4, 8)])
@pytest.mark.parametrize("precise_s", [0.1, 0.5])
def test_1f1b_with_equal_stages_has_no_slack_for_any_transfer(n_stages, n_micro, precise_s):
    times = StageTimes.uniform(n_stages, 1.0, 2.0, 0.1, precise_s, 0.05)
    assert derive_tails("1f1b", n_micro, times) == (n_micro,) * (n_stages - 1)


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("n_stages,n_micro", [(2, 4), (3, 6), (4, 8), (2, 16)])
@pytest.mark.parametrize("precise_s", [0.1, 0.3])
def test_with_the_last_stage_slowest_only_the_drain_is_exposed(schedule, n_stages, n_micro, precise_s):
    times = _slow_last(n_stages, 1.5, precise_s)
    tails = derive_tails(schedule, n_micro, times)
    assert tails == (1,) * (n_stages - 1)
    # the drain: the last micro-batch's gradient on every boundary
    assert exposed_messages(schedule, n_stages, n_micro, tails) == [(b, n_micro - 1) for b in range(n_stages - 1)]
    everything = step_time_s(schedule, n_micro, times, _every(n_stages, n_micro))
    chosen = set(exposed_messages(schedule, n_stages, n_micro, tails))
    assert step_time_s(schedule, n_micro, times, chosen) == everything
    # and the drain's messages are really exposed: leaving them precise too lengthens the step
    assert step_time_s(schedule, n_micro, times, set()) > everything


def test_a_precise_transfer_past_the_slack_is_exposed_everywhere():
    times = _slow_last(2, 1.2, precise_s=1.5)
    assert derive_tails("1f1b", 4, times) == (4,)


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("slow", [1.0, 1.3, 2.0])
@pytest.mark.parametrize("precise_s", [0.2, 0.9])
def test_derived_tails_are_as_fast_as_compressing_everything_and_minimal(schedule, slow, precise_s):
    n_stages, n_micro = 3, 6
    times = _slow_last(n_stages, slow, precise_s)
    tails = derive_tails(schedule, n_micro, times)
    everything = step_time_s(schedule, n_micro, times, _every(n_stages, n_micro))
    chosen = set(exposed_messages(schedule, n_stages, n_micro, tails))
    assert step_time_s(schedule, n_micro, times, chosen) <= everything * (1 + 1e-9)
    for b, tail in enumerate(tails):  # one message fewer on any boundary would show
        if tail:
            fewer = list(tails)
            fewer[b] -= 1
            lighter = set(exposed_messages(schedule, n_stages, n_micro, fewer))
            assert step_time_s(schedule, n_micro, times, lighter) > everything * (1 + 1e-9)


def test_a_tolerance_leaves_more_messages_precise():
    times = StageTimes.uniform(2, 1.0, 2.0, 0.1, 0.1, 0.05)
    assert derive_tails("1f1b", 8, times) == (8,)
    assert derive_tails("1f1b", 8, times, tolerance=0.05)[0] < 8


def _times(**changes) -> dict:
    """Two sound stages' figures, with `changes`."""
    sound = dict(forward_s=(1.0, 1.0), backward_s=(1.0, 1.0), forward_send_s=(0.0,), precise_send_s=(0.0,))
    return {**sound, "compressed_send_s": (0.0,), **changes}


@pytest.mark.parametrize(
    "bad",
    [
        dict(forward_s=(), backward_s=(), forward_send_s=(), precise_send_s=(), compressed_send_s=()),
        _times(backward_s=(1.0,)),  # fewer stages than forward_s
        _times(forward_send_s=()),  # no send for the one boundary
        _times(forward_s=(1.0, -1.0)),
        _times(precise_send_s=(math.nan,)),
        _times(precise_send_s=(math.inf,)),
    ],
)
def test_stage_times_refuse_bad_figures(bad):
    StageTimes(**_times())  # the figures each case spoils are sound
    with pytest.raises(ValueError):
        StageTimes(**bad)


def test_plan_applies_its_tails_to_its_shape_only():
    plan = EpiloguePlan((1, 2), "1f1b", 4)
    assert [plan.compress_backward("1f1b", 3, 4, 1, m) for m in range(4)] == [False, False, False, True]
    order = backward_order("1f1b", 3, 4, 1)
    assert [plan.compress_backward("1f1b", 3, 4, 2, m) for m in order] == [False, False, True, True]
    # another shape: every message compressed (what a run without the plan does)
    assert all(plan.compress_backward("1f1b", 3, 6, 1, m) for m in range(6))
    assert all(plan.compress_backward("gpipe", 3, 4, 1, m) for m in range(4))
    assert all(plan.compress_backward("1f1b", 4, 4, 1, m) for m in range(4))
    assert all(EpiloguePlan().compress_backward("1f1b", 3, 4, 2, m) for m in range(4))


def test_a_plan_for_any_shape_caps_its_tails():
    plan = EpiloguePlan((3,))
    assert [plan.compress_backward("gpipe", 2, 2, 1, m) for m in range(2)] == [True, True]
    assert [plan.compress_backward("1f1b", 2, 5, 1, m) for m in range(5)] == [False, False, True, True, True]
    assert plan.describe() == "tails 3 (any, any mb)"


@pytest.mark.parametrize("args", [("1f1b", 3, 4, 0, 0), ("1f1b", 3, 4, 3, 0), ("1f1b", 3, 4, 1, 4),
                                  ("1f1b", 3, 4, 1, -1), ("nope", 3, 4, 1, 0)])  # fmt: skip
def test_plan_refuses_a_message_no_step_sends(args):
    with pytest.raises(ValueError):
        EpiloguePlan((1, 1)).compress_backward(*args)


@pytest.mark.parametrize("bad", [dict(tails=()), dict(tails=(-1,)), dict(schedule="nope"), dict(n_micro=-1)])
def test_plan_refuses_bad_fields(bad):
    with pytest.raises(ValueError):
        EpiloguePlan(**bad)


# ---- the runtime: each message at its codec ----------------------------------------------------------------

CFG = ModelConfig(vocab_size=64, seq_len_tokens=16, hidden_dim=32, n_layers=3, n_heads=4, init_seed=1)
FP32 = CodecConfig(name="fp32")
GRADQ = CodecConfig.parse("gradq2+ef+rot+nr+cs+g1024")


def _batch() -> Batch:
    windows = torch.randint(0, CFG.vocab_size, (8, CFG.seq_len_tokens + 1), generator=torch.Generator().manual_seed(0))
    return Batch(torch.arange(8), windows[:, :-1], windows[:, 1:])


def _sent(monkeypatch, schedule: str, epilogue: EpilogueOnly | None, n_micro: int = 4):
    """(sender stage, micro-batch, codec name) of every backward message of one step, and the pipeline."""
    sent = []
    outgoing = LinkEnds.outgoing

    def spy(self, end, tensor, sample_ids, info, address, step=None):
        if sample_ids is None:  # a gradient
            sent.append((info.stage + 1, info.micro_batch, end.config.name))
        return outgoing(self, end, tensor, sample_ids, info, address, step)

    monkeypatch.setattr(LinkEnds, "outgoing", spy)
    pipe = LocalPipeline(CFG, 3, FP32, GRADQ, schedule)
    apply_epilogue_only(pipe, epilogue)
    pipe.forward_backward(_batch(), n_micro)
    return sorted(sent), pipe


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_each_backward_message_goes_at_the_codec_the_plan_gives(monkeypatch, schedule):
    tails = (1, 2)
    sent, _ = _sent(monkeypatch, schedule, EpilogueOnly(FP32, EpiloguePlan(tails, schedule, 4)))
    exposed = set(exposed_messages(schedule, 3, 4, tails))
    assert sent == sorted((b + 1, m, "gradq" if (b, m) in exposed else "fp32") for b in range(2) for m in range(4))
    without, _ = _sent(monkeypatch, schedule, None)
    assert {name for *_, name in without} == {"gradq"}


def test_all_precise_equals_the_fp32_pipeline_and_lazy_error_stays_on_the_compressed_end(monkeypatch):
    _, precise = _sent(monkeypatch, "1f1b", EpilogueOnly(FP32, EpiloguePlan((0, 0))))
    reference = LocalPipeline(CFG, 3, FP32, FP32, "1f1b")
    reference.forward_backward(_batch(), 4)
    for a, b in zip(precise.workers, reference.workers, strict=True):
        for (name, p), q in zip(a.module.named_parameters(), b.module.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, msg=name)
    _, mixed = _sent(monkeypatch, "1f1b", EpilogueOnly(FP32, EpiloguePlan((2, 2))))
    host = mixed.hosts[2]
    (compressed,), (exact,) = host.links.send_ends("bw"), host.links.send_ends("bwp")
    assert compressed.state.residual is not None  # carried to the next compressed message of the step
    assert exact.state.residual is None


def test_a_gradient_at_neither_codec_is_refused_by_the_compressed_end():
    links = LinkEnds(FP32, GRADQ, epilogue=EpilogueOnly(CodecConfig(name="fp16")))
    fp16 = links.send_end("bwp", "x").codec.encode(torch.ones(4, 8))
    assert links.backward_recv_for(fp16) is links.precise_recv
    fp32 = links.send_end("fw", "x").codec.encode(torch.ones(4, 8))
    assert links.backward_recv_for(fp32) is links.backward_recv
    with pytest.raises(Exception, match="codec"):
        links.incoming(links.backward_recv_for(fp32), fp32, WireLimits())
