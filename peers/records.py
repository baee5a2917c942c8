"""Every record the swarm keeps in the DHT, with wire forms that are validated field by field on the way in.

Nothing read from the DHT is trusted: any peer can store anything under any key it does not own, so
`from_wire` checks the type, range and length of every field and raises `ValueError` naming the field. The
wire forms are plain dicts of msgpack primitives (str, int, float, bool, None); nothing is ever unpickled.
Construction runs the same checks, so an invalid record fails where it is made rather than on other peers.
Unknown keys in a wire dict are ignored, so that newer peers may add fields without breaking older ones.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from swarm.peers.fields import (
    MAX_LAYERS,
    MAX_PLAN_VERSION,
    fail,
    float_field,
    int_field,
    peer_id_field,
    set_field,
    str_field,
)
from swarm.peers.plan import PLAN_PRECISIONS, PlanDocument

__all__ = [
    "MAX_CLOCK_SKEW_S",
    "MAX_PLANNER_LEASE_S",
    "MAX_PLAN_BYTES",
    "MAX_SENSITIVITY",
    "LOW_PRECISIONS",
    "LinkMeasurement",
    "PeerAnnouncement",
    "PlanRecord",
    "TrainerAnnouncement",
    "elected_planner",
    "followed_plan",
    "validate_plan",
]

MAX_PLAN_BYTES = 256 * 1024
"""Largest plan accepted, as compact JSON text (a plan for a hundred peers is a few tens of KiB)."""

MAX_PLANNER_LEASE_S = 60.0
"""Longest planner lease an announcement may claim ahead of the reader's DHT time (plus MAX_CLOCK_SKEW_S)."""

_MAX_TIME_S = 1e11  # seconds since the epoch, year ~5000: anything later is garbage, not clock skew
_MAX_STAGES = 4096
_MAX_MEMORY_BYTES = 1 << 50  # 1 PiB
_MAX_LAYERS_PER_S = 1e9
_MAX_RTT_S = 3600.0
_MAX_BYTES_PER_S = 1e13  # 80 Tbit/s
_MAX_BURST_BYTES = float(1 << 30)  # a bucket deeper than 1 GiB is no measurement
MAX_CLOCK_SKEW_S = 120.0
"""How far in the future a record's own timestamp may lie (clocks of volunteers differ a little)."""

_ADDRESS_RE = re.compile(r"(?P<host>\[[0-9A-Fa-f:.]{2,45}\]|[A-Za-z0-9](?:[A-Za-z0-9.-]{0,252}))" r":(?P<port>\d{1,5})")
_DEVICE_RE = re.compile(r"[a-z][a-z0-9_]{0,15}(?::\d{1,4})?")
_CODEC_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:+-]{0,63}")
_KEY_RE = re.compile(r"[0-9a-f]{16}")


_MAX_HELD = 8
"""Held checkpoint copies an announcement may list."""


def _address(record: str, name: str, value: Any) -> str:
    what = "a gRPC address 'host:port' with a port in [1, 65535]"
    match = _ADDRESS_RE.fullmatch(value) if type(value) is str else None
    if match is None or not 1 <= int(match["port"]) <= 65535:
        raise fail(record, name, what, value)
    return value


def _from_wire(cls: type, wire: Any) -> Any:
    if not isinstance(wire, dict):
        raise ValueError(f"{cls.__name__}: expected a dict, got {type(wire).__name__}")
    kwargs = {}
    for field in dataclasses.fields(cls):
        if field.name in wire:
            kwargs[field.name] = wire[field.name]
        elif field.default is dataclasses.MISSING:
            raise ValueError(f"{cls.__name__}.{field.name}: missing")
    return cls(**kwargs)


LOW_PRECISIONS = PLAN_PRECISIONS[1:]
"""Precisions a peer may announce a speed for (`PeerAnnouncement.speeds`); fp32's is `compute_layers_per_s`."""


def _speeds(record: str, value: Any) -> tuple[tuple[str, float], ...]:
    """`speeds` from a tuple of (precision, layers/s) pairs or its wire string "bf16:31.0 fp16:12.5"."""
    what = f"at most {len(LOW_PRECISIONS)} distinct (precision in {LOW_PRECISIONS}, layers/s) pairs"
    if isinstance(value, str) and len(value) <= 64 * len(LOW_PRECISIONS):
        try:
            value = [(name, float(speed)) for name, speed in (entry.split(":") for entry in value.split())]
        except ValueError:
            raise fail(record, "speeds", what, value) from None
    if not isinstance(value, (list, tuple)) or len(value) > len(LOW_PRECISIONS):
        raise fail(record, "speeds", what, value)
    speeds = []
    for entry in value:
        if not isinstance(entry, (list, tuple)) or len(entry) != 2 or entry[0] not in LOW_PRECISIONS:
            raise fail(record, "speeds", what, entry)
        speeds.append((entry[0], float_field(record, "speeds", entry[1], 0.0, _MAX_LAYERS_PER_S)))
    if len({name for name, _ in speeds}) != len(speeds):
        raise fail(record, "speeds", what, value)
    return tuple(speeds)


MAX_SENSITIVITY = 1.0e3
"""Largest sensitivity an announcement may carry (a relative squared gradient error, `swarm.runtime.sensitivity`)."""


def _sensitivity(record: str, value: Any) -> tuple[tuple[int, int, str, float], ...]:
    """`sensitivity` from (layer_start, layer_end, precision, figure) entries or its wire string
    "0:2:bf16:0.000123 ..."; every figure finite in [0, MAX_SENSITIVITY] (a NaN or negative one is refused)."""
    what = f"at most {len(LOW_PRECISIONS)} (start, end, precision in {LOW_PRECISIONS}, figure in [0, 1e3]) entries"
    if isinstance(value, str) and len(value) <= 96 * len(LOW_PRECISIONS):
        try:
            value = [(int(a), int(b), p, float(f)) for a, b, p, f in (e.split(":") for e in value.split())]
        except ValueError:
            raise fail(record, "sensitivity", what, value) from None
    if not isinstance(value, (list, tuple)) or len(value) > len(LOW_PRECISIONS):
        raise fail(record, "sensitivity", what, value)
    entries = []
    for entry in value:
        if not isinstance(entry, (list, tuple)) or len(entry) != 4 or entry[2] not in LOW_PRECISIONS:
            raise fail(record, "sensitivity", what, entry)
        start = int_field(record, "sensitivity", entry[0], 0, MAX_LAYERS - 1)
        end = int_field(record, "sensitivity", entry[1], start + 1, MAX_LAYERS)
        figure = float_field(record, "sensitivity", entry[3], 0.0, MAX_SENSITIVITY)
        entries.append((start, end, entry[2], figure))
    if len({(a, b, p) for a, b, p, _ in entries}) != len(entries):
        raise fail(record, "sensitivity", what, value)
    return tuple(entries)


@dataclass(frozen=True)
class PeerAnnouncement:
    """What a peer can do and what it serves now, refreshed by its heartbeat until it leaves."""

    peer_id: str
    """The peer's id, derived from the public key that signs its records (see `swarm.peers.dht`)."""
    address: str
    """Where its gRPC stage service listens, 'host:port' ('[::1]:port' for IPv6)."""
    device: str
    """Torch device it computes on: 'cpu', 'cuda:0', 'mps'..."""
    memory_bytes: int
    """Memory it offers for layers, activations and message buffers, in bytes."""
    compute_layers_per_s: float
    """Measured forward+backward throughput of one reference layer on one reference micro-batch, per second."""
    stage: int | None = None
    """The pipeline stage it serves under the plan `plan_version`, or None while unassigned."""
    layer_start: int | None = None
    """First layer it holds (inclusive), or None while unassigned."""
    layer_end: int | None = None
    """Layer after the last one it holds (exclusive), or None while unassigned."""
    load: float = 0.0
    """Fraction of its compute that is busy, in [0, 1]."""
    plan_version: int = 0
    """Version of the plan its stage assignment comes from; 0 before any plan."""
    started_at: float = 0.0
    """When the peer started, in seconds since the epoch (`hivemind.utils.get_dht_time()`)."""
    codec: str | None = None
    """Name of the activation codec it speaks on its links, if fixed."""
    leaving: bool = False
    """Set on SIGTERM: the planner repairs the plan without this peer; it serves its state until taken over."""
    held: tuple[tuple[int, int, int], ...] = ()
    """Checkpoint copies it holds for other stages (`swarm.daemon.held`): (layer_start, layer_end, steps_done)."""
    planner_until: float = 0.0
    """DHT time until which it holds the planner lease (`elected_planner`); 0: it never led since it started."""
    reach: str = "direct"
    """"direct": others can dial `address`; "relay": they cannot, reach it through `relay` (swarm.net.relay)."""
    relay: str | None = None
    """Peer id of the reachable peer it keeps its Attach open to: set exactly when reach == "relay"."""
    speeds: tuple[tuple[str, float], ...] = ()
    """Measured layers/s in each precision other than fp32 its device runs, e.g. (("bf16", 31.0),);
    `compute_layers_per_s` is the fp32 figure. On the wire: "bf16:31.0 fp16:12.5"."""
    sensitivity: tuple[tuple[int, int, str, float], ...] = ()
    """Its stage's sensitivity to each low precision, measured from its real gradients while it trains
    (`swarm.runtime.sensitivity_probe`): (layer_start, layer_end, precision, figure) for the layers it was measured
    on. On the wire: "0:2:bf16:0.000123"."""
    compute_key: str = ""
    """Which hardware it computes on (`swarm.runtime.device.compute_key`): peers announcing the same key share it
    (CPU peers on one machine and CPU set), so one more of them adds no compute; "" unknown (counted as its own).
    Self-reported: a peer can only make itself look like more or less of its own hardware to the planner."""

    def __post_init__(self) -> None:
        r = type(self).__name__
        peer_id_field(r, "peer_id", self.peer_id)
        if self.compute_key != "":
            str_field(r, "compute_key", self.compute_key, _KEY_RE, "16 lowercase hex digits or ''")
        set_field(self, "speeds", _speeds(r, self.speeds))
        set_field(self, "sensitivity", _sensitivity(r, self.sensitivity))
        if type(self.leaving) is not bool:
            raise fail(r, "leaving", "a bool", self.leaving)
        if isinstance(self.held, str) and len(self.held) <= 40 * _MAX_HELD:
            try:
                set_field(self, "held", tuple(tuple(int(x) for x in h.split(":")) for h in self.held.split()))
            except ValueError:
                raise fail(r, "held", "'start:end:steps ...'", self.held[:64]) from None
        if not isinstance(self.held, (list, tuple)) or len(self.held) > _MAX_HELD:
            raise fail(r, "held", f"a list of at most {_MAX_HELD} [start, end, steps] entries", self.held)
        held = []
        for entry in self.held:
            if not isinstance(entry, (list, tuple)) or len(entry) != 3:
                raise fail(r, "held", "[layer_start, layer_end, steps_done] entries", entry)
            start = int_field(r, "held", entry[0], 0, MAX_LAYERS - 1)
            end = int_field(r, "held", entry[1], start + 1, MAX_LAYERS)
            held.append((start, end, int_field(r, "held", entry[2], 0, MAX_PLAN_VERSION)))
        set_field(self, "held", tuple(held))
        _address(r, "address", self.address)
        str_field(r, "device", self.device, _DEVICE_RE, "a device like 'cpu' or 'cuda:0'")
        int_field(r, "memory_bytes", self.memory_bytes, 0, _MAX_MEMORY_BYTES)
        set_field(
            self,
            "compute_layers_per_s",
            float_field(r, "compute_layers_per_s", self.compute_layers_per_s, 0, _MAX_LAYERS_PER_S),
        )
        if self.stage is not None:
            int_field(r, "stage", self.stage, 0, _MAX_STAGES - 1)
        if self.layer_start is not None:
            int_field(r, "layer_start", self.layer_start, 0, MAX_LAYERS - 1)
        if self.layer_end is not None:
            int_field(r, "layer_end", self.layer_end, 1, MAX_LAYERS)
        if (self.layer_start is None) != (self.layer_end is None):
            raise fail(r, "layer_end", "to be set exactly when layer_start is", self.layer_end)
        if self.layer_start is not None and self.layer_start >= self.layer_end:
            raise fail(r, "layer_end", f"an int > layer_start={self.layer_start}", self.layer_end)
        if (self.stage is None) != (self.layer_start is None):
            raise fail(r, "stage", "to be set exactly when a layer range is", self.stage)
        set_field(self, "load", float_field(r, "load", self.load, 0.0, 1.0))
        int_field(r, "plan_version", self.plan_version, 0, MAX_PLAN_VERSION)
        set_field(self, "started_at", float_field(r, "started_at", self.started_at, 0.0, _MAX_TIME_S))
        set_field(self, "planner_until", float_field(r, "planner_until", self.planner_until, 0.0, _MAX_TIME_S))
        if self.codec is not None:
            str_field(r, "codec", self.codec, _CODEC_RE, "a codec name of 1-64 characters [A-Za-z0-9_.:+-]")
        if self.reach not in ("direct", "relay"):
            raise fail(r, "reach", "'direct' or 'relay'", self.reach)
        if self.reach == "relay":
            if peer_id_field(r, "relay", self.relay) == self.peer_id:
                raise fail(r, "relay", "another peer's id (a peer cannot relay for itself)", self.relay)
        elif self.relay is not None:
            raise fail(r, "relay", "None unless reach == 'relay'", self.relay)

    @property
    def layers(self) -> range | None:
        """The layers it holds, or None while unassigned."""
        return None if self.layer_start is None else range(self.layer_start, self.layer_end)

    def to_wire(self) -> dict[str, Any]:
        # flat on the wire, like every record field: "start:end:steps start:end:steps"
        return {
            **dataclasses.asdict(self),
            "held": " ".join(":".join(map(str, h)) for h in self.held),
            "speeds": " ".join(f"{name}:{speed!r}" for name, speed in self.speeds),
            "sensitivity": " ".join(f"{a}:{b}:{p}:{f!r}" for a, b, p, f in self.sensitivity),
        }

    @classmethod
    def from_wire(cls, wire: Any) -> PeerAnnouncement:
        """Builds an announcement from untrusted wire data. Raises ValueError naming the first bad field."""
        return _from_wire(cls, wire)


@dataclass(frozen=True)
class LinkMeasurement:
    """One peer's measurement of its link to another: what the scheduler's bandwidth/latency matrix is made of."""

    src: str
    """Peer id of the measuring peer (the sender); only it may store this record."""
    dst: str
    """Peer id of the peer at the other end."""
    rtt_s: float
    """Round-trip time, in seconds."""
    bytes_per_s: float
    """Measured goodput from src to dst, in bytes per second."""
    measured_at: float
    """When it was measured, in seconds since the epoch."""
    burst_bytes: float = 0.0
    """Bytes the link passed at once after an idle spell before its rate applied (a token bucket's depth)."""

    def __post_init__(self) -> None:
        r = type(self).__name__
        peer_id_field(r, "src", self.src)
        peer_id_field(r, "dst", self.dst)
        if self.src == self.dst:
            raise fail(r, "dst", "a peer other than src", self.dst)
        set_field(self, "rtt_s", float_field(r, "rtt_s", self.rtt_s, 0.0, _MAX_RTT_S))
        set_field(self, "bytes_per_s", float_field(r, "bytes_per_s", self.bytes_per_s, 0.0, _MAX_BYTES_PER_S))
        set_field(self, "measured_at", float_field(r, "measured_at", self.measured_at, 0.0, _MAX_TIME_S))
        set_field(self, "burst_bytes", float_field(r, "burst_bytes", self.burst_bytes, 0.0, _MAX_BURST_BYTES))

    def to_wire(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, wire: Any) -> LinkMeasurement:
        """Builds a measurement from untrusted wire data. Raises ValueError naming the first bad field."""
        return _from_wire(cls, wire)


MAX_BANNED = 64
"""Most peers one trainer announcement bans (`TrainerAnnouncement.banned`)."""


@dataclass(frozen=True)
class TrainerAnnouncement:
    """A trainer's presence in the run, refreshed by its heartbeat: the planner names the announced trainers in
    the plan (`trainer_ids`), and stages serve training calls only from those."""

    peer_id: str
    """The trainer's id, derived from the public key that signs its records (as a peer's)."""
    started_at: float = 0.0
    """When the trainer started, in seconds since the epoch."""
    banned: tuple[str, ...] = ()
    """Peers this trainer evicted for lying (`swarm.runtime.suspects`): the planner plans them no more in this run
    (`swarm.daemon.bans`). At most MAX_BANNED."""

    def __post_init__(self) -> None:
        r = type(self).__name__
        peer_id_field(r, "peer_id", self.peer_id)
        set_field(self, "started_at", float_field(r, "started_at", self.started_at, 0.0, _MAX_TIME_S))
        if not isinstance(self.banned, (list, tuple)) or len(self.banned) > MAX_BANNED:
            raise fail(r, "banned", f"a list of at most {MAX_BANNED} peer ids", self.banned)
        set_field(self, "banned", tuple(peer_id_field(r, "banned", p) for p in self.banned))

    def to_wire(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, wire: Any) -> TrainerAnnouncement:
        """Builds an announcement from untrusted wire data. Raises ValueError naming the first bad field."""
        return _from_wire(cls, wire)


@dataclass(frozen=True)
class PlanRecord:
    """A versioned plan from the planner (`swarm.peers.plan.PlanDocument`). Higher versions supersede lower."""

    version: int
    """Monotonic plan version, >= 1 (peers announce 0 before they follow any plan)."""
    document: PlanDocument
    """The plan itself; given as a `PlanDocument` or its wire dict (parsed and checked here). On the wire it is
    compact JSON text under the key "plan", at most MAX_PLAN_BYTES."""
    created_at: float
    """When it was made, in seconds since the epoch."""

    def __post_init__(self) -> None:
        r = type(self).__name__
        int_field(r, "version", self.version, 1, MAX_PLAN_VERSION)
        if not isinstance(self.document, PlanDocument):
            set_field(self, "document", PlanDocument.from_wire(_parse_plan(r, _dump_plan(r, self.document))))
        # the compact JSON text `to_wire` publishes, dumped once here where its size is checked (not a field: the
        # document is the record's content, this is its cached wire form)
        set_field(self, "_text", _dump_plan(r, self.document.to_wire()))
        set_field(self, "created_at", float_field(r, "created_at", self.created_at, 0.0, _MAX_TIME_S))

    def to_wire(self) -> dict[str, Any]:
        # The plan travels as JSON text: its size is checked before it is parsed, and it can't nest msgpack types.
        return {"version": self.version, "plan": self._text, "created_at": self.created_at}

    @classmethod
    def from_wire(cls, wire: Any) -> PlanRecord:
        """Builds a plan from untrusted wire data. Raises ValueError naming the first bad field."""
        if not isinstance(wire, dict):
            raise ValueError(f"{cls.__name__}: expected a dict, got {type(wire).__name__}")
        for key in ("version", "plan", "created_at"):
            if key not in wire:
                raise ValueError(f"{cls.__name__}.{key}: missing")
        int_field(cls.__name__, "version", wire["version"], 1, MAX_PLAN_VERSION)
        document = PlanDocument.from_wire(_parse_plan(cls.__name__, wire["plan"]))
        return cls(wire["version"], document, wire["created_at"])


def _dump_plan(record: str, plan: Any) -> str:
    what = f"a JSON-able dict of at most {MAX_PLAN_BYTES} bytes"
    if not isinstance(plan, dict):
        raise fail(record, "plan", what, plan)
    try:
        text = json.dumps(plan, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError) as e:
        raise ValueError(f"{record}.plan: expected {what}: {e}") from None
    if len(text.encode()) > MAX_PLAN_BYTES:
        raise ValueError(f"{record}.plan: expected {what}, got {len(text.encode())} bytes")
    return text


def _parse_plan(record: str, text: Any) -> dict[str, Any]:
    what = f"JSON text of a dict, at most {MAX_PLAN_BYTES} bytes"
    if type(text) is not str or len(text) > MAX_PLAN_BYTES or len(text.encode()) > MAX_PLAN_BYTES:
        raise fail(record, "plan", what, text)
    try:
        plan = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{record}.plan: expected {what}: {e}") from None
    if not isinstance(plan, dict):
        raise fail(record, "plan", what, text)
    return plan


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def elected_planner(
    peers: Iterable[PeerAnnouncement], trusted: Iterable[str] = (), now: float | None = None
) -> str | None:
    """The id of the peer that plans, by a rule every peer computes the same from the announcements (no vote).

    1. If any candidate holds an unexpired planner lease (`planner_until` > `now`), the lowest id among the
       lease holders plans: the lease is sticky, so a joiner with a lower id does not depose a live planner.
    2. Else the lowest id among the candidates whose lease has not lapsed (`planner_until` == 0: never led
       since it started). A planner whose lease lapsed (it died, or stalled past its lease) is out until its
       announcement expires or a restart announces afresh, so a dead planner is replaced within one lease
       (default 3 s) rather than one announcement ttl (30 s), and a stalled one coming back does not flip it.
    3. Else (every candidate's lease lapsed) the lowest candidate id, so somebody always plans.

    Candidates: the announced peers that are not leaving, restricted to `trusted` ids when any are given.
    The elected planner renews its lease every ~lease/3 (`Planner`); a holder that is not the lowest holder
    stops renewing, so two holders (after a partition) settle on one within a lease.

    Clock: leases are DHT time (`hivemind.utils.get_dht_time`, the wall clock), as hivemind's own
    expirations are: peers' clocks are assumed to agree within a fraction of the lease. A planner whose clock
    runs ahead by X looks alive X longer to the others after it dies; readers refuse leases more than
    MAX_PLANNER_LEASE_S (+ MAX_CLOCK_SKEW_S) ahead (`swarm.peers.entries`).

    Ids are hashes of keys, so anyone can grind a key for a low id (and announce a lease): an open run is an
    owned run, whose delegated planners are the `trusted` ones (`swarm.peers.manifest`). None while no
    candidate is announced.
    """
    now = time.time() if now is None else now
    allowed = set(trusted)
    candidates = [p for p in peers if (not allowed or p.peer_id in allowed) and not p.leaving]
    holders = [p.peer_id for p in candidates if p.planner_until > now]
    fresh = [p.peer_id for p in candidates if p.planner_until == 0.0]
    return min(holders or fresh or [p.peer_id for p in candidates], default=None)


def followed_plan(
    plans: Iterable[tuple[str, PlanRecord]],
    peers: Iterable[PeerAnnouncement],
    n_layers: int | None = None,
    trusted: Iterable[str] = (),
) -> PlanRecord | None:
    """The plan a new planner inherits: of the versions the announced peers follow (`plan_version`), the one
    most of them follow (the newest on a tie), as a record that validates (`validate_plan`, trainers not
    checked) and names every follower of that version at the stage and layers it announces; whoever published
    it (only the `trusted` ids' plans when any are given). None when no followed version has such a record.

    Why this is no weaker than taking only the elected planner's plans: in an unowned run anyone can grind a
    low id, win the election and publish any plan; a record inherited here changes nothing the swarm
    does, since it is what the peers already serve (their own signed announcements say so), and it must
    validate against the announced peers. With trusted planners all of their plans count anyway.
    """
    peers = list(peers)
    allowed = set(trusted)
    follow: dict[int, list[PeerAnnouncement]] = {}
    for p in peers:
        if p.plan_version > 0:
            follow.setdefault(p.plan_version, []).append(p)
    records: dict[int, list[PlanRecord]] = {}
    for owner, record in plans:
        if (not allowed or owner in allowed) and record.version in follow:
            records.setdefault(record.version, []).append(record)
    for version in sorted(records, key=lambda v: (len(follow[v]), v), reverse=True):
        for record in sorted(records[version], key=lambda r: r.created_at):
            try:
                validate_plan(record, n_layers, peers)
            except ValueError:
                continue
            if all(_serves(record, p) for p in follow[version]):
                return record
    return None


def _serves(record: PlanRecord, ann: PeerAnnouncement) -> bool:
    """Whether `record` names `ann`'s peer where it announces it serves (a standby: nowhere in the stages)."""
    place = record.document.place_of(ann.peer_id)
    if ann.stage is None or place is None:
        return ann.stage is None and place is None
    stage = record.document.stages[place[0]]
    return place[0] == ann.stage and (stage.layer_start, stage.layer_end) == (ann.layer_start, ann.layer_end)


def validate_plan(
    record: PlanRecord,
    model_n_layers: int | None,
    peers: Iterable[PeerAnnouncement],
    trainers: Iterable[str] | None = None,
) -> None:
    """Checks a plan against the model and the announced peers before anyone follows it.

    The record's `PlanDocument` checked its own shape when it was parsed (contiguous stages from layer 0, 1 to
    MAX_PLAN_STAGES of them, no peer named twice, at most MAX_PLAN_TRAINERS distinct trainers, ...); here: the
    stages cover the model's `model_n_layers` layers, every peer they name is announced, and every trainer is
    announced when `trainers` is given.

    Args:
        record: the plan, as read from the DHT.
        model_n_layers: the model's layer count; None checks only that the stages are contiguous from 0.
        peers: the run's current announcements.
        trainers: ids of the announced trainers; None skips that check.

    Raises:
        ValueError: naming the first bad field, e.g. `plan.stages[1].layer_end`.
    """
    record.document.check_run(model_n_layers, (p.peer_id for p in peers), trainers)
