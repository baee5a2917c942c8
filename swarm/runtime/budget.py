"""What one stage spends on its callers at most: the bounds every resource is held to, from the run's config.

Every stage port is reachable by strangers, and even a caller the plan names may misbehave, so nothing a call
asks for is granted beyond these bounds: rows per micro-batch and micro-batches per step (hence the size of
every message and of the label table), how long a call may hold a schedule turn, how many data streams are
read at once and by whom, how long a stream may take to arrive, how long an open step may sit idle, and what link
probes may cost. A call past a bound is refused by name (`BudgetError`, RESOURCE_EXHAUSTED or INVALID_ARGUMENT)
before it changes any state.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import grpc

from swarm.compression import WireLimits
from swarm.net.stream import CallRefused, ReadTimeouts
from swarm.runtime.messages import CallInfo

__all__ = ["MAX_STEP", "CallSlots", "CallerSlots", "SlotsExhausted", "StageBudget"]

MAX_STEP = 1 << 53
"""Step numbers stay below this (exact as floats in every metric and log)."""


@dataclass(frozen=True)
class StageBudget:
    """Bounds on what one stage gives its callers. The defaults fit every run this project makes (micro-batches
    of up to 256 samples, up to 16 per step); a run with bigger ones raises them on every peer.

    A step's micro-batches arrive at once (each waits for its turn on a thread), so `data_calls` must exceed
    `max_micro_batches`: a few slots more for the backward calls that overlap them."""

    max_batch: int = 256
    """most samples in one micro-batch (rows of an activation, a gradient, a token or label batch)"""
    max_micro_batches: int = 16
    """most micro-batches of one step (the schedule's length and the label table's size follow)"""
    max_wait_s: float = 120.0
    """longest a call may wait for its schedule turn or its downstream call, whatever deadline_s it asks for"""
    stale_step_s: float = 60.0
    """an open step that saw no call for this long, with none in flight, closes itself when another arrives"""
    orphan_step_s: float = 5.0
    """a plan change waits for the open step to end, unless it saw no call for this long with none in flight
    (its trainer or a stage of the old plan is gone): then the step is abandoned at once"""
    data_calls: int = 24
    """Forward/Backward/PutLabels/GetState calls served at once; more are refused at once, so the server's
    other threads stay free for control calls (Status, Probe, Grads, Step)"""
    caller_data_calls: int = 0
    """most data calls one caller (an authenticated peer id) holds at once; 0: `max_micro_batches` + 4, what a
    trainer sending a whole step at once needs (at most `data_calls`)"""
    reserved_data_calls: int = 2
    """data slots held back for each plan peer that may send data to this stage (the neighbouring stages'
    replicas, this stage's other replicas, the named trainers at an end stage) while it holds fewer: whoever else
    holds slots, each of them finds this many (together at most `data_calls` minus one caller's cap)"""
    min_link_rate_bytes_per_s: float = 125_000.0
    """the slowest link a caller may stream over (1 Mbit/s): read deadlines give every item and message the
    wire limits admit the time it takes at this rate"""
    item_timeout_s: float = 10.0
    """a stream's next item arrives within this, plus the largest chunk's bytes at `min_link_rate_bytes_per_s`,
    or the call is cancelled and its slot freed (the server's own waits, for a large-stream slot, do not count)"""
    read_timeout_s: float = 30.0
    """a whole stream arrives within this, plus its declared body's bytes at `min_link_rate_bytes_per_s`"""
    large_streams: int = 4
    """data streams larger than `large_stream_bytes` read and decoded at once (each is held in memory whole;
    another waits for a slot, at most `max_wait_s`); one caller holds at most half of them, and each plan peer
    that may send data finds one while it holds none (`CallerSlots`), so one sender cannot take them all"""
    large_stream_bytes: int = 1 << 20
    """a stream whose frame header declares more body bytes than this takes a large-stream slot"""
    probe_calls: int = 2
    """link probes (Sink) read at once"""
    state_calls: int = 4
    """GetState streams served at once (each holds a copy of the stage's weights and optimizer state in memory
    while it is sent); another waits for a slot, at most `state_wait_s`"""
    caller_state_calls: int = 1
    """GetState streams one caller holds at once: a peer taking a stage over, a replicator or a refereeing trainer
    needs one; a second waits its turn, so no caller multiplies the stage's state in memory"""
    state_wait_s: float = 10.0
    """longest a GetState waits for a state slot before it is refused RESOURCE_EXHAUSTED (the caller retries)"""
    max_probe_reply_bytes: int = 64 << 10
    """most bytes a Probe may ask to receive (a link's rate is measured with Sink, not Probe)"""
    max_sink_bytes: int = 4 << 20
    """most bytes of one Sink stream (the probes send 256 KiB by default)"""

    def __post_init__(self) -> None:
        for name in (
            "max_batch", "max_micro_batches", "data_calls", "large_streams", "probe_calls", "state_calls",
            "caller_state_calls",
        ):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"StageBudget.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("caller_data_calls", "reserved_data_calls"):
            if getattr(self, name) < 0:
                raise ValueError(f"StageBudget.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("max_wait_s", "stale_step_s", "orphan_step_s", "min_link_rate_bytes_per_s", "state_wait_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"StageBudget.{name} must be > 0, got {getattr(self, name)}")
        for name in ("item_timeout_s", "read_timeout_s"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ValueError(f"StageBudget.{name} must be a finite number > 0, got {getattr(self, name)}")

    @property
    def caller_cap(self) -> int:
        """Data calls one caller may hold at once (`caller_data_calls`, its default filled in)."""
        return min(self.data_calls, self.caller_data_calls or self.max_micro_batches + 4)

    @property
    def caller_large_streams(self) -> int:
        """Large-stream slots one caller may hold at once: half of them (at least one)."""
        return max(1, self.large_streams // 2)

    def read_timeouts(self) -> ReadTimeouts:
        """The deadlines a data stream is read under (`swarm.net.stream.read_stream`)."""
        return ReadTimeouts(self.item_timeout_s, self.read_timeout_s, self.min_link_rate_bytes_per_s)

    def check_info(self, info: CallInfo) -> None:
        """Refuses call info past these bounds (INVALID_ARGUMENT naming the field); changes nothing."""
        n_micro = info.num_micro_batches or 1
        problem = None
        if info.step >= MAX_STEP:
            problem = f"step: {info.step} is not below {MAX_STEP}"
        elif not 0.0 <= info.loss_weight <= 1.0:  # NaN fails too
            problem = f"loss_weight: {info.loss_weight} is outside 0..1"
        elif not 1 <= n_micro <= self.max_micro_batches:
            problem = f"num_micro_batches: {info.num_micro_batches} is outside 1..{self.max_micro_batches}"
        elif info.micro_batch >= n_micro:
            problem = f"micro_batch: {info.micro_batch} is not below num_micro_batches={n_micro}"
        else:
            problem = self._stage_micro_problem(info)
        if problem is not None:
            raise CallRefused(grpc.StatusCode.INVALID_ARGUMENT, problem)

    def _stage_micro_problem(self, info: CallInfo) -> str | None:
        """`stage_micro` / `stage_micro_count` (uneven replica counts): both empty, or one entry per stage of
        the route, each index below its count and each count within 1..max_micro_batches."""
        index, count = list(info.stage_micro), list(info.stage_micro_count)
        if not index and not count:
            return None
        if len(index) != len(info.route) or len(count) != len(info.route):
            return f"stage_micro: {len(index)} indices and {len(count)} counts for a route of {len(info.route)} stages"
        for s, (i, n) in enumerate(zip(index, count, strict=True)):
            if not 1 <= n <= self.max_micro_batches:
                return f"stage_micro_count[{s}]: {n} is outside 1..{self.max_micro_batches}"
            if i >= n:
                return f"stage_micro[{s}]: {i} is not below stage_micro_count[{s}]={n}"
        return None

    def wire_limits(self, model) -> WireLimits:
        """Bounds on every tensor message a stage of `model` (an `AnyModelConfig`) receives: the largest is an
        fp32 activation of a full micro-batch, or the tied embedding's gradient (models that tie it)."""
        tied = model.vocab_size * model.hidden_dim if model.tied_embeddings else 0
        numel = max(self.max_batch * model.seq_len_tokens * model.hidden_dim, tied)
        return WireLimits(max_dims=3, max_numel=numel, max_message_bytes=4 * numel + (1 << 20))

    def sink_limits(self) -> WireLimits:
        return WireLimits(max_numel=self.max_sink_bytes // 2, max_message_bytes=self.max_sink_bytes)


class SlotsExhausted(RuntimeError):
    """Every slot of a kind of call is taken: the call is refused at once instead of queued."""


class CallSlots:
    """At most `n` calls of one kind at once. `take()` does not wait unless told to, so a flood of calls cannot
    park the server's threads."""

    def __init__(self, n: int, what: str):
        self.n, self.what = n, what
        self._free = threading.BoundedSemaphore(n)

    @contextmanager
    def take(self, wait_s: float = 0.0):
        """Holds a slot for the body; raises SlotsExhausted if none frees up within `wait_s` (0: none free now)."""
        acquired = self._free.acquire(timeout=wait_s) if wait_s > 0 else self._free.acquire(blocking=False)
        if not acquired:
            raise SlotsExhausted(f"{self.n} {self.what} calls are being served already; retry later")
        try:
            yield
        finally:
            self._free.release()


class CallerSlots:
    """At most `n` calls of one kind at once, at most `per_caller` of them from one caller, and `reserved` slots
    held back for each of the callers the plan names (`named`) that holds fewer: a caller that fills its share
    cannot take the last slots from the plan's other peers. `take()` waits only when told to (`wait_s`).

    The reserve owed to the named callers counts at most `n - per_caller` slots, so a caller alone can always
    reach its cap. Calls without a caller (authentication off) share the `n` slots alone."""

    def __init__(self, n: int, what: str, per_caller: int, reserved: int = 0):
        self.n, self.what, self.per_caller, self.reserved = n, what, min(per_caller, n), reserved
        self._lock = threading.Condition()
        self._held: dict[str | None, int] = {}
        self._total = 0

    def held(self, caller: str | None) -> int:
        """Slots `caller` holds now."""
        return self._held.get(caller, 0)

    def _refusal(self, caller: str | None, named: frozenset[str]) -> str | None:
        free = self.n - self._total
        if free < 1:
            return f"{self.n} {self.what} calls are being served already; retry later"
        if caller is None:
            return None
        mine = self._held.get(caller, 0)
        if mine >= self.per_caller:
            return f"{caller} holds {mine} {self.what} calls already, its share of {self.n}; retry later"
        if mine < self.reserved and caller in named:
            return None  # its reserve
        owed = sum(max(0, self.reserved - self._held.get(p, 0)) for p in named if p != caller)
        owed = min(owed, self.n - self.per_caller)
        if free - 1 < owed:
            return (
                f"the last {free} of {self.n} {self.what} slots are held back for the plan's other peers "
                f"({caller} holds {mine}); retry later"
            )
        return None

    @contextmanager
    def take(self, caller: str | None = None, named: frozenset[str] = frozenset(), wait_s: float = 0.0):
        """Holds a slot for `caller` for the body; raises SlotsExhausted naming the rule if it may not take one
        within `wait_s` (0: now)."""
        deadline = time.monotonic() + wait_s
        with self._lock:
            while (problem := self._refusal(caller, named)) is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SlotsExhausted(problem)
                self._lock.wait(left)  # a slot given back notifies
            self._held[caller] = self._held.get(caller, 0) + 1
            self._total += 1
        try:
            yield
        finally:
            with self._lock:
                self._total -= 1
                left = self._held[caller] - 1
                if left:
                    self._held[caller] = left
                else:
                    del self._held[caller]
                self._lock.notify_all()
