"""Who may call what on a stage: the plan's roster and the rules the stage service enforces with it.

Authentication (`swarm.net.auth`) says who is calling; this module says whether that peer may make this
call. A stage serves data and step calls only from its neighbours on the plan's route and from the plan's
trainers, hands its state only to peers the plan names, and follows (and so sends along) only the plan's
route, whatever route a caller writes into its `CallInfo`. Every refusal names the rule it broke.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from swarm.net.stream import CallRefused
from swarm.proto import stage_pb2

__all__ = ["CallPolicy", "Roster"]


@dataclass(frozen=True)
class Roster:
    """The peers of the plan a stage serves under."""

    stage_peers: tuple[str, ...]
    """Peer id serving each stage, in pipeline order."""
    addresses: tuple[str, ...]
    """gRPC address of each stage, in pipeline order: the only route a call may name."""
    trainers: frozenset[str] | None
    """Peer ids that may train on the pipeline; None: any authenticated caller (a public run)."""
    plan_peers: frozenset[str]
    """Every peer of the plan: those who may fetch this stage's state."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "stage_peers", tuple(self.stage_peers))
        object.__setattr__(self, "addresses", tuple(self.addresses))
        object.__setattr__(self, "plan_peers", frozenset(self.plan_peers) | frozenset(self.stage_peers))
        if self.trainers is not None:
            object.__setattr__(self, "trainers", frozenset(self.trainers))
        if not self.stage_peers or len(self.stage_peers) != len(self.addresses):
            raise ValueError("Roster: stage_peers and addresses must name the same, non-zero number of stages")

    @property
    def n_stages(self) -> int:
        return len(self.stage_peers)


def _denied(rule: str) -> CallRefused:
    return CallRefused(grpc.StatusCode.PERMISSION_DENIED, f"not authorized: {rule}")


class CallPolicy:
    """The rules of one stage under one roster; each check raises CallRefused (PERMISSION_DENIED) naming the
    rule, or returns.

    Args:
        roster: the plan's peers; None (no plan known yet): only Probe, Sink and Status are served.
    """

    def __init__(self, roster: Roster | None):
        self.roster = roster

    def _need_roster(self) -> Roster:
        if self.roster is None:
            raise _denied("this stage knows no plan roster yet, so it serves no data, step or state calls")
        return self.roster

    def _trainer(self, caller: str, what: str) -> None:
        roster = self._need_roster()
        if roster.trainers is not None and caller not in roster.trainers:
            raise _denied(f"{what} only from a trainer of the plan; {caller} is not one")

    def check_sender(self, method: str, stage: int, caller: str) -> None:
        """Forward, Backward and PutLabels into `stage` (this peer's) by `caller`: checked before the call's
        body is read, so a stranger's stream costs nothing."""
        roster = self._need_roster()
        last = roster.n_stages - 1
        if stage > last:
            raise _denied(f"stage {stage} is not in the plan's {roster.n_stages} stages")
        if method == "PutLabels":
            self._trainer(caller, "PutLabels")
        elif method == "Forward" and stage == 0:
            self._trainer(caller, "Forward into stage 0")
        elif method == "Backward" and stage == last:
            self._trainer(caller, "Backward into the last stage")
        else:
            sender = stage - 1 if method == "Forward" else stage + 1
            if caller != roster.stage_peers[sender]:
                raise _denied(
                    f"{method} into stage {stage} only from the plan's peer of stage {sender} "
                    f"({roster.stage_peers[sender]}), not {caller}"
                )

    def check_route(self, info: stage_pb2.CallInfo) -> None:
        """A call's route must be the plan's: a stage sends only where the plan says."""
        roster = self._need_roster()
        if tuple(info.route) != roster.addresses or tuple(info.route_peers) != roster.stage_peers:
            raise _denied(
                f"route: the call names route {list(info.route)[:8]} of peers {list(info.route_peers)[:8]}, "
                f"the plan's is {list(roster.addresses)} of peers {list(roster.stage_peers)}"
            )

    def check_step(self, method: str, caller: str) -> None:
        """Grads and Step (abandon included) only from a trainer."""
        self._trainer(caller, method)

    def check_state(self, caller: str) -> None:
        """GetState only to the plan's peers."""
        roster = self._need_roster()
        if caller not in roster.plan_peers:
            raise _denied(f"GetState only to a peer of the plan; {caller} is not one")
