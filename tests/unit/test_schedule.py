"""Schedules as data, checked without running a model."""

import pytest

from swarm.runtime.schedules import (
    Action,
    Kind,
    format_programs,
    gpipe,
    linearize,
    max_in_flight,
    one_f_one_b,
    validate,
)

SIZES = [(s, m) for s in (1, 2, 3, 4) for m in (1, 2, 3, 4, 8)]


def test_actions_print_and_parse():
    assert str(Action(1, Kind.FORWARD, 0)) == "1F0"
    assert str(Action(12, Kind.BACKWARD, 3)) == "12B3"
    assert Action.parse("12B3") == Action(12, Kind.BACKWARD, 3)
    with pytest.raises(ValueError):
        Action.parse("1X0")


@pytest.mark.parametrize("build", [gpipe, one_f_one_b])
@pytest.mark.parametrize("n_stages,n_micro", SIZES)
def test_every_micro_batch_once_per_stage_forward_before_backward(build, n_stages, n_micro):
    plan = build(n_stages, n_micro)
    validate(plan, n_micro)
    assert len(plan) == n_stages
    for s, actions in enumerate(plan):
        assert len(actions) == 2 * n_micro
        for m in range(n_micro):
            assert actions.count(Action(s, Kind.FORWARD, m)) == 1
            assert actions.count(Action(s, Kind.BACKWARD, m)) == 1
            assert actions.index(Action(s, Kind.FORWARD, m)) < actions.index(Action(s, Kind.BACKWARD, m))


@pytest.mark.parametrize("n_stages,n_micro", SIZES)
def test_1f1b_bounds_activations_in_flight(n_stages, n_micro):
    for s, actions in enumerate(one_f_one_b(n_stages, n_micro)):
        assert max_in_flight(actions) <= n_stages - s
        assert max_in_flight(actions) == min(n_stages - s, n_micro)
    for actions in gpipe(n_stages, n_micro):
        assert max_in_flight(actions) == n_micro


@pytest.mark.parametrize("n_stages,n_micro", SIZES)
def test_both_schedules_take_the_same_ideal_time(n_stages, n_micro):
    ideal = 2 * (n_micro + n_stages - 1)  # 2M ticks of work plus the fill and drain bubbles
    assert len(linearize(gpipe(n_stages, n_micro))) == ideal
    assert len(linearize(one_f_one_b(n_stages, n_micro))) == ideal


def test_linearize_respects_dependencies():
    done = set()
    for tick in linearize(one_f_one_b(3, 4)):
        for a in tick:
            if a.kind is Kind.FORWARD and a.stage > 0:
                assert Action(a.stage - 1, Kind.FORWARD, a.mb) in done
            if a.kind is Kind.BACKWARD and a.stage < 2:
                assert Action(a.stage + 1, Kind.BACKWARD, a.mb) in done
        done.update(tick)


def test_1f1b_timeline():
    assert format_programs(one_f_one_b(3, 4)).splitlines() == [
        "0F0 0F1 0F2 .   .   0B0 0F3 0B1 .   0B2 .   0B3",
        ".   1F0 1F1 .   1B0 1F2 1B1 1F3 1B2 .   1B3 .",
        ".   .   2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3 .   .",
    ]


def test_validate_rejects_broken_plans():
    F, B = Kind.FORWARD, Kind.BACKWARD
    with pytest.raises(ValueError, match="micro-batches"):
        validate([[Action(0, F, 0), Action(0, B, 0)]], n_micro=2)
    with pytest.raises(ValueError, match="before its forward"):
        validate([[Action(0, B, 0), Action(0, F, 0)]], n_micro=1)
    with pytest.raises(ValueError, match="another stage"):
        validate([[Action(1, F, 0), Action(1, B, 0)]], n_micro=1)
    deadlock = [
        [Action(0, F, 0), Action(0, B, 0), Action(0, F, 1), Action(0, B, 1)],
        [Action(1, F, 1), Action(1, F, 0), Action(1, B, 0), Action(1, B, 1)],
    ]
    with pytest.raises(ValueError, match="deadlock"):
        validate(deadlock, n_micro=2)
    with pytest.raises(ValueError):
        gpipe(0, 1)
