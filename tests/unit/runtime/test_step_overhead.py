"""The trainer's step path: each micro-batch's Backward start leaves with its Forward (no trip through the trainer
between a last stage's forward and its backward), trains exactly as the sequential calls did, and fails as fast;
the trainer's time per phase reaches the step's counters."""

from __future__ import annotations

import contextlib
import math
import threading
from concurrent.futures import wait

import pytest
import torch

import swarm.runtime.driver as driver_module
from swarm.peers.routes import local_micro
from swarm.proto import stage_pb2
from swarm.runtime.driver import PipelineDriver
from swarm.runtime.host import StageHost
from swarm.runtime.inprocess import LocalPipeline
from swarm.runtime.routing import NoLiveRoute
from swarm.runtime.schedules import backward_follows_forward
from tests.unit.runtime.test_replicas import CFG, FP32, batch, weights

torch.set_num_threads(1)

PHASES = ("pipeline", "reduce", "grads", "commit", "step")
"""the trainer's phases of a step; "labels" too where labels go before the pipeline (`labels_with_pipeline` off)"""


class _Log:
    """Wraps a driver's `_call`: records (event, method, micro-batch) in the order they happen."""

    def __init__(self, driver: PipelineDriver):
        self.events: list[tuple[str, str, int]] = []
        self._lock, self._call = threading.Lock(), driver._call
        driver._call = driver.router.send = self  # the router holds the driver's call since it was made

    def _note(self, event: str, method: str, mb: int) -> None:
        with self._lock:
            self.events.append((event, method, mb))

    def __call__(self, stage, replica, method, request, timeout=None):
        mb = -1
        if method in ("Forward", "Backward"):
            items = list(request)
            mb = stage_pb2.StreamItem.FromString(items[0]).info.micro_batch
            request = iter(items)
        self._note("start", method, mb)
        try:
            return self._call(stage, replica, method, request, timeout)
        finally:
            self._note("end", method, mb)

    def at(self, event: str, method: str, mb: int) -> int:
        return self.events.index((event, method, mb))


def _pipe(stages: int = 2, schedule: str = "1f1b") -> LocalPipeline:
    return LocalPipeline(CFG, stages, FP32, FP32, schedule)


def test_each_backward_start_leaves_before_its_forward_returns():
    pipe = _pipe()
    log = _Log(pipe.driver(4))
    pipe.train_step(batch(8), 4)
    for mb in range(4):
        # the sequential calls started the Backward only once the Forward's reply was back
        assert log.at("start", "Backward", mb) < log.at("end", "Forward", mb), log.events
    assert sum(1 for e in log.events if e[:2] == ("start", "Backward")) == 4, "one Backward per micro-batch"
    pipe.close()


def test_early_backward_trains_exactly_as_the_sequential_calls(monkeypatch):
    runs = {}
    for early in (False, True):
        monkeypatch.setattr(PipelineDriver, "backward_early", early)
        pipe = _pipe()
        losses = [pipe.train_step(batch(8, seed=s), 4).loss for s in range(3)]
        runs[early] = (losses, weights(pipe))
        pipe.close()
    assert runs[True][0] == runs[False][0]
    for name, value in runs[False][1].items():
        torch.testing.assert_close(runs[True][1][name], value, rtol=0, atol=0, msg=name)


def test_the_reduces_leave_with_the_pipeline_and_sum_exactly_as_after_it(monkeypatch):
    runs = {}
    for early in (False, True):
        monkeypatch.setattr(PipelineDriver, "reduce_with_pipeline", early)
        pipe = _pipe()
        log = _Log(pipe.driver(4))
        losses = [pipe.train_step(batch(8, seed=s), 4).loss for s in range(3)]
        reduces = [i for i, e in enumerate(log.events) if e[:2] == ("start", "Reduce")]
        last_backward = max(i for i, e in enumerate(log.events) if e[:2] == ("end", "Backward"))
        # step 3's Reduces (two ends of the tied pair) leave before its last Backward's reply, or after it
        assert len(reduces) == 6 and (reduces[-1] < last_backward) == early, log.events
        runs[early] = (losses, weights(pipe))
        pipe.close()
    assert runs[True][0] == runs[False][0]
    for name, value in runs[False][1].items():
        torch.testing.assert_close(runs[True][1][name], value, rtol=0, atol=0, msg=name)


def test_a_stage_that_refuses_an_early_reduce_is_asked_again_after_the_pipeline(monkeypatch, caplog):
    """A stage of a version that does not wait for its backwards refuses a Reduce sent with the pipeline: the
    trainer sends it again once the pipeline ended, the step goes on, and later steps send Reduce after it."""
    reference = _pipe()
    want = [reference.train_step(batch(8, seed=s), 4).loss for s in range(2)]
    reference.close()
    monkeypatch.setattr(StageHost, "await_backwards", lambda *args: False)  # refuses at once, as before s65
    pipe = _pipe()
    driver = pipe.driver(4)
    log = _Log(driver)
    with caplog.at_level("WARNING", logger="swarm.runtime.driver"):
        got = [pipe.train_step(batch(8, seed=s), 4) for s in range(2)]
    assert [r.loss for r in got] == want and all(r.attempts == 1 for r in got)
    assert driver.reduce_with_pipeline is False and PipelineDriver.reduce_with_pipeline is True
    # said once, by whichever end stage's refusal came first (another test's pipe in this process may refuse too)
    ours = [peers[0] for peers in driver.replica_peers]
    told = [
        r for r in caplog.records
        if "refused a Reduce sent with the pipeline" in r.message and any(p in r.message for p in ours)
    ]  # fmt: skip
    assert len(told) == 1
    assert sum(e[:2] == ("start", "Reduce") for e in log.events) == 2 + 2 + 2  # step 1: early, again; step 2: after
    pipe.close()


def test_gpipe_sends_backward_after_forward():
    """GPipe's last stage runs every forward first: a Backward start sent early would only hold one of its data
    slots longer (with the previous stage's forwards, twice the micro-batches), so it still follows the reply."""
    pipe = _pipe(schedule="gpipe")
    log = _Log(pipe.driver(4))
    pipe.train_step(batch(8), 4)
    for mb in range(4):
        assert log.at("end", "Forward", mb) < log.at("start", "Backward", mb)
    pipe.close()


@pytest.mark.parametrize("stages", [2, 3, 5])
@pytest.mark.parametrize("n_micro", [1, 2, 4, 7])
def test_which_schedules_run_the_backward_right_after_the_forward(stages, n_micro):
    assert backward_follows_forward("1f1b", stages, n_micro)
    assert backward_follows_forward("gpipe", stages, n_micro) == (n_micro == 1)


def test_one_stage_sends_backward_after_forward():
    """A single stage is its own last stage: its Forward and Backward share one caller's data slots, so the
    Backward still waits for the Forward's reply there (nothing to overlap: no boundary)."""
    pipe = _pipe(stages=1)
    log = _Log(pipe.driver(4))
    pipe.train_step(batch(8), 4)
    for mb in range(4):
        assert log.at("end", "Forward", mb) < log.at("start", "Backward", mb)
    pipe.close()


def test_a_dead_last_stage_fails_the_step_without_a_waiting_backward_left():
    """The early Backward calls into a last stage that is gone fail with it: the step raises, and no call of the
    step is left running behind it (nothing waits out a deadline)."""
    pipe = _pipe()
    driver = pipe.driver(4, deadline_s=30.0, max_attempts=1)
    pipe.train_step(batch(8), 4)
    pipe.kill(1)
    with pytest.raises(NoLiveRoute):
        pipe.train_step(batch(8, seed=1), 4)
    done, pending = wait([f for f, _ in driver._inflight], timeout=20.0)
    assert not pending, f"{len(pending)} calls of the failed step still running"
    pipe.close()


def test_a_refused_forward_abandons_the_waiting_backwards():
    """A Forward the last stage refuses (here: its labels never came) fails the step; the Backward starts that
    wait at that stage's gate for their turn are refused when the step is abandoned, and the step is not applied."""
    pipe = _pipe()
    driver = pipe.driver(4, deadline_s=30.0, max_attempts=1)
    driver.labels_with_pipeline = False  # labels first: a refusal for want of them is the last stage's to answer for
    pipe.hosts[-1].await_labels = lambda *args, **kwargs: None  # refuses at once, without waiting for them
    driver.router.labels = lambda *args, **kwargs: None  # PutLabels never sent
    before = weights(pipe)
    with pytest.raises(Exception, match="no labels"):
        pipe.train_step(batch(8), 4)
    done, pending = wait([f for f, _ in driver._inflight], timeout=20.0)
    assert not pending, f"{len(pending)} calls of the failed step still running"
    for name, value in before.items():
        torch.testing.assert_close(weights(pipe)[name], value, rtol=0, atol=0)
    assert all(h.open_step is None for h in pipe.hosts), "the abandoned step is closed on every stage"
    pipe.close()


@pytest.mark.parametrize("labels_first", [False, True])
def test_the_trainers_phases_are_in_the_steps_counters(labels_first):
    pipe = _pipe()
    pipe.driver(4).labels_with_pipeline = not labels_first
    result = pipe.train_step(batch(8), 4)
    phases = PHASES + ("labels",) if labels_first else PHASES
    seconds = {p: result.counters.get(f'swarm_trainer_phase_seconds_total{{phase="{p}"}}', 0.0) for p in phases}
    assert all(s > 0 for s in seconds.values()), seconds
    assert sum(seconds.values()) <= result.seconds
    if not labels_first:
        assert 'swarm_trainer_phase_seconds_total{phase="labels"}' not in result.counters
    pipe.close()


def _reference(steps: int = 3) -> tuple[list[float], dict]:
    """Losses and weights of `steps` steps with the labels sent before the pipeline."""
    pipe = _pipe()
    pipe.driver(4).labels_with_pipeline = False
    losses = [pipe.train_step(batch(8, seed=s), 4).loss for s in range(steps)]
    out = (losses, weights(pipe))
    pipe.close()
    return out


def _same(run: tuple[list[float], dict], reference: tuple[list[float], dict]) -> None:
    assert run[0] == reference[0]
    for name, value in reference[1].items():
        torch.testing.assert_close(run[1][name], value, rtol=0, atol=0, msg=name)


def test_each_steps_first_forward_leaves_before_its_other_calls():
    """`first_call_first`: stage 0 can start only once the step's first Forward is in, so that Forward starts
    before any other call of the step (its labels, the other Forwards, the Backward starts, the early Reduces)."""
    pipe = _pipe()
    log = _Log(pipe.driver(4))
    for s in range(2):
        log.events.clear()
        pipe.train_step(batch(8, seed=s), 4)
        starts = [e for e in log.events if e[0] == "start" and e[1] != "Ping"]  # the heartbeat's run on their own
        assert starts[0] == ("start", "Forward", 0), starts
        assert {m for _, m, _ in starts} >= {"Forward", "Backward", "PutLabels", "Reduce", "Step"}, starts
    pipe.close()


@pytest.mark.parametrize("first_stalls", [False, True])
def test_the_first_forward_sent_first_trains_exactly_as_all_at_once(monkeypatch, first_stalls):
    """The steps train the same with the first Forward sent first; where building that Forward stalls (here: its
    tokens fail to encode once, and the call is sent again by the step's second attempt), the step's other calls
    do not wait on it past its failure."""
    monkeypatch.setattr(PipelineDriver, "first_call_first", False)
    reference = _reference()
    monkeypatch.setattr(PipelineDriver, "first_call_first", True)
    pipe = _pipe()
    pipe.driver(4)
    if first_stalls:
        encode, failed = driver_module.tokens_to_wire, []

        def once(*args, **kwargs):
            if not failed:
                failed.append(True)
                raise RuntimeError("encoding failed")
            return encode(*args, **kwargs)

        monkeypatch.setattr(driver_module, "tokens_to_wire", once)
    with pytest.raises(RuntimeError, match="encoding failed") if first_stalls else contextlib.nullcontext():
        pipe.train_step(batch(8, seed=0), 4)
    if first_stalls:  # the failed step is abandoned everywhere; the same batch trains as the reference's first
        pipe.train_step(batch(8, seed=0), 4)
    losses = [pipe.train_step(batch(8, seed=s), 4).loss for s in range(1, 3)]
    assert losses == reference[0][1:]
    _same(([reference[0][0], *losses], weights(pipe)), reference)
    pipe.close()


def test_labels_that_come_after_the_activation_are_waited_for():
    """Labels go beside the pipeline: here every PutLabels leaves only once the last stage holds a Forward that
    waits for them (the worst order), and the steps train exactly as with the labels sent first."""
    pipe = _pipe()
    driver = pipe.driver(4, deadline_s=60.0)
    last = pipe.hosts[-1]
    waiting = threading.Event()
    await_labels = last.await_labels

    def noted(call, *args, **kwargs):
        if not (call.info.step == last.open_step and local_micro(call.info, last.role.stage)[0] in last.labels):
            waiting.set()  # a Forward is here before its labels
        return await_labels(call, *args, **kwargs)

    last.await_labels = noted
    labels = driver.router.labels

    def late(*args, **kwargs):
        assert waiting.wait(30.0), "no Forward reached the last stage before its labels"
        waiting.clear()
        return labels(*args, **kwargs)

    driver.router.labels = late
    losses = [pipe.train_step(batch(8, seed=s), 4) for s in range(3)]
    assert all(r.attempts == 1 for r in losses), "no step ran twice"
    assert driver.labels_with_pipeline, "labels still go beside the pipeline"
    _same(([r.loss for r in losses], weights(pipe)), _reference())
    pipe.close()


def test_a_last_stage_that_does_not_wait_gets_the_labels_first():
    """A last stage of a version that refuses a Forward whose labels are not there yet (no `await_labels`): the
    step runs again with the labels sent first, and so do the later steps; nobody is struck, and the run trains
    exactly as one that sent the labels first throughout."""
    pipe = _pipe()
    driver = pipe.driver(4, deadline_s=60.0)
    pipe.hosts[-1].await_labels = lambda *args, **kwargs: None  # the older version: no wait
    labels, sent = driver.router.labels, []

    def first_lost(*args, **kwargs):  # the first step's labels lose the race: they arrive only after the refusal
        sent.append(1)
        if len(sent) > 1:
            return labels(*args, **kwargs)

    driver.router.labels = first_lost
    results = [pipe.train_step(batch(8, seed=s), 4) for s in range(3)]
    assert [r.attempts for r in results] == [2, 1, 1]
    assert not driver.labels_with_pipeline
    assert [driver.suspects.strikes(p) for p in driver.peers] == [0, 0]
    _same(([r.loss for r in results], weights(pipe)), _reference())
    pipe.close()


def test_a_neighbours_forward_of_the_next_step_waits_for_the_labels_that_close_the_open_one():
    """A trainer that died mid-step and came back sends no abandon: its next step's labels close the open step at
    the last stage (their caller opened it). The previous stage's Forward of that next step, a caller that may not
    close it, can come first: it waits for those labels instead of being refused as "unfinished" (once 1 of 2
    CI-shaped runs, s61). Here the labels leave only once such a Forward waits."""
    pipe = _pipe()
    driver = pipe.driver(4, deadline_s=60.0)
    driver.backward_early = False  # else the trainer's early Backward start reaches the last stage first and closes it
    pipe.train_step(batch(8), 4)
    pipe.forward_backward(batch(8, seed=1), 4)  # the trainer dies here: no Step, no abandon
    pipe._step += 1
    last = pipe.hosts[-1]
    assert last.open_step == 1
    waiting, await_labels = threading.Event(), last.await_labels

    def noted(call, *args, **kwargs):
        if call.info.step != last.open_step:
            waiting.set()  # the next step's Forward, with the step before still open
        return await_labels(call, *args, **kwargs)

    last.await_labels = noted
    labels = driver.router.labels

    def late(*args, **kwargs):
        assert waiting.wait(30.0), "no Forward of the next step reached the last stage first"
        return labels(*args, **kwargs)

    driver.router.labels = late
    result = pipe.train_step(batch(8, seed=2), 4)
    assert result.attempts == 1 and math.isfinite(result.loss)
    assert last.steps_done == 2
    pipe.close()
