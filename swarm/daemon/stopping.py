"""How a peer ends: a stop checkpoints its own layers and exits; a leave hands its stage over first, when it can.

- A **stop** (SIGINT, or a `swarm stop` order read from the DHT by `StopWatch`) takes the stage out of service
  between two steps, writes its final checkpoint (its own layers only) and exits. Every peer of a stopping
  run does the same at once, so nothing is handed over and no peer ends up holding the whole model.
- A **leave** (SIGTERM) hands the stage over to the peers that stay (the planner repairs the plan without this
  peer, and they take its layers over) only while the run goes on and only if one of them has room for it
  (`leave_blocker`); otherwise it is a stop. A leave after the trainer is gone, or when the layers would not
  fit anywhere, would pile the model onto the last peers standing (seen: `plan 8 (was 7): serving stage 0 of 1,
  layers [0, 4)` and a 2-stage model in one checkpoint file; with a real model, out of memory at shutdown).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import CancelledError
from typing import TYPE_CHECKING

from swarm.peers.stop import StopOrder, stop_authority, stop_orders

if TYPE_CHECKING:
    from swarm.peers.dht import SwarmDHT
    from swarm.peers.records import PeerAnnouncement

__all__ = ["ACTIVE_S", "STOP_WAIT_S", "PeerEnding", "StopWatch", "leave_blocker", "room_for", "watch_stop_orders"]

log = logging.getLogger("swarm.peer")

STOP_WAIT_S = 30.0
"""Longest a stopping peer waits for the open step to end before it abandons it (rolled back, not saved)."""
ACTIVE_S = 30.0
"""A stage that has seen no call for this long is not being trained: a leave then hands nothing over."""


class StopWatch:
    """Reads the run's stop orders every `every_s` and says when one may stop this peer."""

    def __init__(
        self, dht: SwarmDHT, started_at: float, every_s: float = 2.0, clock: Callable[[], float] = time.monotonic
    ):
        """`started_at`: this peer's start (DHT time), so an order issued before it (an earlier run's) is ignored."""
        self.dht, self.started_at, self.every_s, self.clock = dht, started_at, every_s, clock
        self._next = 0.0
        self._refused: set[tuple[str, float]] = set()
        self.order: StopOrder | None = None
        """The order that stops this peer, once one did."""

    def poll(self) -> StopOrder | None:
        """The stop order for this peer, if a read is due and finds one (also once one was found); else None.
        A slow DHT read raises TimeoutError (the caller's loop tries again)."""
        if self.order is not None or self.clock() < self._next:
            return self.order
        self._next = self.clock() + self.every_s
        orders, _ = stop_orders(self.dht)
        authority = stop_authority(self.dht)
        for order in sorted(orders, key=lambda o: o.issued_at):
            if not order.issued_after(self.started_at):
                continue  # an earlier run's, still in the DHT
            try:
                authority.check(order)
            except ValueError as e:
                if (order.signer, order.issued_at) not in self._refused:
                    self._refused.add((order.signer, order.issued_at))
                    log.warning("%s", e)
                continue
            self.order = order
            return order
        return None


def room_for(
    layers: tuple[int, int], me: str, peers: Iterable[PeerAnnouncement], need: Callable[[int], float]
) -> str | None:
    """A peer that can take over `layers` from this leaving one, by what the peers announced; None: no peer can.

    A replica already serving the same layers can (nothing moves); otherwise a peer that stays (not this one,
    not leaving) whose announced memory holds what it serves now plus these layers (`need(n_layers)`: a stage
    of that many layers' bytes). A peer that announced no memory (0) is not counted on.
    """
    start, end = layers
    for p in peers:
        if p.peer_id == me or p.leaving:
            continue
        if (p.layer_start, p.layer_end) == (start, end):
            return p.peer_id
        own = 0 if p.layer_start is None or p.layer_end is None else p.layer_end - p.layer_start
        if p.memory_bytes > 0 and p.memory_bytes >= need(own + end - start):
            return p.peer_id
    return None


def leave_blocker(
    layers: tuple[int, int] | None,
    me: str,
    peers: list[PeerAnnouncement],
    need: Callable[[int], float],
    *,
    stopping: bool,
    trainers: int,
    active: bool,
) -> str | None:
    """Why a leaving peer must not hand its stage over (it checkpoints and stops instead); None: hand it over.

    Args:
        layers: the layers it serves (None: none, nothing to hand over).
        me: its peer id.
        peers: the run's announced peers.
        need: bytes a stage of n layers needs (`ModelSpec.stage_memory_bytes` for the plan's shape).
        stopping: whether a stop order for the run was seen.
        trainers: how many trainers the run announces (the ones it accepts).
        active: whether this stage saw a call in the last ACTIVE_S seconds (or has one in flight).
    """
    if layers is None:
        return "it serves no stage"
    if stopping:
        return "the run is stopping"
    if trainers == 0:
        return "no trainer is announced: the run is not training"
    if not active:
        return f"this stage saw no call for {ACTIVE_S:.0f} s: the run is not training"
    if room_for(layers, me, peers, need) is None:
        gib = need(layers[1] - layers[0]) / 2**30
        return f"no peer that stays has room for layers [{layers[0]}, {layers[1]}) ({gib:.2f} GiB more)"
    return None


class PeerEnding:
    """A serving peer's way out: whether a stop order came, whether a leave may hand its stage over, and the
    stop itself (out of service between two steps, then the final checkpoint)."""

    def __init__(self, cfg, dht: SwarmDHT, servicer, checkpoints, stop: threading.Event, started_at: float):
        """`cfg`: the peer's `PeerConfig`; `servicer`: its `StageServicer`; `checkpoints`: its `StageCheckpoints`;
        `stop`: the event its loops end on; `started_at`: its announcement's start (DHT time)."""
        self.cfg, self.dht, self.servicer, self.checkpoints, self.stop = cfg, dht, servicer, checkpoints, stop
        self.watch = StopWatch(dht, started_at)

    def ordered(self) -> bool:
        """Whether a `swarm stop` order for this peer was read (it sets the stop); reads at most every 2 s."""
        if self.watch.order is not None:
            return True
        try:
            order = self.watch.poll()
        except TimeoutError as e:  # a slow DHT read: read again next tick
            log.debug("reading stop orders: %s", e)
            return False
        if order is not None:
            why = f": {order.reason}" if order.reason else ""
            log.info("stop ordered by %s%s; checkpointing and exiting", order.signer, why)
            self.stop.set()
        return order is not None

    def leave_blocker(self, held, peers: list[PeerAnnouncement], spec) -> str | None:
        """Why this leaving peer must not hand over the stage `held` serves (`leave_blocker`); None: it may.
        `spec`: the run's `ModelSpec`, whose stage memory a taker must hold."""
        layers = None if held is None else (held.role.layer_start, held.role.layer_end)
        n_stages = held.role.n_stages if held is not None else 1
        try:
            trainers = len(self.dht.trainers())
        except TimeoutError:
            trainers = 0  # unknown: handing over to a run that may not go on risks the pile-up
        return leave_blocker(
            layers, self.dht.peer_id, peers, lambda n: spec.stage_memory_bytes(n, n_stages, 1),
            stopping=self.watch.order is not None,
            trainers=trainers,
            active=held is not None and not held.ledger.orphaned(ACTIVE_S),
        )  # fmt: skip

    def taker(self, held, peers: list[PeerAnnouncement], spec) -> str | None:
        """The peer that can take over the stage `held` serves now (`room_for`); None: none is left (the one that
        had room is leaving too, or gone)."""
        layers = (held.role.layer_start, held.role.layer_end)
        n_stages = held.role.n_stages
        return room_for(layers, self.dht.peer_id, peers, lambda n: spec.stage_memory_bytes(n, n_stages, 1))

    def retire(self):
        """Takes the stage out of service between two steps (an open step is waited for at most STOP_WAIT_S, then
        abandoned: it rolls back, so the checkpoint holds applied steps only); returns the host it served."""
        host = self.servicer.host
        if host is None:
            return None
        log.info("stopping: stage %d leaves service after the open step, if any", host.role.stage)

        def retire(servicer) -> None:
            servicer.previous, servicer.host = servicer.host, None  # calls from now on: "not serving"

        self.servicer.when_idle(retire, STOP_WAIT_S)
        return host

    def save_final(self, host) -> None:
        """The stage's final checkpoint (its own layers), or a warning that its weights are not kept."""
        role = host.role
        if not self.cfg.checkpoint_dir:
            log.warning(
                "no --checkpoint-dir: layers [%d, %d) at step %d are not saved", role.layer_start, role.layer_end,
                host.steps_done,
            )  # fmt: skip
            return
        self.checkpoints.save(host, final=True)


def watch_stop_orders(dht: SwarmDHT, stop: threading.Event, say: Callable[[str], None], every_s: float = 2.0):
    """For a trainer: a daemon thread that sets `stop` (the trainer stops after its current step) once a stop
    order for the run, issued after now, may stop it; it ends with `stop` or the DHT node."""
    from hivemind.utils import get_dht_time

    watch = StopWatch(dht, get_dht_time(), every_s)

    def run() -> None:
        while not stop.wait(every_s):
            try:
                order = watch.poll()
            except TimeoutError:
                continue
            except (RuntimeError, CancelledError):  # the DHT node is shut down (its pending reads are cancelled):
                return  # the trainer is ending anyway
            if order is not None:
                why = f" ({order.reason})" if order.reason else ""
                say(f"stop ordered by {order.signer}{why}: stopping after the current step")
                stop.set()

    thread = threading.Thread(target=run, name="swarm-stop-watch", daemon=True)
    thread.start()
    return thread
