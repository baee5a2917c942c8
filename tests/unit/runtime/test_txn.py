"""A retried step is exact: the codec state a failed attempt wrote (AQ-SGD buffers on both ends of a link,
rounding draws, error feedback) is undone when the step is abandoned, so the retry computes what a clean run
computes, bit for bit."""

from __future__ import annotations

import grpc
import pytest
import torch

from swarm.compression import CodecConfig
from swarm.compression.codec_aqsgd import buffer_digest
from swarm.runtime.freeze import FreezePolicy
from swarm.runtime.gate import GateError
from swarm.runtime.inprocess import LocalPipeline
from swarm.runtime.messages import StepOrder
from tests.unit.runtime.test_replicas import CFG, batch, weights
from tests.unit.test_freeze import LLAMA, NO_CLIP
from tests.unit.test_freeze import _batch as _fbatch

torch.set_num_threads(1)

SETTINGS = {
    "default": ("acsgd2+ch", "gradq2+ef+rot+nr+cs"),  # the convergence experiment's default setting
    "aqsgd2": ("aqsgd2", "gradq4+ef"),  # stochastic rounding on both: the draws must roll back too
}
STEPS = ((0, 0), (1, 16), (2, 0))
"""(batch seed, first sample id) per step: step 1 brings new samples (first sights), step 2 old ones (deltas)"""


class _FailOnce:
    """Wraps a servicer: its `nth` call of `method` (1-based, over the run) fails once with UNAVAILABLE, after
    the calls before it went through (both ends of their links wrote their buffers); `ran`: the call itself runs
    first and only its reply is lost."""

    def __init__(self, target, method: str, nth: int, ran: bool = False):
        self.target, self.method, self.nth, self.calls, self.ran = target, method, nth, 0, ran

    def __getattr__(self, name):
        if name != self.method:
            return getattr(self.target, name)
        self.calls += 1
        if self.calls != self.nth:
            return getattr(self.target, name)

        def fail(request, context):
            if self.ran:
                getattr(self.target, name)(request, context)
            context.abort(grpc.StatusCode.UNAVAILABLE, "connection reset (injected, once)")

        return fail


def _pipe(setting: str) -> LocalPipeline:
    fw, bw = SETTINGS[setting]
    return LocalPipeline(CFG, 3, CodecConfig.parse(fw), CodecConfig.parse(bw), schedule="1f1b")


def _run(setting: str, fail: tuple[int, str, int] | None):
    """Losses and attempts per step, and the final weights; `fail` = (stage, method, nth call) fails once."""
    pipe = _pipe(setting)
    try:
        if fail is not None:
            stage, method, nth = fail
            pipe.switches[stage][0].target = _FailOnce(pipe.switches[stage][0].target, method, nth)
        results = [pipe.train_step(batch(seed=s, first_id=i), 4) for s, i in STEPS]
        _check_ends_agree(pipe)
        assert all(h.links.journalled() == 0 for h in pipe.hosts), "a committed step leaves no journal"
        return [r.loss for r in results], [r.attempts for r in results], weights(pipe)
    finally:
        pipe.close()


def _store_digest(store) -> dict[int, int]:
    return {i: buffer_digest(store.get(i).clone()) for i in store.ids()}


def _check_ends_agree(pipe: LocalPipeline) -> None:
    """Both ends of every forward link hold the same samples with the same bits."""
    for k in range(len(pipe.hosts) - 1):
        send = pipe.hosts[k].links.send_ends("fw")
        recv = pipe.hosts[k + 1].links.forward_recv.buffers
        if recv is None:
            continue
        assert len(send) == 1
        assert _store_digest(send[0].buffers) == _store_digest(recv), f"link {k}: the two ends differ"


# step 1's third micro-batch: stage 2's fourth Forward over the run counts step 0's four, so call 7
@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("fail", [(2, "Forward", 7), (1, "Backward", 6)], ids=["fw", "bw"])
def test_a_step_that_fails_midway_and_runs_again_is_bit_identical_to_a_clean_run(setting, fail):
    clean_losses, clean_attempts, clean_weights = _run(setting, None)
    losses, attempts, final = _run(setting, fail)
    assert clean_attempts == [1, 1, 1] and attempts == [1, 2, 1], "the injected failure made step 1 run again"
    assert losses == clean_losses  # float equality, every step
    for name, w in clean_weights.items():
        assert torch.equal(final[name], w), name


def _tied_run(fail: bool):
    """Two stages whose tied embedding is summed as rank-4 factors (a warm-started power iteration)."""
    pipe = LocalPipeline(CFG, 2, CodecConfig.parse("aqsgd2"), CodecConfig.parse("gradq4+ef"))
    try:
        for host in pipe.hosts:
            host.averager.set_codecs(None, CodecConfig.parse("lowrank4+ef"))
        if fail:  # step 1's Reduce reply is lost, after it encoded the tied sum from the warm start
            pipe.switches[1][0].target = _FailOnce(pipe.switches[1][0].target, "Reduce", 2, ran=True)
        results = [pipe.train_step(batch(seed=s, first_id=i), 4) for s, i in STEPS]
        return [r.loss for r in results], [r.attempts for r in results], weights(pipe)
    finally:
        pipe.close()


def test_a_retried_step_starts_the_lowrank_tied_sum_from_the_committed_warm_start():
    clean_losses, _, clean_weights = _tied_run(False)
    losses, attempts, final = _tied_run(True)
    assert attempts == [1, 2, 1] and losses == clean_losses
    assert all(torch.equal(final[n], w) for n, w in clean_weights.items())


def test_a_restarted_trainer_abandons_the_open_step_and_its_codec_state():
    """A trainer that dies mid-step and comes back sends the next step's calls without an abandon: the stages
    close the old step (`StageHost.admit`) and undo its codec state, so training goes on as if it never ran."""
    pipe, ref = _pipe("aqsgd2"), _pipe("aqsgd2")
    try:
        for p in (pipe, ref):
            p.train_step(batch(), 4)
        pipe.forward_backward(batch(seed=1, first_id=16), 4)  # the trainer dies here: no Step, no abandon
        pipe._step += 1
        ref._step += 1
        losses = [p.train_step(batch(seed=2, first_id=16), 4).loss for p in (pipe, ref)]
        assert losses[0] == losses[1]
        assert all(torch.equal(a, b) for a, b in zip(weights(pipe).values(), weights(ref).values(), strict=True))
        _check_ends_agree(pipe)
    finally:
        pipe.close()
        ref.close()


def _frozen_run(fail: bool):
    """Stage 0 (embedding + layers 0-1 of 3) frozen from step 2: its forwards come from the AQ-SGD cache once
    each sample went in full after the freeze (`freeze.cached_forward`, which keeps a sent set per link)."""
    pipe = LocalPipeline(LLAMA, 2, CodecConfig.parse("aqsgd2"), CodecConfig.parse("gradq4+ef"), stage_cfg=NO_CLIP)
    pipe.freeze = FreezePolicy(n_layers=LLAMA.n_layers, tolerance=1e-12, max_fraction=1.0)
    try:
        if fail:  # step 2's second micro-batch: its first went in full after the freeze and was marked sent
            pipe.switches[1][0].target = _FailOnce(pipe.switches[1][0].target, "Forward", 6)
        results = []
        for step in range(6):
            if step == 1:
                pipe.freeze.frozen = 2
            results.append(pipe.train_step(_fbatch(LLAMA.vocab_size, LLAMA.seq_len_tokens, step % 2), 2))
        assert pipe.workers[0].forward_only
        return [r.loss for r in results], [r.attempts for r in results], weights(pipe)
    finally:
        pipe.close()


def test_a_retried_step_on_a_frozen_stage_sends_its_first_frozen_outputs_again():
    clean_losses, _, clean_weights = _frozen_run(False)
    losses, attempts, final = _frozen_run(True)
    assert attempts == [1, 1, 2, 1, 1, 1] and losses == clean_losses
    assert all(torch.equal(final[n], w) for n, w in clean_weights.items())


def test_abandon_restores_both_ends_exactly_and_a_commit_drops_the_journal():
    pipe = _pipe("aqsgd2")
    try:
        pipe.train_step(batch(), 4)
        ends = [pipe.hosts[0].links.send_ends("fw")[0], pipe.hosts[1].links.forward_recv]
        before = [(_store_digest(e.buffers), e.state._draws) for e in ends]
        pipe.forward_backward(batch(seed=1, first_id=8), 4)  # half old samples (deltas), half new
        assert pipe.hosts[0].links.journalled() > 0 and pipe.hosts[1].links.journalled() > 0
        assert [_store_digest(e.buffers) for e in ends] != [b for b, _ in before], "the step moved the buffers"
        pipe.abandon_step()
        assert [(_store_digest(e.buffers), e.state._draws) for e in ends] == before
        assert all(h.links.journalled() == 0 and h.links.step is None for h in pipe.hosts)
        _check_ends_agree(pipe)
        pipe.train_step(batch(seed=2, first_id=8), 4)
        assert all(h.links.journalled() == 0 for h in pipe.hosts)
        _check_ends_agree(pipe)
    finally:
        pipe.close()


def test_a_late_call_of_an_abandoned_step_changes_no_codec_state():
    pipe = _pipe("aqsgd2")
    try:
        pipe.train_step(batch(), 4)
        links = pipe.hosts[1].links
        digest = _store_digest(links.forward_recv.buffers)
        assert links.step is None
        with pytest.raises(GateError, match="not open"):
            links.incoming(links.forward_recv, None, None, step=0)  # refused before the message is read
        with pytest.raises(GateError, match="not open"):
            links.outgoing(links.send_end("fw", "local:2"), torch.zeros(1, 1), [0], None, "local:2", step=5)
        assert _store_digest(links.forward_recv.buffers) == digest and links.journalled() == 0
    finally:
        pipe.close()


def test_a_step_committed_upstream_but_abandoned_downstream_recovers_through_the_digest():
    """The driver's Step goes to each stage separately: stage 0 may apply a step whose Step failed on stage 1,
    which then abandons it. Stage 0's sending buffers keep the step's rows, stage 1's went back: the next
    message for those samples is a miss (first sights) or a drift (deltas), and the sender re-sends them in full,
    after which both ends agree again."""
    pipe = LocalPipeline(CFG, 2, CodecConfig.parse("aqsgd2"), CodecConfig.parse("gradq4+ef"))
    try:
        pipe.train_step(batch(), 4)
        pipe.forward_backward(batch(seed=1, first_id=8), 4)  # ids 8..15 deltas, 16..23 first sights
        step = pipe._step
        pipe.hosts[0].links.end_step(commit=True)  # what stage 0's Step did
        pipe.hosts[1].links.end_step(commit=False)  # what stage 1's abandon did
        for host in pipe.hosts:
            host.worker.zero_grad()
            host._close_step()
        send, recv = pipe.hosts[0].links.send_ends("fw")[0].buffers, pipe.hosts[1].links.forward_recv.buffers
        assert len(send) == 24 and len(recv) == 16
        pipe._step = step + 1
        result = pipe.train_step(batch(seed=2, first_id=8), 4)
        assert result.attempts == 1
        _check_ends_agree(pipe)
    finally:
        pipe.close()


def test_late_calls_of_an_abandoned_attempt_are_refused_so_the_retry_waits_for_none(monkeypatch):
    """A failed attempt's calls still in flight reached stages after its abandon and opened the step there again,
    waiting for micro-batches that never came: the driver then waited its whole ABANDON_GRACE_S (5 s) before
    the retry. Calls carry their attempt's id, and a stage told to abandon that attempt refuses them."""
    import swarm.runtime.driver as driver_module

    waits, real_wait = [], driver_module.wait

    def recording(futures, timeout=None, **kw):
        done, not_done = real_wait(futures, timeout=timeout, **kw)
        waits.append((timeout, len(not_done)))
        return done, not_done

    monkeypatch.setattr(driver_module, "ABANDON_GRACE_S", 30.0)
    monkeypatch.setattr(driver_module, "wait", recording)
    _, attempts, _ = _run("default", (1, "Backward", 6))
    assert attempts == [1, 2, 1]
    assert [left for timeout, left in waits if timeout == 30.0] == [0], "every call of the failed attempt ended"


def test_a_stage_refuses_only_the_abandoned_attempt_of_a_step_and_changes_nothing():
    from swarm.net.stream import CallRefused
    from swarm.proto import stage_pb2

    pipe = _pipe("default")
    try:
        host = pipe.hosts[1]
        host.step(StepOrder(step=3, abandon=True, attempt_id=77))

        def call(step: int, attempt_id: int) -> stage_pb2.CallInfo:
            info = stage_pb2.CallInfo(step=step, stage=1, plan_version=host.role.plan_version, attempt_id=attempt_id)
            info.route.extend(pipe.addresses)
            info.route_peers.extend(p[0] for p in pipe.replica_peers)
            return info

        info = call(3, 77)
        with pytest.raises(CallRefused, match="abandoned"):
            host.check_call(info)
        assert host.open_step is None
        for other in (call(3, 78), call(4, 77)):
            host.check_call(other)  # the retry's own attempt, another step: served
        info.attempt_id = 0
        host.check_call(info)  # a caller that names no attempt is never refused on this ground
    finally:
        pipe.close()
