"""A refusal from a peer that is out (evicted or declared dead) reruns the step without it, never ends the run.

The full attacks run's liar-scale:300 row (docs/reports/attacks.md, fifth pass): the liar was evicted by step 1's
audit, then the same attempt's Reduce to it came back refused ("more than 64x this member's": its own gradients
were tiny), and the trainer took that refusal for fatal: the run stopped at step 1.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from swarm.runtime.inprocess import LocalPipeline
from swarm.runtime.verify import VerifyConfig
from tests.unit.runtime.test_verify import CFG, FP32, HEARTBEAT_S, batch, scaled

WAIT_S = 60.0


def _refusing_reduce(pipe: LocalPipeline, stage: int, replica: int, driver, after_eviction: bool, liar_at=None):
    """The Reduce of `(stage, replica)` (the liar's own, or `liar_at` names the liar) refuses its sibling's
    gradients as 64x its own. The audits' recomputations wait until that Reduce is called, so the eviction comes
    while it runs; where `after_eviction`, the refusal waits for the eviction (the order the full run saw), else
    it comes at once (before the audit concludes)."""
    liar = pipe.replica_peers[liar_at[0]][liar_at[1]] if liar_at else pipe.replica_peers[stage][replica]
    sibling = pipe.replica_peers[stage][1 - replica]
    reduced, refused = threading.Event(), []

    def until(condition) -> None:
        end, tick = time.monotonic() + WAIT_S, threading.Event()
        while not condition() and time.monotonic() < end:
            tick.wait(0.05)  # polls with a deadline: a condition, not a delay

    class _Gated:
        def __init__(self, target):
            self.target = target

        def __getattr__(self, name):
            return getattr(self.target, name)

        def Recompute(self, request, context):
            until(reduced.is_set)
            return self.target.Recompute(request, context)

    class _Refuses(_Gated):
        def Reduce(self, request, context):
            reduced.set()
            if after_eviction:
                until(lambda: liar in driver.dead)
            refused.append(request.step)
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"member {sibling}'s gradients for step {request.step} have norm 0.66, more than 64x this "
                "member's 0.00357: refused, nothing summed",
            )

    for s, row in enumerate(pipe.switches):
        for r, switch in enumerate(row):
            switch.target = (_Refuses if (s, r) == (stage, replica) else _Gated)(switch.target)
    return refused


@pytest.mark.parametrize("after_eviction", [True, False], ids=["after-its-eviction", "as-its-audit-runs"])
def test_a_refused_reduce_from_the_evicted_liar_reruns_the_step_without_it(after_eviction):
    pipe = LocalPipeline(CFG, 2, FP32, FP32, replicas=2)
    try:
        liar = pipe.replica_hosts[0][0]  # replica 0: its Reduce's refusal is the first failure the driver sees
        scaled(300.0)(liar.worker)
        driver = pipe.driver(4, heartbeat_s=HEARTBEAT_S, verify=VerifyConfig(fraction=1.0, seed=3))
        refused = _refusing_reduce(pipe, 0, 0, driver, after_eviction)
        result = driver.train_step(0, batch(0))  # used to raise: "... more than 64x this member's ..."
        assert refused == [0], "the liar's Reduce was called and refused"
        assert [p for p, _ in driver.liars] == [liar.peer_id] and liar.peer_id in driver.dead
        assert result.attempts == 2 and result.routes == 1 and not result.skipped
        assert [h.steps_done for h in (pipe.replica_hosts[0][1], pipe.replica_hosts[1][1])] == [1, 1]  # the survivors
        assert liar.steps_done == 0 and pipe.replica_hosts[1][0].steps_done == 0  # the liar's route: abandoned
        again = driver.train_step(1, batch(1))  # the run goes on without it
        assert again.attempts == 1 and not again.skipped
    finally:
        pipe.close()


def test_an_honest_replica_on_the_evicted_liars_route_refusing_its_sibling_is_not_struck():
    """The loaded full run's second liar-scale:300 (sixth pass): the liar at the middle stage was evicted by step 0's
    audit, and the honest stage-0 replica on its route, whose gradients the liar's backward made tiny, refused its
    sibling's sum as 64x its own: that honest replica was struck and the step skipped. Now the attempt whose own
    audits evicted a liar runs again without it, and nobody else is struck."""
    pipe = LocalPipeline(CFG, 3, FP32, FP32, replicas=2)
    try:
        liar, refuser = pipe.replica_hosts[1][0], pipe.replica_hosts[0][0]  # one route: (0,0) -> (1,0) -> (2,0)
        scaled(300.0)(liar.worker)
        driver = pipe.driver(4, heartbeat_s=HEARTBEAT_S, verify=VerifyConfig(fraction=1.0, seed=3))
        refused = _refusing_reduce(pipe, 0, 0, driver, after_eviction=False, liar_at=(1, 0))  # first in gather
        result = driver.train_step(0, batch(0))
        assert refused == [0] and [p for p, _ in driver.liars] == [liar.peer_id]
        assert result.attempts == 2 and not result.skipped and result.routes == 1
        assert driver.suspects.strikes(refuser.peer_id) == 0 and refuser.peer_id not in driver.dead
        assert [h.steps_done for h in (pipe.replica_hosts[s][1] for s in range(3))] == [1, 1, 1]
    finally:
        pipe.close()


def test_a_refusal_naming_nobody_out_still_ends_the_step_as_before():
    """The rerun is for calls with a peer that is out: the same refusal from a live member of a live group is
    still a strike for the peer it names (not a free rerun)."""
    pipe = LocalPipeline(CFG, 2, FP32, FP32, replicas=2)
    try:
        driver = pipe.driver(4, heartbeat_s=HEARTBEAT_S, verify=VerifyConfig(fraction=0.0))
        _refusing_reduce(pipe, 0, 1, driver, after_eviction=False)
        result = driver.train_step(0, batch(0))
        assert result.skipped and result.attempts == 1 and driver.dead == set()
        assert driver.suspects.strikes(pipe.replica_peers[0][1]) == 1
    finally:
        pipe.close()
