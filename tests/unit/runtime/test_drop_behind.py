"""A replica that sat out steps (an earlier driver took it for dead during a stall) is left out of a plan driven
afresh, so the run goes on on its up-to-date siblings instead of disputing every audit with its stale weights."""

from __future__ import annotations

import torch

from swarm.runtime.inprocess import LocalPipeline
from tests.unit.runtime.test_replicas import CFG, FP32, batch

torch.set_num_threads(1)


def test_a_replica_behind_its_siblings_is_dropped_and_the_step_runs_on_the_others():
    pipe = LocalPipeline(CFG, 2, FP32, FP32, replicas=2)
    try:
        for step in range(2):
            pipe.train_step(batch(seed=step), n_micro=2)
        stale = pipe.replica_hosts[1][1]
        stale.ledger.steps_done -= 1  # as if it sat out step 1 while taken for dead
        driver = pipe.driver(2, max_attempts=1)  # a fresh driver: nobody is dead yet
        assert driver.drop_behind() == [pipe.replica_peers[1][1]]
        assert pipe.replica_peers[1][1] in driver.dead and len(driver.dead) == 1
        result = driver.train_step(2, batch(seed=2))
        assert result.routes == 1 and torch.isfinite(torch.tensor(result.loss))
        assert driver.drop_behind() == [pipe.replica_peers[0][1]], (
            "stage 0's replica on the dropped route sat out step 2 in turn: a driver afresh would leave it out too"
        )
    finally:
        pipe.close()


def test_level_replicas_are_all_kept():
    pipe = LocalPipeline(CFG, 2, FP32, FP32, replicas=2)
    try:
        pipe.train_step(batch(seed=0), n_micro=2)
        driver = pipe.driver(2, max_attempts=1)
        assert driver.drop_behind() == [] and not driver.dead
    finally:
        pipe.close()
