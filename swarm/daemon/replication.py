"""What a peer does about churn: keeps a copy of its buddy stage, serves held copies, finds the freshest copy
of a stage to take over, and knows when a graceful leave is done.

The I/O (GetState and Status over the peer's signed channels) is kept apart from the choices, which are pure
functions of announcements and plans (`swarm.daemon.held`), unit-tested without processes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import grpc

from swarm.daemon.held import HeldStore, buddy_of, parse_held_layers
from swarm.peers.records import PeerAnnouncement, PlanRecord

__all__ = [
    "COPY_LINK_SHARE", "COPY_REST_FACTOR", "HOLDER_PING_TIMEOUTS", "HeldServer", "Replicator", "copy_rate",
    "copy_timeout_s", "leave_done", "patient_ping", "served_by_replicas", "takeover_sources",
]  # fmt: skip

log = logging.getLogger("swarm.daemon.replication")


class HeldServer:
    """`StageServicer.held_state`: GetState for a held copy, by layer range, one transfer at a time.

    Authorization is the servicer's (`check_state`: a peer of the plan) before this runs; this bounds the
    rest: the metadata value (16 characters, a layer range of this model), one held transfer at a time
    (RESOURCE_EXHAUSTED past it), NOT_FOUND for a range it does not hold.
    """

    def __init__(self, store: HeldStore, n_layers: int):
        self.store, self.n_layers = store, n_layers
        self._slot = threading.Semaphore(1)

    def __call__(self, context: grpc.ServicerContext, chunk_bytes: int | None = None):
        try:
            wanted = parse_held_layers(context.invocation_metadata() or (), self.n_layers)
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if wanted is None:
            return None
        if not self._slot.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "a held copy is being sent already")
        try:
            tensors = self.store.load(*wanted)
        except Exception as e:
            self._slot.release()
            context.abort(grpc.StatusCode.NOT_FOUND, f"held copy of layers [{wanted[0]}, {wanted[1]}) unreadable: {e}")
        if tensors is None:
            self._slot.release()
            context.abort(grpc.StatusCode.NOT_FOUND, f"no held copy of layers [{wanted[0]}, {wanted[1]})")
        return self._stream(tensors, chunk_bytes)

    def _stream(self, tensors, chunk_bytes: int | None):
        from swarm.compression.framing import DEFAULT_CHUNK_BYTES
        from swarm.runtime.service import named_state_items

        try:
            yield from named_state_items(tensors, chunk_bytes or DEFAULT_CHUNK_BYTES)
        finally:
            self._slot.release()


COPY_LINK_SHARE = 0.25
"""The share of the holder's measured link to this peer that a background copy of its stage is sent at. Unpaced,
a copy of the default model's stage (5 MB with its AdamW moments) held a 1 Mbit/s link for about a minute: the
run's calls and the DHT's packets queued behind it in the link's FIFO, the planner's lease renewals and pings
went unanswered, and the planner planned the live stage 0 away (docs/reports/throttled.md)."""

COPY_REST_FACTOR = 3.0
"""After a copy that took T seconds, the next one starts no sooner than `COPY_REST_FACTOR * T` later: with the
pace above, copies take at most about 6% of a slow link over time, whatever --replicate-every says."""


def copy_rate(links, holder: str | None, me: str, share: float = COPY_LINK_SHARE) -> float:
    """Bytes/s to ask a holder to send its stage at (`StateRequest.max_bytes_per_s`): `share` of its measured link
    to this peer (the slower direction where both were measured, either where one was), no lower than the holder
    would send (`STATE_MIN_BYTES_PER_S`: a measurement that lies low cannot stretch the copy's deadline); 0
    (unpaced) where none was, or the holder is not known by address."""
    from swarm.peers.shaper import STATE_MIN_BYTES_PER_S

    if holder is None:
        return 0.0
    rates = [m.bytes_per_s for m in links if {m.src, m.dst} == {holder, me} and m.bytes_per_s > 0]
    return max(share * min(rates), STATE_MIN_BYTES_PER_S) if rates else 0.0


COPY_MAX_TIMEOUT_S = 3600.0
"""The longest a paced copy may take before it is given up (the next due copy tries again)."""


def copy_timeout_s(state_bytes: int, rate: float, floor_s: float = 120.0) -> float:
    """A copy's deadline: `floor_s`, or twice what `state_bytes` take at a paced `rate`, plus a minute, at most
    `COPY_MAX_TIMEOUT_S`."""
    return floor_s if rate <= 0 else min(COPY_MAX_TIMEOUT_S, max(floor_s, 2 * state_bytes / rate + 60.0))


class Replicator:
    """Pulls the buddy stage's state every `every_steps` of its steps into the held store (in a thread, one
    pull at a time, so the peer's loop never waits on a transfer); `tick()` from the peer's loop. A pull that
    took T seconds rests the next for `COPY_REST_FACTOR * T` (on a slow link copies stay a small share of it)."""

    def __init__(
        self,
        peer_id: str,
        store: HeldStore,
        every_steps: int,
        status: Callable[[str], int | None],
        fetch: Callable[[str, int, int], dict],
        poll_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        """`status(address)` -> the holder's steps_done (None: unreachable); `fetch(address, stage, version)`
        -> its GetState tensors."""
        self.peer_id, self.store, self.every_steps = peer_id, store, every_steps
        self.status, self.fetch, self.poll_s, self.clock = status, fetch, poll_s, clock
        self._next = 0.0
        self._busy = threading.Lock()
        self._closed = threading.Event()
        self._call_lock = threading.Lock()
        self._call = None
        """the in-flight pull's gRPC call (`track`), cancelled by `close`"""
        self.pulled: dict[tuple[int, int], int] = {(s, e): n for s, e, n in store.held()}
        self.on_pulled: Callable[[], None] = lambda: None

    def due(self, plan: PlanRecord, peers: list[PeerAnnouncement]) -> tuple[str, int, int, int] | None:
        """(address, stage, start, end) of the buddy stage if a pull is due, else None. Never for a stage the plan
        gives two or more replicas: each replica already holds the others' state bit for bit, which is what
        DESIGN's failure model asks (a stage survives the loss of any one peer), and a held copy of it cost the
        churn experiment's no-churn setting 462 MB, three times every byte its steps sent (s56)."""
        buddy = buddy_of(plan.document, self.peer_id)
        if buddy is None:
            return None
        stage, holder = buddy
        if len(plan.document.stages[stage].peer_ids) > 1:
            return None  # its replicas hold each other's state: a third copy is bytes no single loss needs
        address = next((p.address for p in peers if p.peer_id == holder), None)
        if address is None:
            return None
        spec = plan.document.stages[stage]
        start, end = spec.layer_start, spec.layer_end
        steps = self.status(address)
        if steps is None or steps < self.pulled.get((start, end), 0) + self.every_steps:
            return None
        return address, stage, start, end

    def tick(self, plan: PlanRecord | None, peers: list[PeerAnnouncement]) -> bool:
        """Starts a pull if one is due (at most one status check per `poll_s`); returns whether it started."""
        now = self.clock()
        if plan is None or now < self._next or self._busy.locked() or self._closed.is_set():
            return False
        self._next = now + self.poll_s
        due = self.due(plan, peers)
        if due is None:
            return False
        self._busy.acquire()
        threading.Thread(target=self._pull, args=(plan.version, *due), daemon=True, name="replicate").start()
        return True

    def _pull(self, version: int, address: str, stage: int, start: int, end: int) -> None:
        began = self.clock()
        try:
            tensors = self.fetch(address, stage, version)
            if self.store.save(start, end, tensors, version):
                self.pulled[(start, end)] = int(tensors["meta.steps_done"].max()) if "meta.steps_done" in tensors else 0
                log.info("holding a copy of layers [%d, %d) at step %d", start, end, self.pulled[(start, end)])
                self.on_pulled()
        except Exception as e:  # a copy is best effort: the next due pull tries again
            log.info("copy of layers [%d, %d) from %s failed: %s", start, end, address, e)
        finally:
            with self._call_lock:
                self._call = None
            ended = self.clock()
            self._next = max(self._next, ended + COPY_REST_FACTOR * (ended - began))
            self._busy.release()

    def track(self, call) -> None:
        """Called by `fetch` with its gRPC call, so that `close` can cancel it (at once if already closed)."""
        with self._call_lock:
            self._call = call
        if self._closed.is_set():
            call.cancel()

    def close(self, timeout_s: float = 5.0) -> bool:
        """No pull starts any more; an in-flight one is cancelled and waited for, at most `timeout_s` (True: none
        left). A peer calls it before it exits: a pull thread still inside gRPC when the interpreter shuts down
        aborted the process ("terminate called without an active exception", exit -6, seen on a demo's peer that
        stopped during a copy)."""
        self._closed.set()
        with self._call_lock:
            call = self._call
        if call is not None:
            call.cancel()
        if not self._busy.acquire(timeout=timeout_s):
            log.warning("a copy of the buddy stage was still running %.0f s after it was cancelled", timeout_s)
            return False
        self._busy.release()
        return True


def takeover_sources(
    old: PlanRecord, stage: int, peers: list[PeerAnnouncement], me: str
) -> tuple[list[str], list[tuple[str, int]]]:
    """Where the state of `old`'s stage `stage` may come from, in order of preference.

    Returns:
        (replica peer ids: this peer first, then the stage's other replicas still announced; held copies:
        (peer id, steps_done) of announced peers holding that layer range, freshest first).
    """
    spec = old.document.stages[stage]
    start, end = spec.layer_start, spec.layer_end
    announced = {p.peer_id for p in peers}
    replicas = [p for p in spec.peer_ids if p == me or p in announced]
    replicas.sort(key=lambda p: p != me)
    held = [(p.peer_id, n) for p in peers for s, e, n in p.held if (s, e) == (start, end) and p.peer_id != me]
    held.sort(key=lambda c: (-c[1], c[0]))
    return replicas, held


HOLDER_PING_TIMEOUTS = (1.0, 2.0, 4.0, 8.0)
"""The pings a holder of a stage's state gets before a peer taking the stage over counts it gone, each deadline
twice the last. Silence is not death: over a saturated slow link a live holder's answer waits behind its tensor
bytes (seen at 1 Mbit/s under tc: a holder missed one 1 s ping, was dropped, and the taker started half the model
from its initial weights at step 20, the only copy sitting on a live standby). A killed holder refuses the
connection at once, so this costs time only for one that hangs, 15 s at most."""


def patient_ping(make_ping: Callable[[float], Callable[[str], bool]], timeouts=HOLDER_PING_TIMEOUTS):
    """A ping that asks again with each longer deadline of `timeouts` until the peer answers: `make_ping(t)` is a
    ping with deadline `t` (e.g. `swarm.daemon.liveness.status_prober`'s)."""
    pings = [make_ping(t) for t in timeouts]

    def ping(peer_id: str) -> bool:
        for i, one in enumerate(pings):
            if one(peer_id):
                if i:
                    log.info("holder %s answered after %d silent pings (deadline %.0f s)", peer_id, i, timeouts[i])
                return True
        return False

    return ping


def most_advanced(holders: list[str], steps: dict[str, int | None], me: str) -> list[str]:
    """`holders` (in their order) without the replicas that applied fewer steps than another holder: their state
    is stale (they sat out steps, or took a stale copy themselves), and copying it would start the taker behind
    its replicas, which then diverge (seen under load: a replica one step behind copied a standby's state three
    steps older than its own). `steps`: each other holder's applied steps (None: not known, kept); `me`, this
    peer's own host, stays: it is offered only when it is not behind."""
    best = max((n for h, n in steps.items() if h != me and n is not None), default=None)
    return [h for h in holders if h == me or best is None or steps.get(h) is None or steps[h] >= best]


def served_by_replicas(record: PlanRecord, stage: int, peers: list[PeerAnnouncement], me: str) -> bool:
    """Whether another peer `record` gives `stage` (a replica, of any index) already serves those layers (as
    announced, under any plan): then a peer that joins the stage with no older plan to take it over from
    (its first plan names it) copies their state, instead of serving initial weights beside trained ones.
    False in a fresh swarm, where nobody serves yet."""
    spec = record.document.stages[stage]
    layers = (spec.layer_start, spec.layer_end)
    others = set(spec.peer_ids) - {me}
    return any(p.peer_id in others and (p.layer_start, p.layer_end) == layers for p in peers)


def leave_done(plan: PlanRecord | None, peers: list[PeerAnnouncement], me: str, my_layers: tuple[int, int]) -> bool:
    """Whether a leaving peer's layers are served without it: `plan` no longer names it, and every peer that
    `plan` gives an overlapping stage announces that it follows `plan` (it has taken its state over). Also
    when no other peer stays (all leave at once, as when a whole local swarm stops): nobody to hand over to."""
    if not any(p.peer_id != me and not p.leaving for p in peers):
        return True
    if plan is None or me in plan.document.used_peers():
        return False
    following = {p.peer_id for p in peers if p.plan_version >= plan.version and p.stage is not None}
    start, end = my_layers
    for spec in plan.document.stages:
        overlaps = spec.layer_start < end and start < spec.layer_end
        if overlaps and not all(p in following for p in spec.peer_ids):
            return False
    return True
