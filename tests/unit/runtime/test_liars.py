"""Lying peers in one process: a stage whose Grads reply or activations lie is named, struck, evicted, and the
run goes on on the surviving replica, to a loss close to a clean run's."""

from __future__ import annotations

import math

import pytest
import torch

from swarm.runtime.inprocess import LocalPipeline
from swarm.runtime.routing import NoLiveRoute
from swarm.runtime.suspects import Implausible, SuspectConfig, Suspects
from tests.unit.runtime.test_replicas import CFG, FP32, batch, weights

torch.set_num_threads(1)


class _LyingNorm:
    """Wraps a servicer: its gradient reports (a Reduce reply's, a Grads reply's) say `sq` is the squared gradient
    norm (from step `after` on)."""

    def __init__(self, target, sq: float, after: int = 0):
        self.target, self.sq, self.after = target, sq, after

    def __getattr__(self, name):
        return getattr(self.target, name)

    def Grads(self, request, context):
        reply = self.target.Grads(request, context)
        if request.step >= self.after:
            reply.grad_sq_norm = self.sq
        return reply

    def Reduce(self, request, context):
        reply = self.target.Reduce(request, context)
        if request.step >= self.after:
            reply.grads.grad_sq_norm = self.sq
        return reply


def _train(pipe: LocalPipeline, steps: int) -> list:
    return [pipe.train_step(batch(seed=step % 4), n_micro=2) for step in range(steps)]


def _clean_weights(seeds: list[int]) -> dict[str, torch.Tensor]:
    """A clean run's weights after steps on the batches of `seeds` (the ones the liar's run applied)."""
    pipe = LocalPipeline(CFG, 2, FP32, FP32, replicas=2)
    try:
        for seed in seeds:
            pipe.train_step(batch(seed=seed), n_micro=2)
        return weights(pipe)
    finally:
        pipe.close()


def _assert_as_clean(pipe: LocalPipeline, seeds: list[int]) -> None:
    """The honest replicas (0) hold a clean run's weights: one step moves them by ~5e-4, float order by ~3e-8."""
    torch.testing.assert_close(weights(pipe), _clean_weights(seeds), atol=1e-6, rtol=0)


@pytest.mark.parametrize("lie", [-1e30, math.nan, 1e30, -math.inf])
def test_a_lying_norm_is_named_struck_and_evicted_and_its_honest_sibling_stands_in(lie, caplog):
    pipe = LocalPipeline(CFG, 2, FP32, FP32, replicas=2)
    liar = pipe.replica_peers[1][1]
    pipe.switches[1][1].target = _LyingNorm(pipe.switches[1][1].target, lie)
    try:
        results = _train(pipe, 8)
        driver = pipe.driver(2)
        # no step is skipped: the honest sibling's norm stands in for the lie (a strike each); the third strike
        # evicts, and that step runs again without the liar
        assert not any(r.skipped for r in results) and driver.suspects.stood_in == 2
        assert driver.suspects.banned_ids() == (liar,) and liar in driver.dead
        assert results[2].attempts == 2 and results[3].routes == 1
        named = [r.getMessage() for r in caplog.records if "strike" in r.getMessage()]
        assert named and all(f"stage 1 replica 1 (peer {liar} at local:1.1)" in m for m in named)
        # the honest replicas took every step: as a clean run on every batch
        assert [h.steps_done for h in (pipe.replica_hosts[0][0], pipe.replica_hosts[1][0])] == [8, 8]
        _assert_as_clean(pipe, [s % 4 for s in range(8)])
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
        # plausible alone (a norm too small would break its own layer norms' sum, and its sibling would stand in)
        pipe.switches[1][1].target = _LyingNorm(pipe.switches[1][1].target, 100.0)
        r = pipe.train_step(batch(seed=5), n_micro=2)
        assert r.skipped and driver.suspects.stood_in == 0
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
    assert s.strikes("p") == 3 and not banned  # (still in the long window)
    assert s.strike("p", 13, "x") and banned == ["p"] and s.banned_ids() == ("p",)
    assert s.strike("p", 14, "x") and banned == ["p"]  # told once


def test_a_ban_on_evidence_evicts_at_once_tells_on_ban_once_and_outlives_later_strikes():
    told = []
    suspects = Suspects(on_ban=lambda peer, why: told.append((peer, why)))
    assert suspects.strike("p", 1, "odd norm") is False and suspects.strikes("p") == 1
    assert suspects.ban("p", "audit: recomputed otherwise") is True
    assert suspects.ban("p", "again") is False  # a second verdict changes nothing and is not announced twice
    assert suspects.banned_ids() == ("p",) and suspects.strikes("p") == 0
    assert told == [("p", "audit: recomputed otherwise")]
    assert suspects.strike("p", 2, "later") is True and told == [("p", "audit: recomputed otherwise")]


def test_a_peer_lying_too_rarely_for_the_window_is_evicted_by_its_strikes_over_the_run():
    s = Suspects(SuspectConfig(strikes=3, window_steps=10, max_strikes=5, long_window_steps=100))
    assert not any(s.strike("p", step, "x") for step in range(0, 40, 10))  # never 2 in a window
    assert s.strike("p", 40, "x") and s.banned_ids() == ("p",)
    rare = Suspects(SuspectConfig(strikes=3, window_steps=10, max_strikes=5, long_window_steps=100))
    assert not any(rare.strike("q", step, "x") for step in range(0, 1000, 30)), "4 in 100 steps: never evicted"


def _reports(values: dict, scale: float = 1.0) -> dict:
    from swarm.runtime.messages import GradReport

    return {k: GradReport(v, scale) for k, v in values.items()}


def _name(s: int, r: int) -> str:
    return f"stage {s} replica {r}"


@pytest.mark.parametrize("lie", [math.nan, -1.0, -1e30, 1e30, -math.inf])
def test_a_sibling_replica_stands_in_for_an_impossible_norm_and_the_liar_is_struck(lie):
    s = Suspects()
    replies = _reports({(0, 0): 1.0, (1, 0): 2.0, (1, 1): lie, (2, 0): 3.0})
    peers = {(0, 0): "a", (1, 0): "b", (1, 1): "liar", (2, 0): "c"}
    kept = s.judge_grads(0, replies, peers, _name)
    assert kept[(1, 1)] is replies[(1, 0)] and kept[(0, 0)] is replies[(0, 0)]  # the sibling's reply, nothing else
    assert math.isnan(replies[(1, 1)].grad_sq_norm) or replies[(1, 1)].grad_sq_norm == lie  # the input is untouched
    assert s.strikes("liar") == 1 and s.strikes("b") == 0 and s.stood_in == 1
    s.judge_grads(1, replies, peers, _name)
    with pytest.raises(Implausible) as e:  # the third strike evicts: the step runs again without it
        s.judge_grads(2, replies, peers, _name)
    assert e.value.peer == "liar" and e.value.struck and s.banned_ids() == ("liar",) and s.stood_in == 2


def test_nobody_stands_in_for_a_lone_stage_or_a_stage_whose_replicas_all_lie():
    s = Suspects()
    with pytest.raises(Implausible, match="stage 1 replica 0"):
        s.judge_grads(0, _reports({(0, 0): 1.0, (1, 0): math.nan}), {(0, 0): "a", (1, 0): "b"}, _name)
    both = _reports({(0, 0): 1.0, (1, 0): math.nan, (1, 1): -1.0})
    with pytest.raises(Implausible):
        s.judge_grads(1, both, {(0, 0): "a", (1, 0): "d", (1, 1): "e"}, _name)
    assert s.strikes("b") == 1 and s.strikes("d") == 1 and s.stood_in == 0


def test_with_three_replicas_the_odd_norm_is_struck_and_the_agreeing_ones_stand_in():
    s = Suspects()
    replies = _reports({(0, 0): 4.0, (0, 1): 4.0, (0, 2): 0.5})
    kept = s.judge_grads(0, replies, {(0, 0): "a", (0, 1): "b", (0, 2): "odd"}, _name)
    assert kept[(0, 2)].grad_sq_norm == 4.0 and s.strikes("odd") == 1 and s.strikes("a") == 0
    spread = _reports({(0, 0): 4.0, (0, 1): 2.0, (0, 2): 0.5})  # no two agree: nobody can stand in
    with pytest.raises(Implausible, match="report different grad_sq_norm"):
        s.judge_grads(1, spread, {(0, 0): "a", (0, 1): "b", (0, 2): "odd"}, _name)


def test_replicas_agreeing_on_a_norm_far_above_the_history_are_a_real_spike_a_lone_stage_is_struck():
    s = Suspects()
    for _ in range(4):
        s.applied({0: 1.0})
    spike = _reports({(0, 0): 2e4, (0, 1): 2e4})  # 2e4 x the median, on both replicas
    kept = s.judge_grads(0, spike, {(0, 0): "a", (0, 1): "b"}, _name)
    assert kept == spike and s.strikes("a") == s.strikes("b") == 0  # accepted: clipping bounds the update
    # alone, nobody vouches for it: applied as a real spike for spike_steps steps in a row, then struck
    spike_steps = s.cfg.spike_steps
    for step in range(1, 1 + spike_steps):
        assert s.judge_grads(step, _reports({(0, 0): 2e4}), {(0, 0): "a"}, _name)[(0, 0)].grad_sq_norm == 2e4
        s.applied({0: 2e4})  # an applied spike stays out of the median it is judged against
    assert s.strikes("a") == 0
    with pytest.raises(Implausible, match=f"more than 10000 x the median 1 .*{spike_steps + 1} steps in a row"):
        s.judge_grads(1 + spike_steps, _reports({(0, 0): 2e4}), {(0, 0): "a"}, _name)
    assert s.strikes("a") == 1
    stood = _reports({(0, 0): 2e4, (0, 1): math.nan})  # a stand-in is no second opinion: still a lone breach
    with pytest.raises(Implausible, match="more than 10000 x the median"):
        s.judge_grads(2 + spike_steps, stood, {(0, 0): "c", (0, 1): "d"}, _name)
    assert s.strikes("c") == 1 and s.strikes("d") == 1


def test_a_lone_stages_spike_run_ends_with_one_ordinary_norm_and_a_rerun_counts_once():
    s = Suspects()
    for _ in range(4):
        s.applied({0: 1.0})
    for step in range(s.cfg.spike_steps):
        s.judge_grads(step, _reports({(0, 0): 2e4}), {(0, 0): "a"}, _name)
        s.judge_grads(step, _reports({(0, 0): 2e4}), {(0, 0): "a"}, _name)  # the same step again: one count
    s.judge_grads(10, _reports({(0, 0): 1.0}), {(0, 0): "a"}, _name)  # the spike is over
    s.judge_grads(11, _reports({(0, 0): 2e4}), {(0, 0): "a"}, _name)  # a new run starts at 1
    assert s.strikes("a") == 0


def test_implausible_names_nobody_when_two_replicas_disagree_with_no_history():
    from swarm.runtime.messages import GradReport

    s = Suspects()
    replies = {(0, 0): GradReport(1.0, 1.0), (0, 1): GradReport(2.0, 1.0)}
    with pytest.raises(Implausible, match="report different grad_sq_norm") as e:
        s.judge_grads(0, replies, {(0, 0): "a", (0, 1): "b"}, lambda st, r: f"stage {st} replica {r}")
    assert e.value.peer is None and s.strikes("a") == s.strikes("b") == 0


def test_a_stages_gradient_end_allows_a_loss_spikes_jump_its_activation_end_does_not():
    from swarm.runtime.boundary import GRADIENT_WATCH_RATIO, LinkEnds

    ends = LinkEnds(FP32, FP32)
    x = torch.randn(2, 4, 8)
    for end in (ends.forward_recv, ends.backward_recv):
        for _ in range(8):
            assert end.watch.check(x) is None
    assert ends.forward_recv.watch.check(x * 42) is not None  # activations: 30 x
    assert ends.backward_recv.watch.check(x * 42) is None  # an honest spike's gradients (measured: up to 42 x)
    # the spike is now the largest of the last 32: a jump past 100 x of it is refused
    assert "more than 100 x" in ends.backward_recv.watch.check(x * 42 * 101) and GRADIENT_WATCH_RATIO == 100


class _Scaled:
    """Wraps a host's worker: its forward outputs (activations to the next stage) times `factor` from step `after`
    on (the host's open step: a step run again after a failed attempt, which a loaded machine makes, runs more
    forwards than steps, and a count of forwards made the lie start at step 4), or its backward's input gradients
    replaced by NaN (`nan_grads`), or (`overflow`) its fp16 backward finding Inf/NaN every time."""

    def __init__(self, host, factor=1.0, after=0, nan_grads=False, overflow=False):
        self.worker = worker = host.worker
        self.host, self.factor, self.after, self.nan_grads, self.calls = host, factor, after, nan_grads, 0
        self.overflow = overflow
        self._forward, self._backward = worker.forward, worker.backward
        worker.forward, worker.backward = self.forward, self.backward

    def forward(self, *args, **kwargs):
        out = self._forward(*args, **kwargs)
        self.calls += 1
        return out * self.factor if (self.host.open_step or 0) >= self.after else out

    def backward(self, *args, **kwargs):
        grad = self._backward(*args, **kwargs)
        if self.overflow:
            self.worker.found_inf = True  # as `_scaled_backward` marks it: the stage reports +Inf
        return torch.full_like(grad, math.nan) if self.nan_grads and grad is not None else grad


def test_link_watch_refuses_non_finite_and_outsized_messages_and_keeps_zeros_out_of_its_history():
    from swarm.runtime.boundary import LinkWatch

    x = torch.randn(2, 4, 8)
    fresh = LinkWatch(ratio=30, history=8, min_history=4)
    assert fresh.check(x * 300) is None  # no history yet: only finiteness and the ceiling
    watch = LinkWatch(ratio=30, history=8, min_history=4)
    for _ in range(4):
        assert watch.check(x) is None
    assert watch.check(torch.zeros_like(x)) is None  # an fp16 stage's zeros: accepted, not counted
    assert "Inf/NaN" in watch.check(x.clone().index_fill_(0, torch.tensor([0]), math.nan))
    assert "more than 30 x" in watch.check(x * 300)  # the largest is x's RMS: 300x is refused
    assert watch.check(x * 20) is None and 19 < watch.peak_ratio < 21
    assert watch.check(x * 400) is None  # 20x the largest before it (x * 20): honest growth, step by step


def test_link_watch_accepts_a_link_growing_30x_over_a_few_steps_as_the_warm_up_ends():
    """The demo's backward link grew past 30x its median within ~8 steps (median RMS 5.6e-5) and its stage was
    struck out: growth is judged against the largest recent message, not the median."""
    from swarm.runtime.boundary import LinkWatch

    watch = LinkWatch()  # the defaults every receiving end uses
    x = torch.randn(8, 32, 32) * 5e-5
    for k in range(64):
        assert watch.check(x * 1.25**k) is None, k  # x1.25 a message: 1.6e6 x over 64 messages
    assert "more than 30 x" in watch.check(x * 1.25**63 * 31)
    assert "ceiling" in watch.check(torch.full((4,), 2e4))
    assert "Inf/NaN" in watch.check(torch.full((4,), 3e38))  # its square overflows fp32: refused too


class _Flaky:
    """Wraps a servicer: the reply of its first Reduce of each step before `until` is lost as a call on a loaded
    machine times out (the sum ran), so the driver runs that step again (a second forward on every replica of the
    step's routes)."""

    def __init__(self, target, until: int):
        self.target, self.until, self.failed = target, until, set()

    def __getattr__(self, name):
        return getattr(self.target, name)

    def Reduce(self, request, context):
        import grpc

        reply = self.target.Reduce(request, context)
        if request.step < self.until and request.step not in self.failed:
            self.failed.add(request.step)
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "no reply in time (a loaded machine)")
        return reply


@pytest.mark.parametrize("reruns", [False, True])
def test_activations_scaled_300x_are_refused_naming_the_sender_who_is_evicted(caplog, reruns):
    """`reruns`: steps 0-3 each run twice (a failed call), as on the loaded machine where this test once saw step 4
    skipped: its liar then counted forwards, not steps, and lied from its 9th forward, at step 4."""
    pipe = LocalPipeline(CFG, 2, FP32, FP32, replicas=2)
    liar = pipe.replica_peers[0][1]
    # 2 micro-batches per step over 2 routes: one each; stage 1 replica 1 has 8 messages of history after 8 steps
    _Scaled(pipe.replica_hosts[0][1], factor=300.0, after=8)
    if reruns:
        pipe.switches[1][0].target = _Flaky(pipe.switches[1][0].target, until=4)
    try:
        results = _train(pipe, 13)
        assert [r.skipped for r in results] == [False] * 8 + [True, True] + [False] * 3
        assert results[10].attempts == 2 and results[10].routes == 1
        assert pipe.driver(2).suspects.banned_ids() == (liar,)
        refusals = [r.getMessage() for r in caplog.records if "refused the activation" in r.getMessage()]
        assert refusals and all(f"from peer {liar}: RMS" in m for m in refusals)
        applied = [s % 4 for s in [*range(8), 10, 11, 12]]  # steps 8 and 9 skipped
        _assert_as_clean(pipe, applied)
    finally:
        pipe.close()


def test_nan_gradients_from_one_replica_fail_its_sends_until_it_is_evicted():
    pipe = LocalPipeline(CFG, 2, FP32, FP32, replicas=2)
    liar = pipe.replica_peers[1][1]
    _Scaled(pipe.replica_hosts[1][1], nan_grads=True)
    try:
        results = _train(pipe, 5)
        assert [r.skipped for r in results] == [True, True, False, False, False]
        assert pipe.driver(2).suspects.banned_ids() == (liar,)
    finally:
        pipe.close()


def test_an_fp16_stage_overflowing_at_every_loss_scale_is_evicted():
    """fp16: a stage whose gradients are NaN reports +Inf; every stage skips and halves the scale. Once the scale
    is down to 2^8 an honest stage would no longer overflow: each further +Inf is a strike."""
    from swarm.runtime.precision import ScalerConfig
    from swarm.runtime.worker import StageConfig

    cfg = StageConfig(precision="fp16", scaler=ScalerConfig(init_scale=2.0**10))
    pipe = LocalPipeline(CFG, 2, FP32, FP32, replicas=2, stage_cfg=cfg)
    liar = pipe.replica_peers[1][1]
    _Scaled(pipe.replica_hosts[1][1], overflow=True)
    try:
        results = _train(pipe, 8)
        # 2^10 -> 2^9 -> 2^8: two skips without strikes, then three struck ones, then the run goes on without it
        assert [r.skipped for r in results[:4]] == [True] * 4
        assert pipe.driver(2).suspects.banned_ids() == (liar,)
        assert results[4].attempts == 2 and not results[4].skipped  # the evicting step ran again without it
        assert not any(r.skipped for r in results[4:]) and results[-1].routes == 1
    finally:
        pipe.close()


class _LyingStep:
    """Wraps a servicer: its Step replies report loss scale `scale` (the trainer names it in every next call)."""

    def __init__(self, target, scale: float):
        self.target, self.scale = target, scale

    def __getattr__(self, name):
        return getattr(self.target, name)

    def Step(self, request, context):
        reply = self.target.Step(request, context)
        if not request.abandon:
            reply.loss_scale = self.scale
        return reply


def test_a_step_reply_lying_about_the_loss_scale_is_outvoted_and_struck():
    """Believed, the lie would make every stage refuse the next step (the scale is named in every call)."""
    pipe = LocalPipeline(CFG, 2, FP32, FP32, replicas=2)
    liar = pipe.replica_peers[0][1]
    pipe.switches[0][1].target = _LyingStep(pipe.switches[0][1].target, 2.0**20)
    try:
        results = _train(pipe, 5)
        assert not any(r.skipped for r in results) and all(r.loss_scale == 1.0 for r in results)
        assert pipe.driver(2).suspects.banned_ids() == (liar,)  # struck at steps 0, 1, 2
        assert results[3].routes == 1
    finally:
        pipe.close()


class _LyingLoss:
    """Wraps a servicer of the last stage: its Forward replies report `loss`."""

    def __init__(self, target, loss: float):
        self.target, self.loss = target, loss

    def __getattr__(self, name):
        return getattr(self.target, name)

    def Forward(self, items, context):
        reply = self.target.Forward(items, context)
        reply.loss = self.loss
        return reply


@pytest.mark.parametrize("loss", [-1.0, math.nan, 1e30])
def test_a_lying_loss_is_named_and_its_stage_evicted(loss):
    pipe = LocalPipeline(CFG, 2, FP32, FP32, replicas=2)
    liar = pipe.replica_peers[1][1]
    try:
        pipe.train_step(batch(seed=0), n_micro=2)  # the trainer hears the stages' scale (1: unscaled)
        pipe.switches[1][1].target = _LyingLoss(pipe.switches[1][1].target, loss)
        results = [pipe.train_step(batch(seed=step), n_micro=2) for step in range(1, 6)]
        assert [r.skipped for r in results] == [True, True, False, False, False]
        assert pipe.driver(2).suspects.banned_ids() == (liar,)
        assert all(math.isfinite(r.loss) for r in results[2:])
    finally:
        pipe.close()


def test_culprit_is_the_blamed_or_self_named_peer_of_a_failure_a_reply_caused():
    import grpc

    from swarm.net.stream import PLAN_MISMATCH, StageCallError
    from swarm.runtime.suspects import blame_tag, culprit

    peers = {"a", "b"}
    refusal = f"stage 1 (peer b at x:1): refused the activation from peer a: RMS 9 {blame_tag('a')}"
    assert culprit(StageCallError(refusal, grpc.StatusCode.INVALID_ARGUMENT), peers) == "a"
    assert culprit(StageCallError(refusal, grpc.StatusCode.INVALID_ARGUMENT), {"b"}) == "b", "a is off the route"
    own = StageCallError("stage 1 (peer b): activation gradient contains NaN or Inf", grpc.StatusCode.INVALID_ARGUMENT)
    assert culprit(own, peers) == "b"
    assert culprit(StageCallError("stage 1 (peer b) failed: RuntimeError: x", grpc.StatusCode.INTERNAL), peers) == "b"
    gone = StageCallError("stage 1 (peer b at x:1): unreachable or too slow (UNAVAILABLE)", grpc.StatusCode.UNAVAILABLE)
    assert culprit(gone, peers) is None, "a dead peer is rerouted around, not struck"
    moved = StageCallError(f"stage 1 (peer b at x:1): {PLAN_MISMATCH} plan 3", grpc.StatusCode.INVALID_ARGUMENT)
    assert culprit(moved, peers) is None
    assert (
        culprit(StageCallError("stage 1 (peer b at x:1): wrong scale", grpc.StatusCode.FAILED_PRECONDITION), peers)
        is None
    )
    assert culprit(ValueError("x"), peers) is None and culprit(None, peers) is None


def test_impossible_byte_counts_are_dropped_before_the_metrics():
    from swarm.proto import stage_pb2

    s = Suspects()
    honest = stage_pb2.Traffic(fp32_wire_bytes=40, link_bytes={0: 10, 1: 12})
    assert s.counted_bytes(honest, 2) == ({0: 10, 1: 12}, 40, None)
    lying = stage_pb2.Traffic(fp32_wire_bytes=1 << 60, link_bytes={0: 10, 7: 5, 1: 1 << 50})
    links, fp32, why = s.counted_bytes(lying, 2)
    assert links == {0: 10} and fp32 == 0 and why is not None


def test_a_grads_loss_scale_against_the_majority_is_struck_and_a_tie_stays_fatal():
    import grpc

    from swarm.net.stream import StageCallError
    from swarm.runtime.messages import GradReport
    from swarm.runtime.precision import agreed_step

    def name(s, r):
        return f"stage {s} replica {r}"

    s = Suspects()
    three = {(0, 0): GradReport(1.0, 4.0), (1, 0): GradReport(1.0, 4.0), (2, 0): GradReport(1.0, 2.0**20)}
    peers = {(0, 0): "a", (1, 0): "b", (2, 0): "c"}
    with pytest.raises(Implausible, match="stage 2 replica 0: loss_scale 1.04858e\\+06, the other stages computed"):
        s.judge_grads(0, three, peers, name)
    assert s.strikes("c") == 1 and s.strikes("a") == s.strikes("b") == 0
    two = {(0, 0): GradReport(1.0, 4.0), (1, 0): GradReport(1.0, 8.0)}
    s.judge_grads(1, two, {(0, 0): "a", (1, 0): "b"}, name)  # one against one: nobody can be told
    with pytest.raises(StageCallError, match="loss scales disagree") as e:
        agreed_step(1, two, [(0, 0), (1, 0)])
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION


def test_a_frozen_stages_zero_norms_and_another_layout_judge_no_later_norm():
    suspects = Suspects()
    for _ in range(8):
        suspects.applied({0: 0.0, 1: 0.25})  # stage 0 frozen: its gradients are zero
    assert suspects._median(0) is None and suspects._median(1) == 0.25  # nothing to judge stage 0's norms by
    suspects.layout(4)
    assert suspects._median(1) == 0.25  # the first layout seen keeps the history
    suspects.layout(2)  # a repack onto 2 stages: stage 1 holds other layers now
    assert suspects._median(1) is None
