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


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_the_trainer_takes_every_registered_schedule_and_refuses_the_rest(name):
    """The trainer's config reads the registry (one entry adds a schedule), not its own list of names."""
    from swarm.train.trainer import TrainConfig

    assert TrainConfig(schedule=name).schedule == name
    with pytest.raises(ValueError, match="expected one of"):
        TrainConfig(schedule=name + "-not-registered")


def test_the_planner_names_the_schedules_its_cost_model_prices():
    """The planner's cost model prices 1F1B's in-flight bound and GPipe's none: a schedule it does not know is
    refused by name rather than priced as another."""
    from swarm.scheduler.plans import COSTED_SCHEDULES, ModelSpec

    def spec(schedule: str) -> ModelSpec:
        return ModelSpec(layers=4, flops_per_layer=2e12, forward_bytes=4e6, backward_bytes=8e6,
                         gradient_bytes_per_layer=10e6, memory_bytes_per_layer=3e9, schedule=schedule)  # fmt: skip

    assert set(COSTED_SCHEDULES) <= set(SCHEDULES), "a schedule priced by the planner that the runtime cannot run"
    for name in COSTED_SCHEDULES:
        assert spec(name).schedule == name
    with pytest.raises(ValueError, match="cost model prices only"):
        spec("zero-bubble")
