"""`swarm train --freeze`: the trainer drives with `FreezingDriver` (PipeTransformer's freezing, decided from
the Grads replies' per-block gradient norms, sent in every Step; `swarm.runtime.freeze`).

One `FreezePolicy` lives for the whole run: a re-plan builds a new driver on the new route around the same
policy, so its windows and history survive joins, repairs and the planner's repack. Routes whose plan already
freezes more layers than the policy (`PlanRoutes.frozen_layers`: the stages apply them, and keep them whatever
fewer a Step says) raise the policy to it (`FreezePolicy.adopt`). So does a prefix the stages applied that their
plan does not carry yet (the planner holds a prefix that moves no layer until its next plan:
`swarm.daemon.repack`): a trainer that connects then (it resumed, or joined) reads every stage's `Status` and
adopts the prefix they all report (`with_stages_prefix`), so that its policy and its steps.csv start from it. A
trainer already running when another one froze layers trains on: its Steps keep the stages' prefix.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from swarm.flags import Flag, Flags

__all__ = [
    "FREEZE_FLAG", "FreezeConfig", "add_freeze_arguments", "driver_factory", "freeze_config", "stages_prefix",
    "with_stages_prefix",
]  # fmt: skip

log = logging.getLogger("swarm.train.freezing")


@dataclass(frozen=True)
class FreezeConfig:
    """The trainer's freezing criterion (`FreezePolicy`'s knobs; see there)."""

    interval: int = 10
    """steps per window of gradient norms"""
    tolerance: float = 0.1
    """relative change of a block's norm that settles it"""
    max_fraction: float = 0.75
    """most of the layers to freeze"""
    alpha: float = 0.2
    """most of the active layers one decision freezes"""
    warmup_steps: int = 0
    """steps before the first window"""

    def __post_init__(self) -> None:
        self.policy(2)  # FreezePolicy validates its knobs: a bad one fails here, before anything starts

    def policy(self, n_layers: int):
        from swarm.runtime.freeze import FreezePolicy

        return FreezePolicy(
            n_layers, self.interval, self.tolerance, self.max_fraction, alpha=self.alpha, warmup_steps=self.warmup_steps
        )


FREEZE_FLAG = Flag(name="--freeze", prefix="freeze-", group="freezing (PipeTransformer)")
"""How a `freeze: FreezeConfig | None` field is flags: `--freeze` turns it on, `--freeze-interval` etc."""


@dataclass(frozen=True)
class _Freezing:
    freeze: FreezeConfig | None = field(default=None, metadata={"flag": FREEZE_FLAG})
    """freeze a growing prefix of the layers by the gradient norms' change; the planner repacks the active
    layers onto fewer stages"""


_FLAGS = Flags(_Freezing)


def add_freeze_arguments(parser: argparse.ArgumentParser) -> None:
    _FLAGS.add_to(parser, config_flag=False)


def freeze_config(args: argparse.Namespace) -> FreezeConfig | None:
    """The flags' `FreezeConfig` (None without --freeze); a bad value fails here, before anything starts."""
    return _FLAGS.from_args(args).freeze


def driver_factory(freeze: FreezeConfig | None, n_layers: int) -> Callable:
    """`make(route, *args, **kwargs)`: a `FreezingDriver` around the run's one policy, raised to the route's
    frozen prefix; without --freeze (`freeze` None) a `PipelineDriver` until a plan freezes layers, then a
    `FreezingDriver` whose policy only follows the plans (it never freezes more by itself), logged."""
    from swarm.runtime.driver import PipelineDriver
    from swarm.runtime.freeze import FreezePolicy, FreezingDriver

    # without --freeze the policy only follows: a frozen prefix is the run's state (the stages keep it whatever a
    # Step says), not one trainer's option, so a plan's frozen_layers is sent in every Step, and never more
    policy = freeze.policy(n_layers) if freeze is not None else FreezePolicy(n_layers, max_fraction=0.0)

    def make(route, *args, **kwargs):
        frozen = getattr(route, "frozen_layers", 0)
        if freeze is None and max(frozen, policy.frozen) == 0:
            return PipelineDriver(*route.driver_args(), *args, **kwargs)  # nothing frozen: nothing to follow
        if freeze is None and frozen > policy.frozen:
            log.info("the plan freezes layers [0, %d): following it (without --freeze this trainer freezes no more)",
                     frozen)  # fmt: skip
        policy.adopt(frozen)
        return FreezingDriver(*route.driver_args(), *args, policy=policy, **kwargs)

    make.policy = policy  # type: ignore[attr-defined]
    return make


def stages_prefix(statuses: Sequence[Iterable[object | None]], n_layers: int) -> int:
    """The frozen prefix every stage reports applying (`swarm_frozen_layers` in `Status`, `[stage][replica]`, None
    for a replica that did not answer): 0 unless every stage has an answer and every answer is the same whole
    number in [0, n_layers). One stage's figure cannot move the trainer (a liar's would freeze the model)."""
    from swarm.daemon.repack import frozen_figure

    figures = set()
    for replies in statuses:
        answered = [r for r in replies if r is not None]
        if not answered:
            return 0
        for reply in answered:
            figure = frozen_figure(dict(reply.metrics), n_layers)
            if figure is None:
                return 0
            figures.add(figure)
    return figures.pop() if len(figures) == 1 else 0


def with_stages_prefix(driver, route, statuses, make: Callable, n_layers: int, say: Callable[[str], None] = log.info):
    """`driver` (just made by `make(route)`; `statuses` its stages' Status replies, `[stage][replica]`, None for
    no answer, as its model check read them), or, when the stages all applied a larger frozen prefix than `route`'s
    plan carries (`stages_prefix`), a driver made anew for that prefix (the old one closed)."""
    applied = stages_prefix(statuses, n_layers)
    if applied <= route.frozen_layers:
        return driver
    say(f"plan {route.plan_version}: its stages froze layers [0, {applied}), which the plan does not carry yet: "
        "following them")  # fmt: skip
    driver.close()
    return make(dataclasses.replace(route, frozen_layers=applied))
