"""The schedule gate: calls that arrive in any order run in the stage's program order, and misuse is refused."""

from __future__ import annotations

import random
import threading

import pytest

from swarm.runtime.gate import GateError, ScheduleGate
from swarm.runtime.schedules import SCHEDULES, Action, Kind

JOIN_S = 10.0
"""How long a test waits for a thread it started; only reached when the gate deadlocks."""
WAIT_S = 10.0
"""The gate's own timeout for calls that are meant to get their turn (or be failed by the test)."""


_arrival = threading.local()
"""`_arrival.event`, when a thread sets one, is set as soon as that thread waits for its turn."""


class _SignallingCondition(threading.Condition):
    """A Condition that tells the test when a thread has started waiting on it, so no sleep is needed."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.waiting.set()
        arrived = getattr(_arrival, "event", None)
        if arrived is not None:
            arrived.set()
        return super().wait(timeout)


def _signalling_gate(stage: int, n_stages: int) -> tuple[ScheduleGate, _SignallingCondition]:
    gate = ScheduleGate(stage, n_stages)
    cond = _SignallingCondition()
    gate._cond = cond
    return gate, cond


def _program(schedule: str, n_stages: int, n_micro: int, stage: int) -> list[Action]:
    return SCHEDULES[schedule](n_stages, n_micro)[stage]


def _run(gate: ScheduleGate, step: int, action: Action, schedule: str, n_micro: int, timeout_s: float = WAIT_S):
    with gate.turn(step, action.kind, action.mb, schedule, n_micro, timeout_s=timeout_s):
        pass


def _in_thread(target, *args) -> tuple[threading.Thread, list[BaseException]]:
    """Starts `target(*args)` in a thread; the returned list receives its exception, if any."""
    errors: list[BaseException] = []

    def body() -> None:
        try:
            target(*args)
        except BaseException as e:  # handed to the test thread, which asserts on it
            errors.append(e)

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread, errors


def _join(thread: threading.Thread) -> None:
    thread.join(JOIN_S)
    assert not thread.is_alive(), "a gated call never returned"


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("n_stages,n_micro", [(1, 1), (2, 3), (3, 4), (4, 4), (4, 6)])
@pytest.mark.parametrize("arrival", ["reversed", "shuffled"])
def test_calls_arriving_out_of_order_run_in_program_order(schedule, n_stages, n_micro, arrival):
    for stage in range(n_stages):
        program = _program(schedule, n_stages, n_micro, stage)
        arrivals = list(reversed(program))
        if arrival == "shuffled":
            random.Random(stage * 100 + n_micro).shuffle(arrivals)
        gate, _ = _signalling_gate(stage, n_stages)
        ran: list[Action] = []
        started = []
        for action in arrivals:
            arrived = threading.Event()

            def call(action=action, arrived=arrived, gate=gate, ran=ran) -> None:
                _arrival.event = arrived
                with gate.turn(7, action.kind, action.mb, schedule, n_micro, timeout_s=WAIT_S):
                    arrived.set()
                    ran.append(action)

            started.append(_in_thread(call))
            # the next call arrives only once this one waits (or runs): arrivals happen exactly in this order
            assert arrived.wait(JOIN_S), f"{action} neither waited for its turn nor ran"
        for thread, _ in started:
            _join(thread)
        assert [e for _, errors in started for e in errors] == []
        assert ran == program
        assert gate.step_done


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_a_repeated_action_is_refused(schedule):
    program = _program(schedule, 3, 4, 1)
    gate = ScheduleGate(1, 3)
    _run(gate, 0, program[0], schedule, 4)
    with pytest.raises(GateError, match="already ran"):
        _run(gate, 0, program[0], schedule, 4)
    _run(gate, 0, program[1], schedule, 4)  # the refusal did not move the gate on


def test_a_repeat_of_an_action_further_back_is_refused():
    program = _program("1f1b", 2, 4, 0)
    gate = ScheduleGate(0, 2)
    for action in program[:3]:
        _run(gate, 0, action, "1f1b", 4)
    with pytest.raises(GateError, match=f"{program[0]} of step 0 already ran"):
        _run(gate, 0, program[0], "1f1b", 4, timeout_s=WAIT_S)


def test_a_duplicate_arriving_while_the_original_runs_is_refused():
    program = _program("1f1b", 2, 2, 0)
    gate = ScheduleGate(0, 2)
    inside, release = threading.Event(), threading.Event()

    def original() -> None:
        with gate.turn(0, program[0].kind, program[0].mb, "1f1b", 2, timeout_s=WAIT_S):
            inside.set()
            release.wait(JOIN_S)

    thread, errors = _in_thread(original)
    try:
        assert inside.wait(JOIN_S)
        duplicate_ran = False
        with pytest.raises(GateError), gate.turn(0, program[0].kind, program[0].mb, "1f1b", 2, timeout_s=0.1):
            duplicate_ran = True
        assert not duplicate_ran
    finally:
        release.set()
        _join(thread)
    assert errors == []


@pytest.mark.parametrize("action", [Action(1, Kind.FORWARD, 4), Action(1, Kind.BACKWARD, -1)], ids=str)
def test_an_action_outside_the_program_is_refused(action):
    gate = ScheduleGate(1, 2)
    with pytest.raises(GateError, match=f"{action} is not in stage 1's program for step 3"):
        _run(gate, 3, action, "gpipe", 4)


@pytest.mark.parametrize("schedule,n_micro,match", [("zb", 4, "unknown schedule"), ("1f1b", 0, "outside 1..1024")])
def test_a_step_with_an_unknown_schedule_or_size_is_refused(schedule, n_micro, match):
    gate = ScheduleGate(0, 2)
    with pytest.raises(GateError, match=match):
        _run(gate, 0, Action(0, Kind.FORWARD, 0), schedule, n_micro)


def test_reset_fails_the_calls_waiting_for_their_turn():
    program = _program("1f1b", 2, 3, 0)
    gate, cond = _signalling_gate(0, 2)
    waiter, errors = _in_thread(_run, gate, 0, program[1], "1f1b", 3)
    assert cond.waiting.wait(JOIN_S)
    gate.reset()
    _join(waiter)
    assert len(errors) == 1 and isinstance(errors[0], GateError)
    assert f"step 0 was abandoned while {program[1]} waited" in str(errors[0])


def test_after_reset_any_next_step_is_accepted_from_the_start():
    program = _program("1f1b", 2, 3, 1)
    gate = ScheduleGate(1, 2)
    _run(gate, 4, program[0], "1f1b", 3)
    gate.reset()
    for action in program:
        _run(gate, 5, action, "1f1b", 3)
    assert gate.step_done


def test_a_step_is_finished_only_once_its_own_program_ran():
    """A reset (an abandon) leaves an empty program, which `step_done` calls done; `finished(step)` does not: a
    Reduce checked between the reset and the next step's first action must not sum the zeroed gradients."""
    program = _program("1f1b", 2, 2, 1)
    gate = ScheduleGate(1, 2)
    for action in program:
        _run(gate, 1, action, "1f1b", 2)
    assert gate.finished(1) and not gate.finished(2)
    gate.reset()
    assert gate.step_done and not gate.finished(1) and not gate.finished(2)
    for action in program[:-1]:
        _run(gate, 2, action, "1f1b", 2)
    assert not gate.finished(2)
    _run(gate, 2, program[-1], "1f1b", 2)
    assert gate.finished(2)


def test_wait_done_waits_through_a_reset_until_the_steps_own_program_ran():
    """An early Reduce of step 2 that came while a killed trainer's step 1 was open waits past the abandon that
    step 2's first call makes, and ends when step 2's last action did."""
    program = _program("1f1b", 2, 2, 1)
    gate, cond = _signalling_gate(1, 2)
    for action in program:
        _run(gate, 1, action, "1f1b", 2)
    done: list[bool] = []
    waiter, errors = _in_thread(lambda: done.append(gate.wait_done(2, WAIT_S, lambda: False)))
    assert cond.waiting.wait(JOIN_S)
    gate.reset()  # step 2's first call abandons step 1
    for action in program:
        assert waiter.is_alive() and not done
        _run(gate, 2, action, "1f1b", 2)
    _join(waiter)
    assert done == [True] and not errors


def test_wait_done_ends_when_told_to_or_at_its_timeout():
    gate, cond = _signalling_gate(1, 2)
    stop = threading.Event()
    done: list[bool] = []
    waiter, _ = _in_thread(lambda: done.append(gate.wait_done(3, WAIT_S, stop.is_set)))
    assert cond.waiting.wait(JOIN_S)
    stop.set()
    gate.wake()
    _join(waiter)
    assert done == [False]
    assert gate.wait_done(3, 0.01, lambda: False) is False


def test_a_body_that_outlives_reset_does_not_move_the_next_step_on():
    program = _program("gpipe", 2, 3, 0)
    gate = ScheduleGate(0, 2)
    inside, release = threading.Event(), threading.Event()

    def stale() -> None:
        with gate.turn(0, program[0].kind, program[0].mb, "gpipe", 3, timeout_s=WAIT_S):
            inside.set()
            release.wait(JOIN_S)

    thread, errors = _in_thread(stale)
    try:
        assert inside.wait(JOIN_S)
        gate.reset()
        _run(gate, 1, program[0], "gpipe", 3)
    finally:
        release.set()
        _join(thread)
    assert errors == []
    _run(gate, 1, program[1], "gpipe", 3, timeout_s=0.1)


def test_a_wait_past_its_timeout_names_the_action_it_waited_for():
    program = _program("gpipe", 3, 2, 2)
    gate = ScheduleGate(2, 3)
    _run(gate, 9, program[0], "gpipe", 2)
    with pytest.raises(GateError) as refused:
        _run(gate, 9, program[2], "gpipe", 2, timeout_s=0.01)
    assert f"{program[2]} waited" in str(refused.value)
    assert f"for {program[1]} of step 9" in str(refused.value)
    _run(gate, 9, program[1], "gpipe", 2)  # the timed-out call did not take the turn it waited for


def test_a_new_step_while_the_old_one_is_unfinished_is_refused():
    program = _program("1f1b", 2, 2, 0)
    gate = ScheduleGate(0, 2)
    _run(gate, 0, program[0], "1f1b", 2)
    with pytest.raises(GateError, match="step 1 arrived while step 0 is unfinished"):
        _run(gate, 1, program[0], "1f1b", 2)
    for action in program[1:]:
        _run(gate, 0, action, "1f1b", 2)
    assert gate.step_done
    _run(gate, 1, program[0], "1f1b", 2)  # a finished step makes way for the next
    assert not gate.step_done
