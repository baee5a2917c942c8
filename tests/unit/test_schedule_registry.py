"""Every registered schedule is a valid program for every stage count and micro-batch count, with no edit here."""

import pytest

from swarm.runtime.schedules import SCHEDULES, Action, Kind, linearize, validate

SIZES = [(s, m) for s in (1, 2, 3, 4) for m in (1, 2, 3, 4, 8)]


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize(("n_stages", "n_micro"), SIZES)
def test_every_registered_schedule_is_valid_and_runs_each_micro_batch_once(name, n_stages, n_micro):
    plan = SCHEDULES[name](n_stages, n_micro)
    validate(plan, n_micro)
    assert len(plan) == n_stages
    for s, actions in enumerate(plan):
        assert sorted(map(str, actions)) == sorted(str(Action(s, k, m)) for k in Kind for m in range(n_micro))
    assert sum(len(step) for step in linearize(plan)) == 2 * n_stages * n_micro
