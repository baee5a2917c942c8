"""The attacks experiment's bounds on a setting's trainer follow its pace: a loaded machine's slow steps are no
stall, a trainer evaluating after its last step is not stopped, a stuck one is."""

from __future__ import annotations

from swarm.experiments.attacks_patience import Patience


def _patience(**kw) -> Patience:
    return Patience(**{"total_steps": 30, "stall_s": 60.0, "soft_deadline": 420.0, "hard_deadline": 1260.0, **kw})


def test_slow_steps_past_the_soft_deadline_run_on_and_a_real_stall_stops():
    p = _patience()
    t = 0.0
    for step in range(1, 29):  # 18 s a step: the fifth pass's load; 28 steps take 504 s
        t = 20.0 + 18.0 * step
        p.observe(step, t)
        assert p.stop(t) is None and (step < 2 or p.stop(t + 80.0) is None)  # 80 s quiet < 5 x 18 s
    assert p.stall_limit_s == 90.0
    assert "no step for" in p.stop(t + 91.0)


def test_a_finished_trainer_evaluating_is_stopped_only_at_the_hard_deadline():
    p = _patience()
    p.observe(1, 10.0)
    p.observe(30, 400.0)
    assert p.stop(700.0) is None  # evaluating past the soft deadline, long after its last step
    assert "hard deadline" in p.stop(1261.0)


def test_a_trainer_that_never_steps_is_stopped_at_the_soft_deadline_and_a_quick_stall_at_stall_s():
    p = _patience()
    assert p.stop(400.0) is None and p.stop(421.0) == "no step by the deadline"
    q = _patience()
    q.observe(1, 10.0)
    q.observe(2, 11.0)  # 1 s steps: the floor stall_s applies
    assert q.stop(70.0) is None and "no step for" in q.stop(72.0)
