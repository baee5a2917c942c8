"""The CallInfo of a trainer's call, and the route a stage takes from its plan rather than from the call.

Every Forward, Backward and PutLabels names the route it runs on (`CallInfo.chain`), and the stage needs that
route's address and peer id of every stage to send along it. They used to travel in every call (`CallInfo.route`,
`route_peers`: ~70 bytes a call, 0.84 KB of a 2-stage step's 4.8 KB of control). The plan a stage follows
already holds them: its roster (`swarm.runtime.policy.Roster`, set from the validated plan, the same one
`CallPolicy.check_route` holds carried routes to). So:

- The trainer (`RouteAcks`) carries the route to a peer until a call carrying it succeeded there under the
  current plan version; from then on it leaves both fields empty.
- A stage given a call without a route (`fill_route`) takes the call's route (`CallInfo.chain`) from its roster, if
  the call names the plan the stage follows, the stage has a roster of that plan's shape, and that roster puts
  this peer at the call's stage of that route. Otherwise it refuses with FAILED_PRECONDITION and `ROUTE_NEEDED`,
  having changed nothing; the trainer sends the call again with the route, and keeps sending it to that peer
  for that plan.
- A call that carries a route is checked as before (its length here, the roster's route by the policy).

A route therefore never comes from anything but the stage's validated plan or a carried route validated as
before: a stranger naming another plan version is refused as another plan's call before any route is used.
Boundary calls between stages still carry the route the stage filled in (they are checked against the next
stage's roster as before).

`call_info` also leaves `loss_weight` 0 where the micro-batch's weight is 1 / num_micro_batches, `schedule` empty
for 1f1b and `deadline_s` 0 for 120 s: proto3 omits default values, and the stages read each default as exactly
that value (`StageHost.decode`, `StageHost._turn`, `call_wait_s`; stages of earlier versions alike).

`CallRouter.labels` sends a route's labels in one PutLabels (`LabelsRequest.micro_rows`: consecutive
micro-batches, at most `StageBudget.max_batch` rows together, as one micro-batch's may be) before its micro-batches
run, instead of one PutLabels per micro-batch: 3 fewer call infos and a better-compressed token batch a step. A
stage of an earlier version ignores `micro_rows` and would take them all as one micro-batch's labels (not tested
against one): trainer and stages must both have this version.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import threading
from collections.abc import Callable

import grpc
import torch

from swarm.net.stream import CallRefused, StageCallError, tokens_to_wire
from swarm.proto import stage_pb2
from swarm.runtime.budget import StageBudget
from swarm.runtime.messages import CallInfo, from_wire

__all__ = [
    "DEFAULT_DEADLINE_S",
    "DEFAULT_SCHEDULE",
    "ROUTE_NEEDED",
    "CallRouter",
    "RouteAcks",
    "call_info",
    "call_wait_s",
    "fill_route",
    "info_from_wire",
    "info_to_wire",
    "plan_gives_route",
    "route_needed",
]

log = logging.getLogger(__name__)

DEFAULT_DEADLINE_S = 120.0
"""A call's deadline when its `deadline_s` is 0 (proto3's default, so a call with this deadline leaves it out)."""
DEFAULT_SCHEDULE = "1f1b"
"""A call's schedule when its `schedule` is empty (likewise)."""

ROUTE_NEEDED = "route needed:"
"""Marks the refusal of a call without a route that the stage cannot take from its plan: send it again with one."""


def call_info(
    *,
    step: int,
    micro_batch: int,
    stage: int,
    plan_version: int,
    num_micro_batches: int,
    schedule: str,
    route: tuple[tuple[str, ...], tuple[str, ...]] | None,
    deadline_s: float,
    loss_weight: float,
    chain: int,
    loss_scale: float,
) -> stage_pb2.CallInfo:
    """A trainer's call info; `route` (addresses, peer ids) None leaves the route out for the stage to take
    from its plan. Fields equal to what the stage reads for proto3's default are left at the default (not on
    the wire): an equal share's `loss_weight` (exactly 1 / num_micro_batches), the default schedule (1f1b) and
    deadline (120 s)."""
    info = stage_pb2.CallInfo(
        step=step,
        micro_batch=micro_batch,
        stage=stage,
        plan_version=plan_version,
        num_micro_batches=num_micro_batches,
        schedule="" if schedule == DEFAULT_SCHEDULE else schedule,
        deadline_s=0.0 if deadline_s == DEFAULT_DEADLINE_S else deadline_s,
        loss_weight=0.0 if loss_weight == 1.0 / max(1, num_micro_batches) else loss_weight,
        chain=chain,
        loss_scale=loss_scale,
    )
    if route is not None:
        info.route.extend(route[0])
        info.route_peers.extend(route[1])
    return info


def info_from_wire(wire: stage_pb2.CallInfo) -> CallInfo:
    """A call's CallInfo as the host takes it: every field, as it came (repeated fields as tuples)."""
    return from_wire(CallInfo, wire)


def info_to_wire(info: CallInfo) -> stage_pb2.CallInfo:
    """`info` as it goes on the wire (fields at their defaults are not on it, as proto3 leaves them out)."""
    return stage_pb2.CallInfo(**{f.name: getattr(info, f.name) for f in dataclasses.fields(CallInfo)})


NO_LABELS = "no labels for step"
"""How the last stage's refusal of a Forward whose labels never came begins (`labels_missing`)."""


def labels_missing(error: BaseException) -> bool:
    """Whether a failed call was refused by a last stage that had no labels for its micro-batch: one of a version
    that does not wait for labels sent beside the pipeline (`StageHost.await_labels`)."""
    return (
        isinstance(error, StageCallError)
        and error.code == grpc.StatusCode.FAILED_PRECONDITION
        and NO_LABELS in str(error)
    )


def call_wait_s(info: CallInfo, budget: StageBudget) -> float:
    """How long a call may wait at a stage or downstream of it: what it asks, capped by the stage's budget."""
    return min(info.deadline_s or DEFAULT_DEADLINE_S, budget.max_wait_s)


def route_needed(error: BaseException, peer: str | None = None) -> bool:
    """Whether a failed call was refused for a route left out: by `peer` itself (then nothing was done and the
    call may go again with the route), or with `peer` None by any stage of the route (the step may run again)."""
    if not isinstance(error, StageCallError) or error.code != grpc.StatusCode.FAILED_PRECONDITION:
        return False
    text = str(error)
    if ROUTE_NEEDED not in text:  # e.g. "that attempt of step 1 was abandoned", by the same peer and code
        return False
    if peer is None:
        return True
    named = text.split(ROUTE_NEEDED)[0].rsplit("(peer ", 1)  # the stage named right before the refusal
    return len(named) == 2 and named[1].startswith(f"{peer} at ")


class RouteAcks:
    """Which peers took a call carrying the route under which plan version: calls to them may leave it out, from
    the step after the first that said so. Within a step every call carries the route or none does, so a step's
    bytes do not depend on which of its concurrent calls was answered first.

    A peer that refused a call without a route (`ROUTE_NEEDED`) gets the route in every call of that plan."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._acked: dict[tuple[str, int], int] = {}
        """(peer, plan version) -> the step whose call it acknowledged first"""
        self._refused: set[tuple[str, int]] = set()

    def carry(self, peer: str, plan_version: int, step: int) -> bool:
        """Whether a call of `step` to `peer` under `plan_version` must carry the route."""
        key = (peer, plan_version)
        with self._lock:
            return not self._acked.get(key, step) < step or key in self._refused

    def acked(self, peer: str, plan_version: int, step: int) -> None:
        """A call of `step` carrying the route succeeded at `peer`: it follows `plan_version` and holds its roster."""
        with self._lock:
            self._acked.setdefault((peer, plan_version), step)

    def refused(self, peer: str, plan_version: int) -> None:
        """`peer` refused a call without the route: carry it to that peer for the rest of this plan."""
        with self._lock:
            self._refused.add((peer, plan_version))


def _roster_route(info: CallInfo, roster, role, own: str | None) -> tuple[tuple, tuple] | str:
    """The route `info.chain` names, from `roster` (the plan this stage follows: `role.plan_version`; this peer is
    `own`, serving `role.stage` of `role.n_stages`) as (addresses, peer ids), or why the roster cannot give it."""
    if roster is None or roster.n_stages != role.n_stages or info.chain >= roster.n_routes:
        return f"this stage cannot take route {info.chain} from plan {role.plan_version}'s roster"
    addresses, peers = roster.route(info.chain)
    if own is not None and peers[role.stage] != own:
        return (
            f"plan {role.plan_version}'s route {info.chain} names {peers[role.stage]} at stage {role.stage}, "
            "not this peer"
        )
    return addresses, peers


def _ours(info: CallInfo, role) -> bool:
    """Whether the call names the plan and the stage this host serves (no route is taken for another's)."""
    return info.plan_version == role.plan_version and info.stage == role.stage


def plan_gives_route(info: CallInfo, roster, role, own: str | None) -> bool:
    """Whether a route-less call like `info` (which carries its route) would get this same route from `roster`
    here: what a reply's `plan_route` says, so that the caller may leave the route out from then on."""
    return _ours(info, role) and _roster_route(info, roster, role, own) == (tuple(info.route), tuple(info.route_peers))


def fill_route(info: CallInfo, roster, role, own: str | None) -> CallInfo:
    """A route-less call's info with its route from `roster` (`_roster_route`). A call that carries any route, or
    names another plan or another stage, is returned as it is (the host's checks refuse or validate it). Raises
    CallRefused (`ROUTE_NEEDED`) where the roster cannot give this call's route."""
    if len(info.route) or len(info.route_peers) or not _ours(info, role):
        return info
    route = _roster_route(info, roster, role, own)
    if isinstance(route, str):
        raise CallRefused(grpc.StatusCode.FAILED_PRECONDITION, f"{ROUTE_NEEDED} {route}; send the call with its route")
    return dataclasses.replace(info, route=tuple(route[0]), route_peers=tuple(route[1]))


class CallRouter:
    """The trainer's calls along its routes: each micro-batch's call info, and the route it carries until the peer
    took it (`RouteAcks`, owned here). One per driver (one plan).

    Args:
        call: `call(stage, replica, method, request)` -> the reply (the driver's counted, named call).
        replica_peers: peer ids by stage and replica.
        counts: replicas of each stage (route c runs on replica c % counts[s] of stage s).
        plan_version: the plan every call names.
        schedule: the schedule calls name where the layout does not say another.
        deadline_s: longest a micro-batch may take end to end.
        loss_scale: the loss scale every stage holds now (the driver's, as the last replies said), read as each
            call info is made.
    """

    def __init__(
        self,
        call: Callable[..., object],
        replica_peers: list[tuple[str, ...]],
        counts: tuple[int, ...],
        plan_version: int,
        schedule: str,
        deadline_s: float,
        loss_scale: Callable[[], float],
    ):
        self.send, self._loss_scale = call, loss_scale
        self.replica_peers, self.counts = replica_peers, counts
        self.plan_version, self.schedule, self.deadline_s = plan_version, schedule, deadline_s
        self.acks = RouteAcks()
        """peers that took the route under a plan version: calls to them leave it out"""
        self.attempt_id = 0
        """the running attempt's random id (`CallInfo.attempt_id`; 0 before the first step)"""

    def new_attempt(self) -> int:
        """A fresh random id for the calls of the attempt that starts now: a stage told to abandon it refuses its
        late calls."""
        self.attempt_id = 1 + secrets.randbelow(0xFFFFFFFF)
        return self.attempt_id

    def info(self, step: int, mb: int, stage: int, work, layout=None, route=True):
        """The call info of micro-batch `mb` of `work`; `layout`: (schedule, `stage_numbering`) with uneven
        replica counts, None with equal ones; `route` False leaves the route to the stage's plan (`callinfo`)."""
        work_route, (schedule, numbering) = work.route, layout or (self.schedule, None)
        info = call_info(
            step=step,
            micro_batch=mb,
            stage=stage,
            plan_version=self.plan_version,
            num_micro_batches=len(work.micro),
            schedule=schedule,
            route=(work_route.addresses, work_route.peers) if route else None,
            deadline_s=self.deadline_s,
            loss_weight=work.loss_weights[mb],
            chain=work_route.index,
            loss_scale=self._loss_scale(),
        )
        info.attempt_id = self.attempt_id  # the running attempt of the step
        if numbering is not None:  # uneven replica counts: each stage's replica numbers its own micro-batches
            info.stage_micro.extend(numbering[(work_route.index, mb)][0])
            info.stage_micro_count.extend(numbering[(work_route.index, mb)][1])
        return info

    def start(self, step, mb, stage, work, layout, route, tokens=None) -> list[bytes]:
        """The one item of a Forward into stage 0 (with `tokens`) or of the Backward start at the last stage: a list,
        so the call goes as the unary twin (`swarm.net.stream.ONE_ITEM`)."""
        info = self.info(step, mb, stage, work, layout, route)
        return [stage_pb2.StreamItem(info=info, tokens=tokens).SerializeToString()]

    def routed(self, step: int, stage: int, replica: int, method: str, request: Callable[[bool], object]):
        """`method` with `request(carry_route)`: the route is left out once the peer's reply said it takes it from
        this plan (`plan_route`); a peer that cannot refuses at once, and the call goes again with it."""
        peer, version = self.replica_peers[stage][replica], self.plan_version
        carry = self.acks.carry(peer, version, step)
        try:
            reply = self.send(stage, replica, method, request(carry))
        except StageCallError as e:
            if carry or not route_needed(e, peer):  # another stage's refusal: the step runs again (`_recover`)
                raise
            log.info("%s: %s; sending the route", method, e)
            self.acks.refused(peer, version)
            reply = self.send(stage, replica, method, request(True))
        if getattr(reply, "plan_route", False):  # PutLabels' peer says so in its Backward reply
            self.acks.acked(peer, version, step)
        return reply

    def labels(self, step: int, work, layout=None, max_rows: int = StageBudget().max_batch) -> None:
        """The labels of `work`'s micro-batches at its last stage: one PutLabels per run of consecutive micro-batches
        of at most `max_rows` rows together (the most one call may carry), not one per micro-batch."""
        last = len(self.counts) - 1
        replica, runs, rows = work.route.index % self.counts[last], [], 0
        for mb, batch in enumerate(work.micro):
            if not runs or rows + len(batch.targets) > max_rows:
                runs.append([])
                rows = 0
            runs[-1].append(mb)
            rows += len(batch.targets)
        for run in runs:

            def request(route: bool, run=run) -> stage_pb2.LabelsRequest:
                targets = torch.cat([work.micro[mb].targets for mb in run])
                info = self.info(step, run[0], last, work, layout, route)
                out = stage_pb2.LabelsRequest(info=info, labels=tokens_to_wire(targets))
                if len(run) > 1:
                    out.micro_rows.extend(len(work.micro[mb].targets) for mb in run)
                return out

            self.routed(step, last, replica, "PutLabels", request)
