"""A Reduce refused as out of proportion is audited whole before anyone is struck.

The full attacks run's liar-scale:300 (docs/reports/attacks.md, sixth pass): a x300 liar at the middle stage, whose
micro-batches the audits did not sample, made the honest stage-0 replica on its route compute tiny gradients; that
replica refused its sibling's sum as "more than 64x this member's", was struck, and the step was skipped, twice,
before an audit caught the liar at step 2. In process, with no micro-batch sampled, the honest refuser was struck
out (evicted at step 2) and the liar stayed. Now such a refusal makes the trainer audit every micro-batch of the
attempt on the routes through the refuser and the member it named: the liar is evicted at the step of the refusal,
the step runs again without it, and the refuser is not struck.
"""

from __future__ import annotations

import logging

import grpc
import pytest

from swarm.net.stream import StageCallError
from swarm.runtime.inprocess import LocalPipeline
from swarm.runtime.suspects import PROPORTION_TAG, disproportionate, proportion_tag
from swarm.runtime.verify import VerifyConfig
from tests.unit.runtime.test_verify import CFG, FP32, HEARTBEAT_S, batch, scaled

UNSAMPLED = VerifyConfig(fraction=1e-9, suspect_fraction=0.0, entry_steps=0, seed=3)
"""audits on, but no micro-batch sampled: only the refusal's own audits run"""


def test_disproportionate_reads_the_refusers_tag_and_nothing_else():
    text = (
        "stage 1 (peer aa at local:1.0): member bb's gradients for step 4 have norm 0.66, more than 64x this "
        f"member's 0.00357: refused, nothing summed {proportion_tag('bb')}"
    )
    assert disproportionate(StageCallError(text, grpc.StatusCode.INVALID_ARGUMENT)) == (1, "aa", "bb")
    assert disproportionate(StageCallError(text, grpc.StatusCode.UNAVAILABLE)) is None  # a dead peer's code
    untagged = text.replace(proportion_tag("bb"), "")
    assert disproportionate(StageCallError(untagged, grpc.StatusCode.INVALID_ARGUMENT)) is None
    unnamed = text.split(": ", 1)[1]  # not a call's failure as the driver names it
    assert disproportionate(StageCallError(unnamed, grpc.StatusCode.INVALID_ARGUMENT)) is None
    assert disproportionate(ValueError(text)) is None and disproportionate(None) is None


@pytest.mark.parametrize("liar_stage", [1, 0], ids=["liar-upstream-of-the-refuser", "liar-is-the-refuser"])
def test_an_out_of_proportion_refusal_evicts_the_unsampled_liar_at_that_step_and_strikes_nobody(caplog, liar_stage):
    """The liar at stage 1, route 0 ((0,0) -> (1,0) -> (2,0)): the honest (0,0) refuses its sibling's sum (so may
    the liar, whose own gradients are tiny as well); the liar at (0,0): it refuses its honest sibling itself.
    Either way the liar is evicted at step 0, nobody is struck, and no step is skipped."""
    pipe = LocalPipeline(CFG, 3, FP32, FP32, replicas=2)
    try:
        liar, refuser = pipe.replica_hosts[liar_stage][0], pipe.replica_hosts[0][0]
        scaled(300.0)(liar.worker)
        driver = pipe.driver(4, heartbeat_s=HEARTBEAT_S, verify=UNSAMPLED, max_attempts=5)
        with caplog.at_level(logging.WARNING, logger="swarm.runtime.driver"):
            result = driver.train_step(0, batch(0))
        # the first refusal the driver sees: the honest (0,0)'s, or the liar's own (its gradients are tiny too)
        assert any(PROPORTION_TAG in r.getMessage() for r in caplog.records), "a Reduce was refused as 64x"
        assert [p for p, _ in driver.liars] == [liar.peer_id] and liar.peer_id in driver.dead
        assert not result.skipped and result.attempts >= 2 and result.routes == 1  # run again, without its route
        assert all(driver.suspects.strikes(p) == 0 for row in pipe.replica_peers for p in row)
        assert liar_stage == 0 or refuser.peer_id not in driver.suspects.banned  # the honest refuser: no strike
        assert liar.peer_id in driver.suspects.banned and len(driver.suspects.banned) == 1
        assert [pipe.replica_hosts[s][1].steps_done for s in range(3)] == [1, 1, 1]  # the survivors applied it
        assert [pipe.replica_hosts[s][0].steps_done for s in range(3)] == [0, 0, 0]  # the liar's route: abandoned
        again = driver.train_step(1, batch(1))
        assert not again.skipped and again.attempts == 1
    finally:
        pipe.close()


def _refuses_once(pipe: LocalPipeline, stage: int, replica: int) -> list[int]:
    """(stage, replica)'s Reduce refuses its sibling's gradients as out of proportion, with the tag, at its first
    call (an honest pipeline: the audits find nobody)."""
    sibling = pipe.replica_peers[stage][1 - replica]
    refused: list[int] = []

    class _Refuses:
        def __init__(self, target):
            self.target = target

        def __getattr__(self, name):
            return getattr(self.target, name)

        def Reduce(self, request, context):
            if refused:
                return self.target.Reduce(request, context)
            refused.append(request.step)
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"member {sibling}'s gradients for step {request.step} have norm 0.66, more than 64x this member's "
                f"0.00357: refused, nothing summed {proportion_tag(sibling)}",
            )

    switch = pipe.switches[stage][replica]
    switch.target = _Refuses(switch.target)
    return refused


def test_an_out_of_proportion_refusal_the_audits_cannot_explain_is_judged_as_before():
    """Nobody lies: every micro-batch of the two routes is audited and passes; the refuser is struck and the step
    skipped, as without the audits (and a refuser that lies pays for the audits with its strike)."""
    pipe = LocalPipeline(CFG, 2, FP32, FP32, replicas=2)
    try:
        driver = pipe.driver(4, heartbeat_s=HEARTBEAT_S, verify=UNSAMPLED)
        refused = _refuses_once(pipe, 0, 1)
        split: list = []  # the routes' micro-batches: 4 in all, or 5 where the rows split 7 to 1 (peer ids hash)
        real = driver._work
        driver._work = lambda batch, routes: split.append(work := real(batch, routes)) or work
        result = driver.train_step(0, batch(0))
        assert refused == [0] and result.skipped and driver.liars == [] and driver.dead == set()
        assert driver.suspects.strikes(pipe.replica_peers[0][1]) == 1
        assert len(split) == 1 and len(split[0]) == 2  # one attempt, on both routes
        micro_batches = sum(len(w.micro) for w in split[0])
        assert driver.verifier.stats.audits == micro_batches  # every micro-batch of both routes, none sampled
        assert not driver.train_step(1, batch(1)).skipped
    finally:
        pipe.close()
