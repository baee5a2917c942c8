"""The trainer resumes after a SIGKILL at any point of a step (`tests.integration.resume_kills`): every stage
applies every step exactly once, the weights equal an uninterrupted run's, steps.csv holds each step once.

The suite runs one kill at each precise point (8) and two at random times; `SWARM_RESUME_KILLS=20` (or
`python -m tests.integration.resume_kills --kills 20`) runs the long form."""

from __future__ import annotations

import os

import pytest

from tests.integration.resume_kills import POINTS, run_with_kills

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def test_a_trainer_killed_at_every_point_of_a_step_resumes_to_the_uninterrupted_run(tmp_path):
    kills = int(os.environ.get("SWARM_RESUME_KILLS", 0)) or len(POINTS) + len(POINTS) // 3
    outcome = run_with_kills(tmp_path, kills, log=print)
    assert outcome.ok, "\n".join(outcome.problems)
    assert len(outcome.kills) == kills and {k.split(":")[0] for k in outcome.kills} >= set(POINTS)
    assert {"finished", "abandoned"} <= set(outcome.settled)  # both ways of settling a step ran
