"""A stage times whole steps for the planner's calibration: the trainer's time up to its Step (carried in the
Step) plus the stage's own Step, under phase "trainer"; a malformed figure, a retried Step and an abandoned step
time nothing."""

from __future__ import annotations

import math

import pytest
from test_replica_host import Replicas

from swarm.daemon.calibrate import read_clock
from swarm.proto import stage_pb2

COUNT = 'swarm_phase_seconds_count{phase="trainer",stage="0"}'
SUM = 'swarm_phase_seconds_sum{phase="trainer",stage="0"}'


def step(pipe: Replicas, n: int, elapsed: float) -> None:
    pipe.split_step(n)
    pipe.reduce(n)
    request = stage_pb2.StepRequest(step=n, global_grad_norm=0.5, trainer_elapsed_s=elapsed)
    pipe.client(0).Step(request)
    pipe.client(0).Step(request)  # a retry after a lost reply: applies and times nothing


def test_the_stage_times_whole_steps_from_the_trainers_figure():
    pipe = Replicas(1)
    step(pipe, 0, 2.5)
    metrics = dict(pipe.client(0).Status(stage_pb2.Empty()).metrics)
    assert metrics[COUNT] == 1.0 and 2.5 <= metrics[SUM] < 2.5 + 5.0  # 2.5 s before Step, plus its Step
    clock = read_clock(metrics, 0)
    assert clock is not None and clock.trainer == (1, metrics[SUM]) and clock.steps == 1


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0, 0.0, 2e6])
def test_a_malformed_trainer_figure_times_nothing(bad):
    pipe = Replicas(1)
    step(pipe, 0, bad)
    metrics = dict(pipe.client(0).Status(stage_pb2.Empty()).metrics)
    assert metrics.get(COUNT, 0.0) == 0.0 and metrics["swarm_step_seconds_count"] == 1.0  # the step itself applied
