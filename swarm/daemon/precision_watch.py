"""The planner's second look at precisions: the followed plan's stages, precisions chosen again from what the
peers announce now (their speeds, and their stages' sensitivity measured from real gradients).

A fresh plan's precisions are chosen when it is made (`Planner.round`), often before any stage trained, so from the
planner's own sensitivity (the model's init, synthetic inputs). Once the stages announce theirs
(`swarm.daemon.sensitivity_report`), `PrecisionWatch.round` chooses again for the same stages; a different choice
is published as the next plan version with only `precisions` changed. The peers switch between two steps (same
layers: no handover), every stage and the trainer under one plan version, so a step never mixes the old and new
precision of a stage across its replicas. At most one switch per `hold_s`: a figure hovering at the budget must
not switch the stages back and forth.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

__all__ = ["PrecisionWatch"]

log = logging.getLogger("swarm.daemon.precision_watch")


class PrecisionWatch:
    """Re-chooses the followed plan's precisions (see the module docstring).

    Args:
        choose: `swarm.scheduler.precision_choice.precision_planner`'s callable: (stage dicts, announcements) ->
            one precision per stage, or None for fp32 everywhere / nothing to choose from.
        hold_s: the least time between two looks that changed the plan (and after start-up).
        clock: monotonic seconds.
    """

    def __init__(
        self, choose: Callable[[list, list], tuple[str, ...] | None], hold_s: float = 10.0, clock=time.monotonic
    ):
        self.choose, self.hold_s, self.clock = choose, hold_s, clock
        self._at = clock()

    def rechosen(self, plan, peers: list) -> tuple[str, ...] | None:
        """The precisions `plan` should carry now, or None when its own still hold."""
        stages = plan.stage_dicts()
        chosen = self.choose(stages, peers)
        held = plan.precisions
        if chosen is None:  # fp32 everywhere wins (or no figures): a plan that lowered a stage goes back up
            if held is None or all(p == "fp32" for p in held):
                return None
            if any(not stage["peer_ids"] for stage in stages):
                return None
            chosen = ("fp32",) * len(stages)
        return None if held is not None and tuple(held) == tuple(chosen) else tuple(chosen)

    def round(self, planner, current, peers: list):
        """Publishes `current`'s stages with precisions chosen again when they differ (the new record), else None."""
        if self.clock() - self._at < self.hold_s:
            return None
        self._at = self.clock()
        chosen = self.rechosen(current.document, peers)
        if chosen is None:
            return None
        version = planner.next_version(peers)
        if version is None:
            return None
        planner.dht.publish_plan(version, current.document.with_precisions(chosen))
        log.info(
            "published plan %d: plan %d's stages with precisions %s (was %s)",
            version,
            current.version,
            ",".join(chosen),
            ",".join(current.document.precisions or ("each peer's",)),
        )
        return planner.dht.get_plan(planner.spec.layers, peers=peers, check_trainers=False)
