"""The published plan: one typed, validated document that every peer and trainer follows.

A plan names the stages (their layers and replicas' peer ids), the peers it leaves on standby and the trainers it
serves, and optionally each boundary's codecs, the epilogue's codecs (selective compression), each stage's
precision (QSync), the frozen prefix (PipeTransformer), what its relayed links add to the step, and the
scheduler's figures (predicted step, its breakdown, the peers' measured clocks). `PlanDocument.from_wire` parses
and checks the DHT's dict once, raising ValueError naming the field (`plan.stages[1].layer_end`); everything
after it reads typed fields and methods, never keys. `to_wire` gives the same dict back.

Only checks that need the run (the model's layer count, the announced peers and trainers) are left to
`swarm.peers.records.validate_plan`. Unknown keys are ignored, so newer planners may add fields.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from swarm.compression import CodecConfig
from swarm.peers.fields import MAX_LAYERS, MAX_PLAN_VERSION, fail, int_field, peer_id_field, set_field
from swarm.peers.plan_codecs import EpilogueCodecs, LinkCodecs
from swarm.peers.routes import MAX_ROUTES, PlanRoutes, fits

__all__ = [
    "MAX_PLAN_PEERS",
    "MAX_PLAN_STAGES",
    "MAX_PLAN_TRAINERS",
    "MAX_RELAY_EXTRA_S",
    "PLAN_PRECISIONS",
    "PlanDocument",
    "PlanStage",
]

MAX_PLAN_STAGES = 256
"""Most stages a plan may have."""
MAX_PLAN_TRAINERS = 16
"""Most trainers a plan may name."""
MAX_PLAN_PEERS = 4096
"""Most peers a stage's replicas, or the standbys, may list."""
PLAN_PRECISIONS = ("fp32", "bf16", "fp16")
"""What a plan's `precisions` may name (`swarm.runtime.precision.PRECISIONS`)."""
MAX_RELAY_EXTRA_S = 1e6
"""Largest `relay_extra_s` a plan may carry (a plan through a relay that cannot carry its links prices at it)."""
_MAX_NAME = 64  # a figure's name, the plan's cost model
_MAX_FIGURES = 64  # named figures in a breakdown or one peer's measurement
_MAX_BW_EPILOGUE = 1024  # characters of `bw_epilogue`: a codec label and a tail per boundary
_MAX_MICRO = 1 << 16  # micro-batches a `bw_epilogue` was derived for
_P = "plan"
_WIRE_FIELDS = {
    "format": "format",
    "version": "version",
    "cost_model": "cost_model",
    "step_time_s": "step_time_s",
    "breakdown": "breakdown",
    "stages": "stages",
    "unused_peer_ids": "unused_peer_ids",
    "frozen_layers": "frozen_layers",
    "codecs": "codecs",
    "epilogue_codecs": "epilogue",
    "bw_epilogue": "bw_epilogue",
    "precisions": "precisions",
    "probe_sensitivity": "probe_sensitivity",
    "relay_extra_s": "relay_extra_s",
    "trainer_ids": "trainer_ids",
    "measured": "measured",
    "first_step_time_s": "first_step_time_s",
}
"""Each wire key's field, in the planner's order of a new plan's keys (`PlanDocument.key_order`)."""


def _number(r: str, key: str, value: Any) -> float | int | None:
    """A figure the scheduler wrote: a finite number (int or float, kept as given so the wire form round-trips)."""
    if value is not None and (type(value) not in (int, float) or not math.isfinite(value)):
        raise fail(r, key, "a finite number", value)
    return value


def _name(r: str, key: str, value: Any) -> str | None:
    if value is not None and (type(value) is not str or len(value) > _MAX_NAME):
        raise fail(r, key, f"text of at most {_MAX_NAME} characters", value)
    return value


def _figures(r: str, key: str, value: Any) -> tuple[tuple[str, float | int], ...]:
    """A dict of at most _MAX_FIGURES named finite numbers, as (name, value) pairs in its order."""
    if not isinstance(value, Mapping) or len(value) > _MAX_FIGURES:
        raise fail(r, key, f"a dict of at most {_MAX_FIGURES} named numbers", value)
    for name, number in value.items():
        _name(f"{r}.{key}", "name", name)
        _number(f"{r}.{key}", str(name), number)
    return tuple(value.items())


def _figure_pairs(r: str, key: str, value: Any) -> tuple[tuple[str, float | int], ...]:
    """`_figures` of (name, number) pairs, as the document keeps them."""
    if type(value) not in (list, tuple) or any(type(pair) is not tuple or len(pair) != 2 for pair in value):
        raise fail(r, key, f"at most {_MAX_FIGURES} (name, number) pairs", value)
    figures = dict(value)
    if len(figures) != len(value):
        raise fail(r, key, "distinct names", [name for name, _ in value])
    return _figures(r, key, figures)


def _ids(r: str, key: str, value: Any, lo: int, hi: int, what: str) -> tuple[str, ...]:
    if type(value) not in (list, tuple) or not lo <= len(value) <= hi:
        raise fail(r, key, f"a list of {what}", value)
    return tuple(peer_id_field(r, key, pid) for pid in value)


@dataclass(frozen=True)
class PlanStage:
    """One stage of a plan: its layers and the peers that serve them, one per replica."""

    layer_start: int
    """First layer (inclusive)."""
    layer_end: int
    """Layer after the last one (exclusive)."""
    peer_ids: tuple[str, ...]
    """Its replicas' peer ids: replica r is `peer_ids[r]` (route c runs on replica c % len, `swarm.peers.routes`)."""

    def __post_init__(self) -> None:
        if type(self.peer_ids) is list:  # the wire's list, kept as a tuple (the document checks each id)
            set_field(self, "peer_ids", tuple(self.peer_ids))

    @property
    def layers(self) -> range:
        return range(self.layer_start, self.layer_end)

    def to_wire(self) -> dict[str, Any]:
        return {"layer_start": self.layer_start, "layer_end": self.layer_end, "peer_ids": list(self.peer_ids)}


@dataclass(frozen=True)
class PlanDocument:
    """What a published plan says, checked whole on construction (`from_wire` for the DHT's dict).

    Optional parts are None where the plan leaves them out: then every peer keeps its own flags (codecs,
    precision) and nothing is frozen or relayed."""

    stages: tuple[PlanStage, ...]
    """The pipeline, in order: contiguous layers from 0, each stage served by at least one peer."""
    unused_peer_ids: tuple[str, ...] = ()
    """Peers the plan was made from but leaves on standby."""
    trainer_ids: tuple[str, ...] | None = None
    """The trainers whose calls the stages serve (None: not named; the planner always names them)."""
    codecs: tuple[LinkCodecs, ...] | None = None
    """One per boundary (stage s to s+1); None: every peer's flags."""
    epilogue: EpilogueCodecs | None = None
    """The epilogue's codecs (wire key "epilogue_codecs"); None: the averagers' backward codecs."""
    bw_epilogue: str | None = None
    """Epilogue-only compression of the backward messages, `PRECISE:TAILS:SCHEDULE:MICRO_BATCHES` (`swarm-peer
    --bw-epilogue`'s form, one tail per boundary; `swarm.scheduler.epilogue_only.plan_epilogue_only`); None: every
    peer's --bw-epilogue."""
    precisions: tuple[str, ...] | None = None
    """One of PLAN_PRECISIONS per stage; None: every peer's --precision."""
    probe_sensitivity: bool | None = None
    """True where the planner chooses the precisions from the stages' sensitivity (`--precision-budget`): each stage
    then measures its own from real gradients now and then (`swarm.runtime.sensitivity_probe`, `swarm-peer
    --sensitivity-every-steps`) and announces it. None: nobody reads that figure, so no stage spends a step's
    compute on it."""
    frozen_layers: int | None = None
    """The frozen prefix (`swarm.runtime.freeze`, `swarm.daemon.repack`): layers no stage trains; None: 0."""
    relay_extra_s: float | None = None
    """What the plan's relayed links add to its predicted step (`swarm.scheduler.relays`); None: no relayed link."""
    step_time_s: float | None = None
    """The predicted step, in seconds (calibrated from the peers' clocks once `measured` is set)."""
    first_step_time_s: float | None = None
    """The prediction before calibration, kept when a calibrated plan replaces it."""
    breakdown: tuple[tuple[str, float], ...] | None = None
    """The predicted step's parts (`swarm.scheduler.cost.Breakdown`'s fields), as (name, seconds) pairs."""
    measured: tuple[tuple[str, tuple[tuple[str, float], ...]], ...] | None = None
    """Per peer, the figures of its clock the calibration read (`swarm.daemon.calibrate.Measured`)."""
    format: int | None = None
    """The scheduler's plan format (`swarm.scheduler.plans.PLAN_FORMAT`)."""
    version: int | None = None
    """The version the scheduler numbered its plan with (the record's version carries the authority)."""
    cost_model: str | None = None
    """The cost model that priced it ("full" or "dtfm")."""
    key_order: tuple[str, ...] = dataclasses.field(default=(), compare=False, repr=False)
    """The order of its wire keys (`to_wire`), set on construction: a parsed plan's as the wire gave them
    (`from_wire`), a new one's in the planner's order (format, version, cost model, step, breakdown, stages,
    standbys, frozen prefix, codecs, epilogue, precisions, the probes, relays, trainers, measured, first step). A plan
    made with `replace` keeps its keys where they were and puts the ones it adds last, as a JSON dict merged
    with `{**plan, **changes}` orders them: a plan republished with some fields replaced keeps its text."""

    def __post_init__(self) -> None:
        if type(self.stages) not in (list, tuple) or not 1 <= len(self.stages) <= MAX_PLAN_STAGES:
            raise fail(_P, "stages", f"a list of 1 to {MAX_PLAN_STAGES} stages", self.stages)
        set_field(self, "stages", tuple(self.stages))
        seen: set[str] = set()
        start = 0
        for i, stage in enumerate(self.stages):
            r = f"plan.stages[{i}]"
            if not isinstance(stage, PlanStage):
                raise fail(_P, f"stages[{i}]", "a dict", stage)
            if type(stage.layer_start) is not int or stage.layer_start != start:
                raise fail(r, "layer_start", f"{start} (stages contiguous from layer 0)", stage.layer_start)
            start = int_field(r, "layer_end", stage.layer_end, start + 1, MAX_LAYERS)
            ids = _ids(r, "peer_ids", stage.peer_ids, 1, MAX_PLAN_PEERS, f"1 to {MAX_PLAN_PEERS} peer ids")
            for pid in ids:
                if pid in seen:
                    raise fail(r, "peer_ids", "each peer in one stage only", pid)
                seen.add(pid)
        if not fits(self.replica_counts):  # uneven replica counts: routes are their lcm
            raise fail(_P, "stages", f"replica counts whose lcm is at most {MAX_ROUTES} (routes)", len(self.stages))
        what = f"at most {MAX_PLAN_PEERS} peer ids"
        set_field(self, "unused_peer_ids", _ids(_P, "unused_peer_ids", self.unused_peer_ids, 0, MAX_PLAN_PEERS, what))
        for pid in self.unused_peer_ids:
            if pid in seen:
                raise fail(_P, "unused_peer_ids", "peers the stages do not name", pid)
        self._check_codecs()
        self._check_bw_epilogue()
        self._check_precisions()
        if self.probe_sensitivity is not None and self.probe_sensitivity is not True:
            raise fail(_P, "probe_sensitivity", "true, or left out", self.probe_sensitivity)
        if self.frozen_layers is not None:
            int_field(_P, "frozen_layers", self.frozen_layers, 0, self.n_layers - 1)
        extra = self.relay_extra_s
        if extra is not None and (type(extra) not in (int, float) or not 0 <= extra <= MAX_RELAY_EXTRA_S):
            raise fail(_P, "relay_extra_s", f"a finite number of seconds in [0, {MAX_RELAY_EXTRA_S:g}]", extra)
        if self.trainer_ids is not None:
            what = f"at most {MAX_PLAN_TRAINERS} trainer ids"
            set_field(self, "trainer_ids", _ids(_P, "trainer_ids", self.trainer_ids, 0, MAX_PLAN_TRAINERS, what))
            if len(set(self.trainer_ids)) != len(self.trainer_ids):
                raise fail(_P, "trainer_ids", "distinct trainer ids", list(self.trainer_ids))
        for key in ("step_time_s", "first_step_time_s"):
            _number(_P, key, getattr(self, key))
        if self.breakdown is not None:
            set_field(self, "breakdown", _figure_pairs(_P, "breakdown", self.breakdown))
        if self.measured is not None:
            if type(self.measured) not in (list, tuple) or len(self.measured) > MAX_PLAN_PEERS:
                raise fail(_P, "measured", f"at most {MAX_PLAN_PEERS} peers' figures", self.measured)
            pairs = (pair if type(pair) is tuple and len(pair) == 2 else (None, None) for pair in self.measured)
            measured = tuple(
                (peer_id_field(_P, "measured", pid), _figure_pairs("plan.measured", str(pid), figures))
                for pid, figures in pairs
            )
            set_field(self, "measured", measured)
        if self.format is not None:
            int_field(_P, "format", self.format, 0, 1 << 16)
        _name(_P, "cost_model", self.cost_model)
        if self.version is not None:
            int_field(_P, "version", self.version, 0, MAX_PLAN_VERSION)
        # kept keys where they were, new ones last; a key this plan no longer has goes last if a later plan sets it
        present = [key for key, name in _WIRE_FIELDS.items() if getattr(self, name) is not None]
        kept = tuple(key for key in self.key_order if key in present)
        set_field(self, "key_order", kept + tuple(key for key in present if key not in kept))

    def _check_bw_epilogue(self) -> None:
        """`bw_epilogue`: a precise codec's label, one tail per boundary (0 to the micro-batches), the schedule and
        micro-batch count the tails were derived for."""
        text = self.bw_epilogue
        if text is None:
            return
        n = len(self.stages) - 1
        what = f"PRECISE:TAILS:SCHEDULE:MICRO_BATCHES with {n} tails, at most {_MAX_BW_EPILOGUE} characters"
        if type(text) is not str or len(text) > _MAX_BW_EPILOGUE:
            raise fail(_P, "bw_epilogue", what, text)
        parts = text.split(":")
        try:
            if len(parts) != 4 or parts[2] not in ("1f1b", "gpipe"):
                raise ValueError
            CodecConfig.parse(parts[0])
            tails, n_micro = [int(t) for t in parts[1].split(",")], int(parts[3])
        except ValueError:
            raise fail(_P, "bw_epilogue", what, text) from None
        if not 1 <= n_micro <= _MAX_MICRO or len(tails) != n or not all(0 <= t <= n_micro for t in tails):
            raise fail(_P, "bw_epilogue", what, text)

    def _check_codecs(self) -> None:
        n = len(self.stages)
        if self.codecs is not None:
            if type(self.codecs) not in (list, tuple) or len(self.codecs) != n - 1:
                raise fail(_P, "codecs", f"a list of {n - 1} boundaries' codecs", self.codecs)
            set_field(self, "codecs", tuple(self.codecs))
            for i, link in enumerate(self.codecs):
                if not isinstance(link, LinkCodecs):
                    raise fail(_P, f"codecs[{i}]", "a LinkCodecs", link)
        if self.epilogue is not None and not isinstance(self.epilogue, EpilogueCodecs):
            raise fail(_P, "epilogue_codecs", "an EpilogueCodecs", self.epilogue)
        if self.epilogue is not None and len(self.epilogue.average_labels) != n:
            what = f"a list of {n} stages' codecs"
            raise fail("plan.epilogue_codecs", "average", what, list(self.epilogue.average_labels))

    def _check_precisions(self) -> None:
        """fp16 is all or none: its loss scale is agreed by every stage (`swarm.runtime.precision`), which a stage
        without scaling (scale 1) cannot agree to."""
        precisions, n = self.precisions, len(self.stages)
        if precisions is None:
            return
        if type(precisions) not in (list, tuple) or len(precisions) != n:
            raise fail(_P, "precisions", f"a list of {n} precisions, one per stage", precisions)
        for i, name in enumerate(precisions):
            if type(name) is not str or name not in PLAN_PRECISIONS:
                raise fail(_P, f"precisions[{i}]", f"one of {PLAN_PRECISIONS}", name)
        if "fp16" in precisions and set(precisions) != {"fp16"}:
            what = "fp16 on every stage or on none (its loss scale is agreed)"
            raise fail(_P, "precisions", what, list(precisions))
        set_field(self, "precisions", tuple(precisions))

    # ---- wire form -----------------------------------------------------------------------------------------

    @classmethod
    def from_wire(cls, wire: Any) -> PlanDocument:
        """Parses a plan from untrusted wire data (a JSON dict). Raises ValueError naming the first bad field."""
        if not isinstance(wire, dict):
            raise fail("PlanRecord", "plan", "a dict", wire)
        stages = wire.get("stages")
        if type(stages) is not list or not 1 <= len(stages) <= MAX_PLAN_STAGES:
            raise fail(_P, "stages", f"a list of 1 to {MAX_PLAN_STAGES} stages", stages)
        parsed = []
        for i, stage in enumerate(stages):
            if not isinstance(stage, dict):
                raise fail(_P, f"stages[{i}]", "a dict", stage)
            ids = stage.get("peer_ids")
            if type(ids) is not list:
                raise fail(f"plan.stages[{i}]", "peer_ids", f"a list of 1 to {MAX_PLAN_PEERS} peer ids", ids)
            parsed.append(PlanStage(stage.get("layer_start"), stage.get("layer_end"), tuple(ids)))
        codecs = wire.get("codecs")
        if codecs is not None:
            if type(codecs) is not list or len(codecs) != len(stages) - 1:
                raise fail(_P, "codecs", f"a list of {len(stages) - 1} boundaries' codecs", codecs)
            codecs = tuple(LinkCodecs.from_wire(link, i) for i, link in enumerate(codecs))
        epilogue = wire.get("epilogue_codecs")
        measured = wire.get("measured")
        if measured is not None:
            if not isinstance(measured, dict) or len(measured) > MAX_PLAN_PEERS:
                raise fail(_P, "measured", f"a dict of at most {MAX_PLAN_PEERS} peers' figures", measured)
            measured = tuple(
                (peer_id_field(_P, "measured", pid), _figures("plan.measured", pid, figures))
                for pid, figures in measured.items()
            )
        breakdown = wire.get("breakdown")
        unused = wire.get("unused_peer_ids", [])
        if type(unused) is not list:
            raise fail(_P, "unused_peer_ids", f"a list of at most {MAX_PLAN_PEERS} peer ids", unused)
        trainers = wire.get("trainer_ids")
        if trainers is not None and type(trainers) is not list:
            raise fail(_P, "trainer_ids", f"a list of at most {MAX_PLAN_TRAINERS} trainer ids", trainers)
        precisions = wire.get("precisions")
        if precisions is not None and type(precisions) is not list:
            raise fail(_P, "precisions", f"a list of {len(stages)} precisions, one per stage", precisions)
        return cls(
            stages=tuple(parsed),
            unused_peer_ids=tuple(unused),
            trainer_ids=None if trainers is None else tuple(trainers),
            codecs=codecs,
            epilogue=None if epilogue is None else EpilogueCodecs.from_wire(epilogue),
            bw_epilogue=wire.get("bw_epilogue"),
            precisions=None if precisions is None else tuple(precisions),
            probe_sensitivity=wire.get("probe_sensitivity"),
            frozen_layers=wire.get("frozen_layers"),
            relay_extra_s=wire.get("relay_extra_s"),
            step_time_s=wire.get("step_time_s"),
            first_step_time_s=wire.get("first_step_time_s"),
            breakdown=None if breakdown is None else _figures(_P, "breakdown", breakdown),
            measured=measured,
            format=wire.get("format"),
            version=wire.get("version"),
            cost_model=wire.get("cost_model"),
            key_order=tuple(wire),
        )

    def to_wire(self) -> dict[str, Any]:
        """The plan as the DHT carries it (JSON-able), its keys in `key_order`."""
        return {key: self._wire_value(key) for key in self.key_order}

    def _wire_value(self, key: str) -> Any:
        """Wire key `key`'s value (a key of `key_order`: its field is set)."""
        value = getattr(self, _WIRE_FIELDS[key])
        if key in ("stages", "codecs"):
            return [part.to_wire() for part in value]
        if key in ("unused_peer_ids", "precisions", "trainer_ids"):
            return list(value)
        if key == "epilogue_codecs":
            return value.to_wire()
        if key == "breakdown":
            return dict(value)
        if key == "measured":
            return {pid: dict(figures) for pid, figures in value}
        return value

    def replace(self, **changes: Any) -> PlanDocument:
        """This plan with `changes` (fields by name), checked whole again."""
        return dataclasses.replace(self, **changes)

    def with_stages(self, stages: Iterable[PlanStage]) -> PlanDocument:
        """This plan's peers on other stages (a repack, `swarm.daemon.repack`). With another stage count, what was
        made for the old stages goes: the boundaries' codecs, the epilogue's and the precisions (one per stage or
        boundary), and the prediction of their layout (step, breakdown, measured clocks)."""
        stages = tuple(stages)
        if len(stages) == self.n_stages:
            return self.replace(stages=stages)
        dropped = (
            "codecs", "epilogue", "bw_epilogue", "precisions", "step_time_s", "first_step_time_s", "breakdown",
            "measured",
        )  # fmt: skip
        return self.replace(stages=stages, **dict.fromkeys(dropped))

    def with_link_codecs(self, codecs: Iterable[LinkCodecs]) -> PlanDocument:
        """This plan with each boundary's codecs (`swarm.scheduler.bits.choose_codecs`), one per boundary."""
        return self.replace(codecs=tuple(codecs))

    def with_epilogue(self, epilogue: EpilogueCodecs) -> PlanDocument:
        """This plan with the epilogue's codecs (`swarm.scheduler.bits.choose_epilogue`), one average per stage."""
        return self.replace(epilogue=epilogue)

    def with_prediction(self, step_time_s: float, breakdown: Mapping[str, float]) -> PlanDocument:
        """This plan with its predicted step and that step's parts (`swarm.scheduler.cost.Breakdown`'s fields, in
        their order), as the planner predicts them for the codecs it chose."""
        return self.replace(step_time_s=step_time_s, breakdown=tuple(breakdown.items()))

    def with_precisions(self, precisions: Iterable[str]) -> PlanDocument:
        """This plan with one of PLAN_PRECISIONS per stage (`swarm.scheduler.precision.plan_precisions`)."""
        return self.replace(precisions=tuple(precisions))

    def stage_dicts(self) -> list[dict[str, Any]]:
        """The stages in the scheduler's layout form (`swarm.scheduler.plans.Plan.to_dict`'s "stages")."""
        return [stage.to_wire() for stage in self.stages]

    def same_codecs(self, other: PlanDocument) -> bool:
        """Whether both plans name the same codecs (links and epilogue): the labels, not the `why` texts, whose
        figures change with every measurement."""

        def labels(plan: PlanDocument) -> tuple:
            links = tuple((c.forward_label, c.backward_label) for c in plan.codecs or ())
            epilogue = plan.epilogue
            return links, (epilogue.average_labels, epilogue.tied_label) if epilogue else ((), None)

        return labels(self) == labels(other)

    # ---- reading the plan ----------------------------------------------------------------------------------

    @property
    def n_stages(self) -> int:
        return len(self.stages)

    @property
    def n_layers(self) -> int:
        """The layers the stages cover (the model's, once `validate_plan` checked it)."""
        return self.stages[-1].layer_end

    @property
    def replica_counts(self) -> tuple[int, ...]:
        """Replicas of every stage, in stage order (uneven after a joiner grew one: `swarm.peers.routes`)."""
        return tuple(len(s.peer_ids) for s in self.stages)

    @property
    def frozen(self) -> int:
        """The frozen prefix's layer count (0: none)."""
        return self.frozen_layers or 0

    @property
    def predicted_step_s(self) -> float | None:
        """The predicted step when it is a positive number of seconds, else None (an even split: no prediction)."""
        value = self.step_time_s
        return float(value) if value is not None and value > 0 else None

    def used_peers(self) -> set[str]:
        """The peers that serve a stage."""
        return {pid for stage in self.stages for pid in stage.peer_ids}

    def named_peers(self) -> set[str]:
        """Every peer the plan was made from: those it uses and those it leaves on standby."""
        return self.used_peers() | set(self.unused_peer_ids)

    def place_of(self, peer_id: str) -> tuple[int, int] | None:
        """(stage, replica) where `peer_id` serves, or None on standby."""
        for index, stage in enumerate(self.stages):
            if peer_id in stage.peer_ids:
                return index, stage.peer_ids.index(peer_id)
        return None

    def columns(self) -> list[list[str]]:
        """The plan's columns: column r is replica r of every stage, for r below the smallest replica
        count (with uneven counts the routes are `swarm.peers.routes`', not these)."""
        return [[s.peer_ids[r] for s in self.stages] for r in range(min(self.replica_counts))]

    def route_of(self, announcements: Iterable, version: int) -> PlanRoutes | None:
        """Every replica of every stage of this plan (published as `version`) at its announced address, once every
        one of its peers announces that it follows the plan in its stage (`PeerAnnouncement`'s `plan_version`,
        `stage` and `address`); None while a peer is still switching. Replica counts may differ between stages."""
        following = {p.peer_id: p for p in announcements if p.plan_version == version and p.stage is not None}
        addresses = []
        for index, stage in enumerate(self.stages):
            row = []
            for pid in stage.peer_ids:
                ann = following.get(pid)
                if ann is None or ann.stage != index:
                    return None
                row.append(ann.address)
            addresses.append(tuple(row))
        ids = [stage.peer_ids for stage in self.stages]
        flat = [r[0] for r in addresses], [r[0] for r in ids], version
        nested = ((), ()) if all(len(r) == 1 for r in ids) else (tuple(addresses), tuple(ids))
        extra = self.relay_extra_s
        return PlanRoutes(*flat, *nested, self.predicted_step_s, frozen_layers=self.frozen, relay_extra_s=extra)

    def serves_trainer(self, trainer_id: str) -> bool:
        """Whether the stages serve `trainer_id`'s calls under this plan."""
        return trainer_id in (self.trainer_ids or ())

    def link_labels(self, stage: int, default: tuple[str, str]) -> tuple[str, str, str, str]:
        """The codec labels stage `stage` puts on its boundary ends: (forward send, backward send, forward
        receive, backward receive). It sends forward on boundary `stage` and receives backward there; it receives
        forward and sends backward on boundary `stage - 1`. Without codecs, `default` (forward, backward) everywhere."""
        if not self.codecs:
            forward, backward = default
            return forward, backward, forward, backward
        after = self.codecs[stage] if stage < len(self.codecs) else None
        before = self.codecs[stage - 1] if stage > 0 else None
        forward_send = after.forward_label if after else (before.forward_label if before else default[0])
        backward_recv = after.backward_label if after else (before.backward_label if before else default[1])
        forward_recv = before.forward_label if before else forward_send
        backward_send = before.backward_label if before else backward_recv
        return forward_send, backward_send, forward_recv, backward_recv

    def link_configs(self, stage: int, default: tuple[CodecConfig, CodecConfig]) -> tuple[CodecConfig, ...]:
        """`link_labels` as the `CodecConfig`s stage `stage` runs; `default`: the peer's own (forward, backward)
        configs, kept as they are wherever the plan names their label. Where it names another, the label is
        parsed over the peer's own options (`CodecConfig.local_options`: group size unless the label sets one,
        zstd level, seed, buffer directory): a plan chooses codecs, never a peer's local settings."""
        labels = self.link_labels(stage, (default[0].label, default[1].label))
        return tuple(
            c if label == c.label else CodecConfig.parse(label, **c.local_options())
            for c, label in zip(default * 2, labels, strict=True)
        )

    def epilogue_configs(self, stage: int) -> tuple[CodecConfig | None, CodecConfig | None]:
        """(averaging, tied) configs for stage `stage`'s averager; None where the plan names none (the averager
        then uses its backward codec, as without a plan). The tied sync runs on the first and last stages."""
        if self.epilogue is None:
            return None, None
        n = len(self.epilogue.average)
        average = self.epilogue.average[stage] if stage < n else None
        return average, self.epilogue.tied if stage in (0, n - 1) else None

    def precision(self, stage: int, default: str) -> str:
        """What stage `stage` computes in: the plan's precision for it, else `default` (the peer's --precision)."""
        precisions = self.precisions
        return precisions[stage] if precisions is not None and 0 <= stage < len(precisions) else default

    def measured_figures(self) -> dict[str, dict[str, float]]:
        """The calibration's per-peer figures (empty before a calibration)."""
        return {pid: dict(figures) for pid, figures in self.measured or ()}

    def check_run(self, n_layers: int | None, peers: Iterable[str], trainers: Iterable[str] | None) -> None:
        """The checks that need the run: the stages cover the model's `n_layers` (None: not checked), every peer
        a stage names is in `peers` (the announced ids), and every trainer in `trainers` (None: not checked)."""
        if n_layers is not None and self.n_layers != n_layers:
            r = f"plan.stages[{len(self.stages) - 1}]"
            raise fail(r, "layer_end", f"{n_layers} (the model's layers)", self.n_layers)
        announced = set(peers)
        for i, stage in enumerate(self.stages):
            for pid in stage.peer_ids:
                if pid not in announced:
                    raise fail(f"plan.stages[{i}]", "peer_ids", "announced peers", pid)
        known = None if trainers is None else set(trainers)
        for tid in self.trainer_ids or ():
            if known is not None and tid not in known:
                raise fail(_P, "trainer_ids", "announced trainers", tid)
