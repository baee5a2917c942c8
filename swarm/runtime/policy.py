"""Who may call what on a stage: the plan's roster and the rules the stage service enforces with it.

Authentication (`swarm.net.auth`) says who is calling; this module says whether that peer may make this
call. A stage serves data and step calls only from its neighbours on its route of the plan and from the plan's
trainers, gradient sums only from the other replicas of its stage, hands its state only to peers the plan names,
and follows (and so sends along) only the plan's routes (`swarm.peers.routes`), whatever route a caller
writes into its `CallInfo`.
Every refusal names the rule it broke.

`bind_calls` makes the stage service refuse a call whose proof (`swarm.net.auth`) does not sign that very call:
a captured token, or a captured call, is useless for another method, other fields, or a second time.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from swarm.net.auth import AuthError, PendingCall
from swarm.net.connect import method_path
from swarm.net.stream import METHODS, CallRefused
from swarm.peers.routes import n_routes, route_replicas
from swarm.runtime.messages import CallInfo, ReduceOrder

__all__ = ["CallPolicy", "Roster", "bind_calls"]


Peers = tuple[tuple[str, ...], ...]


def _nested(value, what: str) -> Peers:
    """Replicas per stage from a flat (one per stage) or nested (replicas of each stage) sequence."""
    out = tuple((v,) if isinstance(v, str) else tuple(str(x) for x in v) for v in value)
    if not out or any(not replicas for replicas in out):
        raise ValueError(f"Roster: {what} must name at least one peer for each of at least one stage")
    return out


@dataclass(frozen=True)
class Roster:
    """The peers of the plan a stage serves under: R_s replicas of stage s (counts may differ between stages),
    and C = lcm(R_s) routes, route c running on replica c % R_s of every stage s (`swarm.peers.routes`): a
    replica sends forward only to its route's replica of stage s+1, backward only to its route's of stage s-1.
    With equal counts R, route c is column c of the plan."""

    stage_peers: Peers
    """Peer ids of each stage's replicas, in pipeline order (given flat, one per stage, or nested)."""
    addresses: Peers
    """gRPC addresses of each stage's replicas, same shape: the only routes a call may name."""
    trainers: frozenset[str] | None
    """Peer ids that may train on the pipeline; None: any authenticated caller (a public run)."""
    plan_peers: frozenset[str]
    """Every peer of the plan: those who may fetch this stage's state."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "stage_peers", _nested(self.stage_peers, "stage_peers"))
        object.__setattr__(self, "addresses", _nested(self.addresses, "addresses"))
        every = frozenset(p for replicas in self.stage_peers for p in replicas)
        object.__setattr__(self, "plan_peers", frozenset(self.plan_peers) | every)
        if self.trainers is not None:
            object.__setattr__(self, "trainers", frozenset(self.trainers))
        if [len(r) for r in self.stage_peers] != [len(r) for r in self.addresses]:
            raise ValueError("Roster: stage_peers and addresses must name the same replicas of the same stages")
        try:
            n_routes(self.counts)
        except ValueError as e:
            raise ValueError(f"Roster: {e}") from e

    @property
    def n_stages(self) -> int:
        return len(self.stage_peers)

    @property
    def counts(self) -> tuple[int, ...]:
        """Replicas of each stage."""
        return tuple(len(r) for r in self.stage_peers)

    @property
    def n_routes(self) -> int:
        """Routes through the stages: lcm of the replica counts (with equal counts R, R routes)."""
        return n_routes(self.counts)

    @property
    def n_replicas(self) -> int:
        """The number of routes (`n_routes`; kept for callers of the equal-count roster, where it is R)."""
        return self.n_routes

    def replicas(self, stage: int) -> tuple[str, ...]:
        """Peer ids of the replicas of `stage`, in column order."""
        return self.stage_peers[stage]

    def replica_addresses(self, stage: int) -> tuple[str, ...]:
        """Addresses of the replicas of `stage`, in column order."""
        return self.addresses[stage]

    def route(self, r: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(addresses, peer ids) of route `r`: replica r % R_s of every stage s, in pipeline order."""
        if not 0 <= r < self.n_routes:
            raise IndexError(f"route {r} is not one of the plan's {self.n_routes}")
        at = route_replicas(r, self.counts)
        addresses = tuple(a[i] for a, i in zip(self.addresses, at, strict=True))
        return addresses, tuple(p[i] for p, i in zip(self.stage_peers, at, strict=True))


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
        body is read, so a stranger's stream costs nothing. A neighbour's call passes here if the caller is any
        replica of the sending stage; `check_route` then holds it to the route its call info names."""
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
            sender = _sender_stage(method, stage)
            if caller not in roster.replicas(sender):
                raise _denied(
                    f"{method} into stage {stage} only from the plan's peer of stage {sender} "
                    f"({', '.join(roster.replicas(sender))}), not {caller}"
                )

    def check_route(
        self, info: CallInfo, caller: str | None = None, method: str | None = None, own: str | None = None
    ) -> None:
        """A call's route must be the plan's route `info.chain`: a stage sends only where the plan says. With
        `caller` and `method` (a Forward or Backward from a neighbour), the caller must be that route's peer of
        the sending stage: a replica talks only to its route's replicas of its neighbours. With `own` (the
        callee's peer id), the route must name the callee at the call's stage."""
        roster = self._need_roster()
        if info.chain >= roster.n_routes:
            raise _denied(f"route {info.chain}: the plan has {roster.n_routes} routes")
        addresses, peers = roster.route(info.chain)
        if tuple(info.route) != addresses or tuple(info.route_peers) != peers:
            raise _denied(
                f"route: the call names route {list(info.route)[:8]} of peers {list(info.route_peers)[:8]}, "
                f"the plan's route {info.chain} is {list(addresses)} of peers {list(peers)}"
            )
        if own is not None and 0 <= info.stage < len(peers) and peers[info.stage] != own:
            raise _denied(f"route {info.chain}'s peer of stage {info.stage} is {peers[info.stage]}, not this peer")
        if caller is None or method not in ("Forward", "Backward"):
            return
        sender = _sender_stage(method, info.stage)
        if 0 <= sender < roster.n_stages and caller != peers[sender]:  # else: the trainer's end of the route
            raise _denied(
                f"{method} of route {info.chain} into stage {info.stage} only from its peer of stage {sender} "
                f"({peers[sender]}), not {caller}"
            )

    def check_step(self, method: str, caller: str) -> None:
        """Grads, Step (abandon included), Reduce, and the audit's Audit and Recompute (`swarm.runtime.verify`: a
        stage's records of its work, and a recomputation on a sibling's input) only from a trainer."""
        self._trainer(caller, method)

    def check_average(self, stage: int, caller: str, own: str, tied: bool | None = False) -> None:
        """Average into `stage` only from another replica of that stage, or (`tied`) between replicas of the
        first and last stage of a pipeline of 2+ (their tied group). `tied=None` (the metadata alone, before the
        call info is read) admits either; the call info's own `tied` is then checked again."""
        roster = self._need_roster()
        if stage >= roster.n_stages or caller == own:
            raise _denied(f"Average into stage {stage} only from another replica of it; {caller} is not one")
        ends = {0, roster.n_stages - 1} if roster.n_stages > 1 else set()
        in_stage = caller in roster.replicas(stage)
        in_tied = stage in ends and any(caller in roster.replicas(s) for s in ends)
        if tied is None and (in_stage or in_tied):
            return
        if tied and not in_tied:
            raise _denied(f"a tied-gradient Average only between the first and last stages' replicas; not {caller}")
        if not tied and not in_stage:
            raise _denied(f"Average into stage {stage} only from another replica of it; {caller} is not one")

    def check_audit_inputs(self, stage: int, caller: str, own: str) -> None:
        """AuditInputs (a direct audit's record inputs) of `stage` only to another replica of that stage: the
        sibling a trainer asked to recompute them."""
        roster = self._need_roster()
        if stage >= roster.n_stages or caller == own or caller not in roster.replicas(stage):
            raise _denied(f"AuditInputs of stage {stage} only to another replica of it; {caller} is not one")

    def check_group(self, request: ReduceOrder, own: str) -> None:
        """A Reduce's group: distinct replicas of the request's stage at the plan's addresses, this peer among
        them, so a trainer cannot make a stage send its gradients anywhere else."""
        roster = self._need_roster()
        if request.stage >= roster.n_stages:
            raise _denied(f"Reduce: stage {request.stage} is not in the plan's {roster.n_stages} stages")
        where = dict(zip(roster.replicas(request.stage), roster.replica_addresses(request.stage), strict=True))
        peers, addresses = list(request.group_peers), list(request.group_addresses)
        if (
            len(peers) != len(addresses)
            or len(set(peers)) != len(peers)
            or own not in peers
            or any(where.get(p) != a for p, a in zip(peers, addresses, strict=False))
        ):
            raise _denied(
                f"Reduce: the group {peers[:8]} at {addresses[:8]} is not distinct replicas of stage {request.stage} "
                f"at their plan addresses with this peer among them"
            )
        tied_peers, tied_addresses = list(request.tied_peers), list(request.tied_addresses)
        if not tied_peers and not tied_addresses:
            return
        ends = (0, roster.n_stages - 1) if roster.n_stages > 1 else ()
        plan = {p: a for s in ends for p, a in zip(roster.replicas(s), roster.replica_addresses(s), strict=True)}
        if (
            request.stage not in ends
            or len(tied_peers) != len(tied_addresses)
            or len(set(tied_peers)) != len(tied_peers)
            or own not in tied_peers
            or any(plan.get(p) != a for p, a in zip(tied_peers, tied_addresses, strict=False))
        ):
            raise _denied(
                f"Reduce: the tied group {tied_peers[:8]} at {tied_addresses[:8]} is not distinct replicas of the "
                f"first and last stage at their plan addresses with this peer among them"
            )

    def check_state(self, caller: str) -> None:
        """GetState only to the plan's peers and its named trainers (in an owned run the owner's delegates: the
        trainer referees a dispute between two replicas with the stage's weights, `swarm.runtime.referee`)."""
        roster = self._need_roster()
        if caller not in roster.plan_peers and (roster.trainers is None or caller not in roster.trainers):
            raise _denied(f"GetState only to a peer of the plan or a trainer it names; {caller} is neither")


def _sender_stage(method: str, stage: int) -> int:
    """The stage a neighbour's Forward (the previous) or Backward (the next) into `stage` comes from."""
    return stage - 1 if method == "Forward" else stage + 1


# ---- each call bound to its own fields (swarm.net.auth proofs) ---------------------------------------------------


def _unauthenticated(error: AuthError) -> CallRefused:
    return CallRefused(grpc.StatusCode.UNAUTHENTICATED, f"not authenticated: {error}")


def bind_calls(servicer: Any) -> None:
    """Makes every stage method of `servicer` check its call's proof while `servicer.verifier` is set (None:
    anonymous calls, nothing checked).

    The methods are replaced on the instance, which is what gRPC's registration and `LocalNetwork` call. A unary
    call's proof must sign its request, checked before the handler runs (refused: abort UNAUTHENTICATED). A
    client stream's token and proof format and age are checked from the metadata before the handler runs, and
    the proof against the stream's first item when the handler reads it (refused: CallRefused UNAUTHENTICATED
    from the handler's read, which it answers like its own refusals), so a stream's first item is read in the
    handler's data slot, as before, and a stranger's stream still costs nothing.
    """
    for name, method in METHODS.items():
        handler = getattr(servicer, name)
        bound = _stream_bound if method.client_streaming else _unary_bound
        setattr(servicer, name, functools.wraps(handler)(bound(servicer, handler, method_path(name))))


def _unary_bound(servicer: Any, handler, path: str):
    def call(request, context):
        verifier = servicer.verifier
        if verifier is not None:
            try:
                verifier.call(context.invocation_metadata(), path, request)
            except AuthError as e:
                context.abort(grpc.StatusCode.UNAUTHENTICATED, f"not authenticated: {e}")
        return handler(request, context)

    return call


def _stream_bound(servicer: Any, handler, path: str):
    def call(request_iterator, context):
        verifier = servicer.verifier
        if verifier is None:
            return handler(request_iterator, context)
        try:
            pending = verifier.pending(context.invocation_metadata(), path)
        except AuthError as e:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, f"not authenticated: {e}")
        return handler(_first_checked(request_iterator, pending), context)

    return call


def _first_checked(items: Iterable, pending: PendingCall) -> Iterator:
    """`items`, once the call's proof signs the first of them. Later items are not signed: `swarm.net.auth`."""
    items = iter(items)
    first = next(items, None)
    if first is None:
        return
    try:
        pending.check(first)
    except AuthError as e:
        raise _unauthenticated(e) from None
    yield first
    yield from items
