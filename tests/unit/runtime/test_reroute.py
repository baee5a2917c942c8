"""Reroute: a replica killed or hung mid-step; the step reruns whole on the surviving chain, exactly once."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch

from swarm.runtime.heartbeat import HeartbeatConfig
from swarm.runtime.inprocess import LocalPipeline
from swarm.runtime.routing import NoLiveRoute
from tests.unit.runtime.test_replicas import CFG, FP32, batch, weights

torch.set_num_threads(1)


class _KillOn:
    """Wraps a servicer: the first `method` call into it kills its host (LocalPipeline.kill) before it runs."""

    def __init__(self, pipe: LocalPipeline, stage: int, replica: int, method: str = "Forward"):
        self.pipe, self.stage, self.replica, self.method = pipe, stage, replica, method
        self.target = pipe.switches[stage][replica].target

    def __getattr__(self, name):
        if name != self.method:
            return getattr(self.target, name)

        def killed(request, context):
            self.pipe.kill(self.stage, self.replica)
            context.abort(grpc.StatusCode.UNAVAILABLE, "connection reset (killed mid-step)")

        return killed


class _Hang:
    """Wraps a servicer: Forward, Status and Ping never answer until `release` (a peer that hangs)."""

    def __init__(self, target):
        self.target, self.release = target, threading.Event()

    def __getattr__(self, name):
        return getattr(self.target, name)

    def Forward(self, items, context):
        self.release.wait()
        context.abort(grpc.StatusCode.UNAVAILABLE, "released")

    def Status(self, request, context):
        self.release.wait()
        return self.target.Status(request, context)

    def Ping(self, request, context):  # the driver's heartbeats and suspect checks
        self.release.wait()
        return self.target.Ping(request, context)


def _surviving_chain_applied_once(pipe: LocalPipeline, chain: int, steps: int) -> None:
    for row, status in zip(pipe.replica_hosts, pipe.driver(4).replica_status(), strict=True):
        host = row[chain]
        assert host.steps_done == steps and host.open_step is None
        assert status[chain].last_step == steps - 1 and status[chain].steps_done == steps


def _clean_reference(b, n_micro: int = 4):
    ref = LocalPipeline(CFG, 2, FP32, FP32)
    try:
        result = ref.train_step(b, n_micro=n_micro)
        return result, weights(ref)
    finally:
        ref.close()


@pytest.mark.parametrize("method", ["Forward", "Backward", "Reduce"])
def test_a_replica_killed_mid_step_reroutes_the_step_to_the_other_chain(method):
    pipe = LocalPipeline(CFG, 2, FP32, FP32, replicas=2)
    b = batch(seed=3)
    try:
        pipe.switches[1][0].target = _KillOn(pipe, 1, 0, method)
        result = pipe.train_step(b, n_micro=4)
        dead = pipe.replica_peers[1][0]
        assert result.attempts == 2 and result.dead_peers == (dead,) and result.routes == 1
        assert sorted(result.sample_ids) == b.sample_ids.tolist()
        assert pipe.driver(4).live_routes() == [1] and pipe.driver(4).dead == {dead}
        _surviving_chain_applied_once(pipe, 1, steps=1)
        left = pipe.replica_hosts[0][0]  # alive, on the dead chain: abandoned, nothing applied or kept
        assert left.steps_done == 0 and left.open_step is None
        assert all(p.grad is None or not p.grad.any() for p in left.worker.module.parameters())
        ref, ref_weights = _clean_reference(b)
        assert result.loss == pytest.approx(ref.loss, abs=1e-5)
        for name, w in weights(pipe, replica=1).items():
            torch.testing.assert_close(w, ref_weights[name], atol=1e-5, rtol=0, msg=name)
        again = pipe.train_step(batch(seed=4), n_micro=4)  # the next step runs on the survivor at once
        assert again.attempts == 1 and again.routes == 1 and again.dead_peers == ()
        _surviving_chain_applied_once(pipe, 1, steps=2)
    finally:
        pipe.close()


def test_a_hung_peer_is_declared_dead_by_heartbeat_and_the_step_reroutes():
    pipe = LocalPipeline(CFG, 2, FP32, FP32, replicas=2)
    hang = _Hang(pipe.switches[1][0].target)
    pipe.switches[1][0].target = hang
    heartbeat = HeartbeatConfig(confirm_s=3.0)  # silent 3 s, then a 3 s probe that never answers (the default: 10 s)
    try:
        pipe.driver(4, heartbeat=heartbeat)
        start = time.monotonic()
        result = pipe.train_step(batch(seed=1), n_micro=4)  # the driver's deadline is 120 s
        elapsed = time.monotonic() - start
        assert result.attempts == 2 and result.dead_peers == (pipe.replica_peers[1][0],)
        assert elapsed < heartbeat.hang_bound_s, f"reroute took {elapsed:.1f} s"
        _surviving_chain_applied_once(pipe, 1, steps=1)
    finally:
        hang.release.set()
        pipe.close()


class _Slow:
    """Wraps a servicer: every Ping answers after `ping_s`, Forward starts after `forward_s` (a peer on a loaded
    machine: slow, but it answers)."""

    def __init__(self, target, ping_s: float, forward_s: float):
        self.target, self.ping_s, self.forward_s, self.pings = target, ping_s, forward_s, 0
        self.never = threading.Event()  # never set: its waits are the peer's slowness, not a synchronisation

    def __getattr__(self, name):
        return getattr(self.target, name)

    def Forward(self, items, context):
        self.never.wait(self.forward_s)
        return self.target.Forward(items, context)

    def Ping(self, request, context):
        self.pings += 1
        self.never.wait(self.ping_s)
        return self.target.Ping(request, context)


def test_a_peer_whose_pings_take_four_intervals_is_not_declared_dead():
    """Issue 27 (false deaths under load): with pings 4x the heartbeat interval, the fixed count of 3 missed
    pings declared the peer dead and rerouted the step; now its silence is confirmed with a longer probe, which
    it answers."""
    pipe = LocalPipeline(CFG, 2, FP32, FP32, replicas=2)
    slow = _Slow(pipe.switches[1][0].target, ping_s=2.0, forward_s=5.0)
    pipe.switches[1][0].target = slow
    try:
        pipe.driver(4, heartbeat=HeartbeatConfig(interval_s=0.5, floor_s=0.5))
        result = pipe.train_step(batch(seed=1), n_micro=4)
        assert result.attempts == 1 and result.dead_peers == () and result.routes == 2
        assert slow.pings >= 2, "the heartbeats reached the slow peer"
        assert pipe.driver(4).round_trips.srtt(pipe.replica_peers[1][0]) >= 2.0
        for chain in (0, 1):
            _surviving_chain_applied_once(pipe, chain, steps=1)
    finally:
        pipe.close()


def test_a_peer_killed_while_its_call_hangs_is_declared_dead_by_the_heartbeats():
    """A killed process refuses the confirming probe at once: declared dead after the window (3 intervals), as
    the fixed count of misses did, not after the probe's deadline; the step reroutes."""
    pipe = LocalPipeline(CFG, 2, FP32, FP32, replicas=2)
    target, release = pipe.switches[1][0].target, threading.Event()

    class _KilledMidCall:  # its first Forward kills it; its Forwards then hang (half-open), every other call is
        killed = False  # refused: only the heartbeats' pings can tell

        def __getattr__(self, name):
            if not self.killed:
                return getattr(target, name)
            return lambda request, context: context.abort(grpc.StatusCode.UNAVAILABLE, "connection refused")

        def Forward(self, items, context):
            type(self).killed = True
            release.wait()
            context.abort(grpc.StatusCode.UNAVAILABLE, "released")

    pipe.switches[1][0].target = _KilledMidCall()
    try:
        pipe.driver(4, heartbeat=HeartbeatConfig(confirm_s=600.0))  # declared dead only by a refused probe
        start = time.monotonic()
        result = pipe.train_step(batch(seed=1), n_micro=4)
        assert time.monotonic() - start < 300, "waited for the probe's deadline, not its refusal"
        assert result.attempts == 2 and result.dead_peers == (pipe.replica_peers[1][0],)
        _surviving_chain_applied_once(pipe, 1, steps=1)
    finally:
        release.set()
        pipe.close()


def test_both_replicas_of_a_stage_dead_raises_no_live_chain_naming_it():
    pipe = LocalPipeline(CFG, 2, FP32, FP32, replicas=2)
    try:
        pipe.kill(1, 0)
        pipe.kill(1, 1)
        with pytest.raises(NoLiveRoute, match="stage 1"):
            pipe.train_step(batch(), n_micro=4)
        for host in (pipe.replica_hosts[0][0], pipe.replica_hosts[0][1]):
            assert host.steps_done == 0 and host.open_step is None
        with pytest.raises(NoLiveRoute, match="stage 1"):  # and at once for the next step
            pipe.train_step(batch(), n_micro=4)
    finally:
        pipe.close()


def test_a_failed_call_on_a_live_peer_does_not_declare_it_dead():
    pipe = LocalPipeline(CFG, 2, FP32, FP32, replicas=2)
    calls = []
    target = pipe.switches[0][1].target

    class _FlakyOnce:
        def __getattr__(self, name):
            return getattr(target, name)

        def Forward(self, items, context):
            calls.append(1)
            if len(calls) == 1:
                context.abort(grpc.StatusCode.UNAVAILABLE, "connection reset once")
            return target.Forward(items, context)

    pipe.switches[0][1].target = _FlakyOnce()
    try:
        result = pipe.train_step(batch(seed=2), n_micro=4)
        assert result.attempts == 2 and result.dead_peers == () and pipe.driver(4).dead == set()
    finally:
        pipe.close()


def test_one_chain_keeps_working_without_replicas():
    pipe = LocalPipeline(CFG, 3, FP32, FP32)
    try:
        result = pipe.train_step(batch(n=8), n_micro=4)
        assert result.routes == 1 and result.attempts == 1 and result.reduce_bytes == 0
        assert sorted(result.sample_ids) == list(range(8))
    finally:
        pipe.close()


def test_a_replica_killed_at_step_time_is_left_behind_and_the_others_apply_the_step():
    pipe = LocalPipeline(CFG, 2, FP32, FP32, replicas=2)
    try:
        pipe.switches[1][0].target = _KillOn(pipe, 1, 0, "Step")
        result = pipe.train_step(batch(seed=6), n_micro=4)
        assert result.attempts == 1 and result.routes == 2 and result.dead_peers == (pipe.replica_peers[1][0],)
        assert [h.steps_done for h in (pipe.replica_hosts[0][0], pipe.replica_hosts[0][1])] == [1, 1]
        assert pipe.replica_hosts[1][1].steps_done == 1
        again = pipe.train_step(batch(seed=7), n_micro=4)
        assert again.routes == 1 and again.attempts == 1
        _surviving_chain_applied_once(pipe, 1, steps=2)
    finally:
        pipe.close()


def test_a_step_whose_reply_was_lost_is_asked_again_and_applied_once():
    pipe = LocalPipeline(CFG, 2, FP32, FP32, replicas=2)
    target, lost = pipe.switches[0][1].target, []

    class _LoseFirstStepReply:
        def __getattr__(self, name):
            return getattr(target, name)

        def Step(self, request, context):
            reply = target.Step(request, context)
            if not request.abandon and not lost:
                lost.append(reply)
                context.abort(grpc.StatusCode.UNAVAILABLE, "connection reset before the reply")
            return reply

    pipe.switches[0][1].target = _LoseFirstStepReply()
    try:
        result = pipe.train_step(batch(seed=8), n_micro=4)
        assert lost and result.attempts == 1 and result.dead_peers == ()
        assert all(h.steps_done == 1 for row in pipe.replica_hosts for h in row)
        status = pipe.driver(4).replica_status()
        assert all(len({r.weights_digest for r in row}) == 1 for row in status)
    finally:
        pipe.close()


def test_a_batch_smaller_than_the_live_routes_is_refused_before_any_call():
    pipe = LocalPipeline(CFG, 2, FP32, FP32, replicas=2)
    try:
        with pytest.raises(ValueError, match="cannot feed 2 live routes"):
            pipe.train_step(batch(n=1), n_micro=1)
        assert all(h.open_step is None for row in pipe.replica_hosts for h in row)
    finally:
        pipe.close()
