"""DHT records: good records survive the wire (msgpack included); every kind of bad field is refused by name."""

from __future__ import annotations

import dataclasses
import json
import math

import msgpack
import pytest

from swarm.peers.records import MAX_PLAN_BYTES, LinkMeasurement, PeerAnnouncement, PlanRecord

NOW = 1_790_000_000.0
PEER_A, PEER_B = "ae7e50550f71764ff7dbb770", "a350c96e50acc97af69b165b"


def announcement(**changes) -> PeerAnnouncement:
    fields = dict(
        peer_id=PEER_A,
        address="127.0.0.1:5000",
        device="cuda:0",
        memory_bytes=8 << 30,
        compute_layers_per_s=41.5,
        stage=1,
        layer_start=4,
        layer_end=8,
        load=0.25,
        plan_version=3,
        started_at=NOW,
        codec="aqsgd4",
    )
    return PeerAnnouncement(**{**fields, **changes})


def link(**changes) -> LinkMeasurement:
    fields = dict(src=PEER_A, dst=PEER_B, rtt_s=0.012, bytes_per_s=12.5e6, measured_at=NOW)
    return LinkMeasurement(**{**fields, **changes})


def plan(**changes) -> PlanRecord:
    stages = [{"layer_start": 0, "layer_end": 4, "peer_ids": [PEER_A]}]
    fields = dict(version=2, document={"stages": stages, "step_time_s": 1e-3}, created_at=NOW)
    return PlanRecord(**{**fields, **changes})


EVERY_PART = {  # a plan with every optional part (`swarm.peers.plan.PlanDocument`)
    "format": 1,
    "version": 2,
    "cost_model": "full",
    "step_time_s": 0.5,
    "breakdown": {"total_s": 0.5, "compute_s": 0.25},
    "stages": [
        {"layer_start": 0, "layer_end": 2, "peer_ids": [PEER_A]},
        {"layer_start": 2, "layer_end": 4, "peer_ids": [PEER_B]},
    ],
    "unused_peer_ids": ["standby"],
    "frozen_layers": 1,
    "codecs": [{"forward": "acsgd2+ch+nr", "backward": "gradq2+ef+rot+nr+cs+g1024", "why": "slow"}],
    "epilogue_codecs": {"average": [None, None], "tied": "gradq8+ef+rot+nr+cs+g1024", "why": "tied"},
    "precisions": ["fp32", "bf16"],
    "relay_extra_s": 0.125,
    "trainer_ids": ["t1"],
    "measured": {PEER_A: {"micro_batch_s": 0.1, "steps": 4}},
    "first_step_time_s": 0.75,
}


def through_msgpack(wire: dict) -> dict:
    return msgpack.unpackb(msgpack.packb(wire, use_bin_type=True, strict_types=True), raw=False)


def only_primitives(value) -> bool:
    if isinstance(value, dict):
        return all(type(k) is str and only_primitives(v) for k, v in value.items())
    return type(value) in (str, int, float, bool, type(None))


# -- round trips ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "record",
    [
        announcement(),
        announcement(stage=None, layer_start=None, layer_end=None, codec=None, plan_version=0),
        announcement(address="[::1]:443", device="cpu", load=1.0, memory_bytes=0, compute_layers_per_s=0.0),
        announcement(address="peer-7.example.org:65535", device="mps"),
        link(),
        link(rtt_s=0.0, bytes_per_s=0.0),
        plan(),
        plan(document=EVERY_PART),
    ],
    ids=lambda r: type(r).__name__,
)
def test_round_trip_through_msgpack(record):
    wire = record.to_wire()
    assert only_primitives(wire)
    assert type(record).from_wire(through_msgpack(wire)) == record


def test_numbers_are_normalized_to_float():
    ann = announcement(compute_layers_per_s=5, load=1, started_at=0)
    assert type(ann.compute_layers_per_s) is float and type(ann.load) is float and type(ann.started_at) is float
    assert type(link(rtt_s=1).rtt_s) is float


def test_plan_is_canonical_json():
    record = plan(document={"stages": [{"layer_start": 0, "layer_end": 4, "peer_ids": (PEER_A,)}], 3: "three"})
    assert record.document.to_wire() == {"stages": [{"layer_start": 0, "layer_end": 4, "peer_ids": [PEER_A]}],
                                         "unused_peer_ids": []}  # fmt: skip
    assert PlanRecord.from_wire(record.to_wire()) == record
    assert isinstance(record.to_wire()["plan"], str)


def test_a_plan_with_every_part_gives_back_the_dict_it_was_read_from():
    record = plan(document=EVERY_PART)
    assert record.document.to_wire() == EVERY_PART
    assert json.loads(record.to_wire()["plan"]) == EVERY_PART


def test_unknown_wire_keys_are_ignored_and_optional_ones_default():
    wire = {**announcement().to_wire(), "future_field": [1, 2]}
    del wire["codec"]
    assert PeerAnnouncement.from_wire(wire) == announcement(codec=None)


def test_layers_range():
    assert announcement().layers == range(4, 8)
    assert announcement(stage=None, layer_start=None, layer_end=None).layers is None


# -- rejections: every field, every kind of bad value -----------------------------------------------------------

BAD_ANNOUNCEMENT_FIELDS = {
    "peer_id": ["", "x" * 65, "has space", "-leading", 5, None, b"bytes"],
    "address": ["nohost", "host:0", "host:65536", ":80", "host:port", "a b:80", "[zz::1]:80", 8080, None],
    "device": ["", "CPU", "cuda:x", "cuda:0:1", "a" * 40, 0, None],
    "memory_bytes": [-1, 1.5, True, "1", 1 << 60, None],
    "compute_layers_per_s": [-1.0, math.nan, math.inf, 1e12, "1", True, None],
    "stage": [-1, 1.0, True, 5000, "0"],
    "layer_start": [-1, 1.5, True, "0"],
    "layer_end": [0, 2.5, False, "8", 1 << 21],
    "load": [-0.1, 1.1, math.nan, "0.5", True, None],
    "plan_version": [-1, 1.0, True, None],
    "started_at": [-1.0, math.inf, math.nan, "now", None, 1e12],
    "codec": ["", "x" * 65, "bad codec", 3, b"fp32"],
}


@pytest.mark.parametrize(
    "field,value", [(f, v) for f, values in BAD_ANNOUNCEMENT_FIELDS.items() for v in values], ids=repr
)
def test_bad_announcement_field_is_named(field, value):
    wire = announcement().to_wire()
    if field == "layer_start" and isinstance(value, int) and not isinstance(value, bool):
        wire["layer_end"] = max(value + 1, 1)  # check the range itself, not the order of start and end
    wire[field] = value
    with pytest.raises(ValueError, match=rf"PeerAnnouncement\.{field}\b"):
        PeerAnnouncement.from_wire(wire)
    with pytest.raises(ValueError, match=rf"PeerAnnouncement\.{field}\b"):
        dataclasses.replace(announcement(), **{field: value})


@pytest.mark.parametrize(
    "changes,field",
    [
        ({"layer_start": 8, "layer_end": 8}, "layer_end"),
        ({"layer_start": 9, "layer_end": 8}, "layer_end"),
        ({"layer_end": None}, "layer_end"),
        ({"layer_start": None}, "layer_end"),
        ({"stage": None}, "stage"),
        ({"layer_start": None, "layer_end": None}, "stage"),
    ],
)
def test_inconsistent_stage_and_layers_are_named(changes, field):
    with pytest.raises(ValueError, match=rf"PeerAnnouncement\.{field}\b"):
        announcement(**changes)


BAD_LINK_FIELDS = {
    "src": ["", "x" * 65, "sp ace", 1, None],
    "dst": ["", PEER_A, "x" * 65, 1, None],  # PEER_A is src: no link to oneself
    "rtt_s": [-0.001, math.nan, math.inf, 4000.0, "0.1", True, None],
    "bytes_per_s": [-1.0, math.inf, math.nan, 1e14, "1e6", None],
    "measured_at": [-1.0, math.nan, "now", None],
}


@pytest.mark.parametrize("field,value", [(f, v) for f, values in BAD_LINK_FIELDS.items() for v in values], ids=repr)
def test_bad_link_field_is_named(field, value):
    wire = {**link().to_wire(), field: value}
    with pytest.raises(ValueError, match=rf"LinkMeasurement\.{field}\b"):
        LinkMeasurement.from_wire(wire)


BAD_PLAN_WIRE_FIELDS = {
    "version": [0, -1, 1.5, True, "2", None, 1 << 63],
    "plan": [
        None,
        {"a": 1},  # on the wire the plan is JSON text, never a nested structure
        "[1, 2]",
        "{",
        '{"x": NaN}',
        '{"x": Infinity}',
        "[" * 100_000 + "]" * 100_000,
        json.dumps({"x": "y" * MAX_PLAN_BYTES}),
        b"{}",
    ],
    "created_at": [-1.0, math.nan, math.inf, "now", None],
}


@pytest.mark.parametrize(
    "field,value",
    [(f, v) for f, values in BAD_PLAN_WIRE_FIELDS.items() for v in values],
    ids=lambda v: repr(v)[:40],
)
def test_bad_plan_wire_field_is_named(field, value):
    wire = {**plan().to_wire(), field: value}
    with pytest.raises(ValueError, match=rf"PlanRecord\.{field}\b"):
        PlanRecord.from_wire(wire)


@pytest.mark.parametrize(
    "value",
    [[1, 2], "{}", {"x": math.nan}, {"x": {1, 2}}, {"x": object()}, {"x": "y" * MAX_PLAN_BYTES}],
    ids=lambda v: repr(v)[:40],
)
def test_bad_plan_is_refused_at_construction(value):
    with pytest.raises(ValueError, match=r"PlanRecord\.plan\b"):
        plan(document=value)


def test_deeply_nested_plan_is_refused_not_crashing():
    nested: dict = {}
    for _ in range(100_000):
        nested = {"x": nested}
    with pytest.raises(ValueError, match=r"PlanRecord\.plan\b"):
        plan(document=nested)


@pytest.mark.parametrize("cls", [PeerAnnouncement, LinkMeasurement, PlanRecord])
@pytest.mark.parametrize("wire", [None, [], "peer", 7, b"\x80"], ids=repr)
def test_non_dict_wire_is_refused(cls, wire):
    with pytest.raises(ValueError, match=cls.__name__):
        cls.from_wire(wire)


@pytest.mark.parametrize("record", [announcement(), link(), plan()], ids=lambda r: type(r).__name__)
def test_missing_field_is_named(record):
    for field in dataclasses.fields(record):
        if field.default is not dataclasses.MISSING:
            continue
        key = "plan" if field.name == "document" else field.name  # a plan's document travels as "plan"
        wire = record.to_wire()
        del wire[key]
        with pytest.raises(ValueError, match=rf"{type(record).__name__}\.{key}: missing"):
            type(record).from_wire(wire)


def test_leaving_and_held_copies_round_trip_and_are_bounded():
    ann = announcement(leaving=True, held=[[0, 2, 40], [2, 4, 0]])
    assert ann.held == ((0, 2, 40), (2, 4, 0))
    wire = ann.to_wire()
    assert only_primitives(wire) and type(ann).from_wire(through_msgpack(wire)) == ann
    for bad in (
        {"leaving": 1},
        {"held": [[0, 2]]},
        {"held": [[2, 1, 0]]},
        {"held": [[0, 1, -1]]},
        {"held": [[0, 1, 0]] * 9},
    ):
        with pytest.raises(ValueError):
            announcement(**bad)
