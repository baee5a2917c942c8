"""Lying peers in one process: a stage whose Grads reply or activations lie is named, struck, evicted, and the
run goes on on the surviving replica, to a loss close to a clean run's."""

from __future__ import annotations

import math

import pytest
import torch

from swarm.runtime.inprocess import LocalPipeline
from swarm.runtime.routing import NoLiveRoute
from swarm.runtime.suspects import Implausible, SuspectConfig, Suspects
from tests.unit.runtime.test_replicas import CFG, FP32, batch

torch.set_num_threads(1)


class _LyingNorm:
    """Wraps a servicer: its Grads replies report `sq` as the squared gradient norm (from step `after` on)."""

    def __init__(self, target, sq: float, after: int = 0):
        self.target, self.sq, self.after = target, sq, after

    def __getattr__(self, name):
        return getattr(self.target, name)

    def Grads(self, request, context):
        reply = self.target.Grads(request, context)
        if request.step >= self.after:
            reply.grad_sq_norm = self.sq
        return reply


def _train(pipe: LocalPipeline, steps: int) -> list:
    return [pipe.train_step(batch(seed=step % 4), n_micro=2) for step in range(steps)]


def _clean_losses(steps: int, replicas: int = 2) -> list[float]:
    pipe = LocalPipeline(CFG, 2, FP32, FP32, replicas=replicas)
    try:
        return [r.loss for r in _train(pipe, steps)]
    finally:
        pipe.close()


@pytest.mark.parametrize("lie", [-1e30, math.nan, 1e30, -math.inf])
def test_a_lying_norm_is_named_struck_and_evicted_and_the_run_goes_on(lie, caplog):
    pipe = LocalPipeline(CFG, 2, FP32, FP32, replicas=2)
    liar = pipe.replica_peers[1][1]
    pipe.switches[1][1].target = _LyingNorm(pipe.switches[1][1].target, lie)
    try:
        results = _train(pipe, 8)
        driver = pipe.driver(2)
        # the first steps are skipped (nothing applied anywhere), a strike each; the third strike evicts
        assert [r.skipped for r in results[:2]] == [True, True]
        assert all(not r.skipped for r in results[2:])
        assert driver.suspects.banned_ids() == (liar,) and liar in driver.dead
        assert results[2].attempts == 2 and results[3].routes == 1
        named = [r.getMessage() for r in caplog.records if "strike" in r.getMessage()]
        assert named and all(f"stage 1 replica 1 (peer {liar} at local:1.1)" in m for m in named)
        # the honest replicas took every applied step, and none of the skipped ones
        assert [h.steps_done for h in (pipe.replica_hosts[0][0], pipe.replica_hosts[1][0])] == [6, 6]
        clean = _clean_losses(6)
        assert results[-1].loss == pytest.approx(clean[-1], rel=0.05)
    finally:
        pipe.close()


def test_a_lone_stage_lying_is_evicted_and_the_trainer_must_wait_for_a_plan_without_it():
    pipe = LocalPipeline(CFG, 2, FP32, FP32)
    pipe.switches[1][0].target = _LyingNorm(pipe.switches[1][0].target, -1e30)
    try:
        for _ in range(2):
            assert pipe.train_step(batch(), n_micro=2).skipped
        with pytest.raises(NoLiveRoute, match="no live replica of stage 1"):
            pipe.train_step(batch(), n_micro=2)
        assert pipe.driver(2).suspects.banned_ids() == (pipe.replica_peers[1][0],)
        assert all(h.steps_done == 0 for h in pipe.hosts)  # nothing of the liar's steps was applied
    finally:
        pipe.close()


def test_a_norm_far_above_the_stages_history_skips_the_step_instead_of_clipping_the_others():
    """1e30 would shrink every honest stage's update to nothing through clipping: the step is skipped."""
    pipe = LocalPipeline(CFG, 2, FP32, FP32)
    cfg = SuspectConfig(max_sq_norm=1e40)  # the absolute bound off: the history rule alone must catch it
    before = None
    try:
        driver = pipe.driver(2, suspects=Suspects(cfg))
        for step in range(5):
            assert not pipe.train_step(batch(seed=step), n_micro=2).skipped
        before = [p.detach().clone() for p in pipe.hosts[0].worker.module.parameters()]
        pipe.switches[1][0].target = _LyingNorm(pipe.switches[1][0].target, 1e30)
        r = pipe.train_step(batch(seed=9), n_micro=2)
        assert r.skipped and r.lr == 0.0 and driver.suspects.strikes(pipe.replica_peers[1][0]) == 1
        after = list(pipe.hosts[0].worker.module.parameters())
        assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))  # stage 0 applied nothing
    finally:
        pipe.close()


def test_replicas_that_disagree_blame_the_one_off_the_stages_history():
    pipe = LocalPipeline(CFG, 2, FP32, FP32, replicas=2)
    try:
        driver = pipe.driver(2)
        for step in range(5):
            pipe.train_step(batch(seed=step), n_micro=2)
        pipe.switches[1][1].target = _LyingNorm(pipe.switches[1][1].target, 1e-9)  # plausible alone, too small
        r = pipe.train_step(batch(seed=5), n_micro=2)
        assert r.skipped
        assert driver.suspects.strikes(pipe.replica_peers[1][1]) == 1
        assert driver.suspects.strikes(pipe.replica_peers[1][0]) == 0
    finally:
        pipe.close()


def test_strikes_count_once_per_step_and_expire_outside_the_window():
    banned = []
    s = Suspects(SuspectConfig(strikes=3, window_steps=10), on_ban=lambda p, why: banned.append(p))
    assert not s.strike("p", 0, "x") and not s.strike("p", 0, "x again")
    assert s.strikes("p") == 1
    assert not s.strike("p", 5, "x") and not s.strike("p", 12, "x")  # step 0's strike left the window
    assert s.strikes("p") == 2 and not banned
    assert s.strike("p", 13, "x") and banned == ["p"] and s.banned_ids() == ("p",)
    assert s.strike("p", 14, "x") and banned == ["p"]  # told once


def test_implausible_names_nobody_when_two_replicas_disagree_with_no_history():
    from swarm.runtime.messages import GradReport

    s = Suspects()
    replies = {(0, 0): GradReport(1.0, 1.0), (0, 1): GradReport(2.0, 1.0)}
    with pytest.raises(Implausible, match="report different grad_sq_norm") as e:
        s.judge_grads(0, replies, {(0, 0): "a", (0, 1): "b"}, lambda st, r: f"stage {st} replica {r}")
    assert e.value.peer is None and s.strikes("a") == s.strikes("b") == 0
