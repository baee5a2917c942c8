"""Plans are checked against the model and the announced peers before anyone follows them, and every number
in a record is bounded so that no reader or planner can crash on it."""

from __future__ import annotations

import pytest

from swarm.peers.entries import MAX_TTL_S, parse_entry
from swarm.peers.fields import MAX_PLAN_VERSION
from swarm.peers.plan import MAX_PLAN_STAGES, MAX_PLAN_TRAINERS
from swarm.peers.records import (
    MAX_CLOCK_SKEW_S,
    PeerAnnouncement,
    PlanRecord,
    validate_plan,
)

N_LAYERS = 4


def peer(pid: str) -> PeerAnnouncement:
    return PeerAnnouncement(pid, "127.0.0.1:5000", "cpu", 1 << 30, 1.0)


PEERS = [peer(p) for p in ("p0", "p1", "p2")]


def record(stages, version: int = 2, **extra) -> PlanRecord:
    return PlanRecord(version=version, document={"stages": stages, **extra}, created_at=1.0)


def stage(start: int, end: int, *ids: str) -> dict:
    return {"layer_start": start, "layer_end": end, "peer_ids": list(ids)}


GOOD = [stage(0, 3, "p0"), stage(3, 4, "p1")]


def test_a_plan_covering_the_model_with_announced_peers_passes():
    validate_plan(record(GOOD, unused_peer_ids=["p2"], trainer_ids=["t1"]), N_LAYERS, PEERS, trainers=["t1"])
    validate_plan(record(GOOD), None, PEERS)  # without the model: contiguity from 0 only


@pytest.mark.parametrize(
    ("stages", "extra", "field"),
    [
        ([stage(0, 3, "p0"), stage(3, 1000000, "p1")], {}, "plan.stages[1].layer_end"),  # crashed a peer once
        ([stage(0, 3, "p0")], {}, "plan.stages[0].layer_end"),  # the model's last layer served by nobody
        ([stage(1, 4, "p0")], {}, "plan.stages[0].layer_start"),
        ([stage(0, 2, "p0"), stage(3, 4, "p1")], {}, "plan.stages[1].layer_start"),  # a gap
        ([stage(0, 3, "p0"), stage(2, 4, "p1")], {}, "plan.stages[1].layer_start"),  # an overlap
        ([stage(0, 2, "p0"), stage(2, 2, "p1"), stage(2, 4, "p2")], {}, "plan.stages[1].layer_end"),  # empty
        ([stage(0, 3), stage(3, 4, "p1")], {}, "plan.stages[0].peer_ids"),
        ([stage(0, 3, "p0"), stage(3, 4, "stranger")], {}, "plan.stages[1].peer_ids"),
        ([stage(0, 3, "p0"), stage(3, 4, "p0")], {}, "plan.stages[1].peer_ids"),  # one peer twice
        ([stage(0, 3, "p0", "p0"), stage(3, 4, "p1")], {}, "plan.stages[0].peer_ids"),
        ([], {}, "plan.stages"),
        ("0-4", {}, "plan.stages"),
        ([stage(0, 3, "p0"), "p1"], {}, "plan.stages[1]"),
        ([{"layer_start": True, "layer_end": 4, "peer_ids": ["p0"]}], {}, "plan.stages[0].layer_start"),
        (GOOD, {"unused_peer_ids": ["p0"]}, "plan.unused_peer_ids"),
        (GOOD, {"trainer_ids": "t1"}, "plan.trainer_ids"),
        (GOOD, {"trainer_ids": ["t1", "t1"]}, "plan.trainer_ids"),
        (GOOD, {"trainer_ids": ["t9"]}, "plan.trainer_ids"),  # not an announced trainer
        (GOOD, {"trainer_ids": [f"t{i}" for i in range(MAX_PLAN_TRAINERS + 1)]}, "plan.trainer_ids"),
        (GOOD, {"trainer_ids": ["bad id"]}, "plan.trainer_ids"),
    ],
)
def test_an_invalid_plan_is_refused_naming_the_field(stages, extra, field):
    with pytest.raises(ValueError, match=rf"^{field.replace('[', '.').replace(']', '.')}: "):
        validate_plan(record(stages, **extra), N_LAYERS, PEERS, trainers=["t1"])


def test_the_stage_count_is_bounded():
    many = [stage(i, i + 1, "p0" if i == 0 else f"q{i}") for i in range(MAX_PLAN_STAGES + 1)]
    announced = [peer("p0"), *(peer(f"q{i}") for i in range(1, MAX_PLAN_STAGES + 1))]
    with pytest.raises(ValueError, match=r"^plan\.stages: "):
        validate_plan(record(many), MAX_PLAN_STAGES + 1, announced)


def test_versions_are_bounded_so_the_next_version_always_fits():
    PlanRecord(version=MAX_PLAN_VERSION, document={"stages": GOOD}, created_at=1.0)
    for version in (MAX_PLAN_VERSION + 1, (1 << 63) - 1):
        with pytest.raises(ValueError, match=r"PlanRecord\.version"):
            PlanRecord(version=version, document={"stages": GOOD}, created_at=1.0)
    with pytest.raises(ValueError, match=r"PeerAnnouncement\.plan_version"):
        PeerAnnouncement("p0", "127.0.0.1:5000", "cpu", 1, 1.0, plan_version=(1 << 63) - 1)


def _signed_plan_entry(created_at: float) -> tuple[bytes, dict]:
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.utils.crypto import RSAPrivateKey

    owner = RSASignatureValidator(RSAPrivateKey()).local_public_key
    rec = PlanRecord(version=3, document={"stages": GOOD}, created_at=created_at)
    return owner + b"#3", rec.to_wire()


@pytest.mark.parametrize("kind", ["plan"])
def test_records_that_would_live_too_long_or_come_from_the_future_are_refused(kind):
    now = 1_000_000.0
    subkey, value = _signed_plan_entry(created_at=now)
    owner, got = parse_entry(kind, subkey, value, expiration=now + 3600, now=now)
    assert got.version == 3 and len(owner) == 24
    with pytest.raises(ValueError, match="expires"):
        parse_entry(kind, subkey, value, expiration=now + MAX_TTL_S[kind] + MAX_CLOCK_SKEW_S + 1, now=now)
    future, value = _signed_plan_entry(created_at=now + MAX_CLOCK_SKEW_S + 60)
    with pytest.raises(ValueError, match="future"):
        parse_entry(kind, future, value, expiration=now + 60, now=now)


def test_announcements_live_at_most_ten_minutes():
    import dataclasses

    from swarm.peers.dht_config import DHTConfig

    assert MAX_TTL_S["peers"] == MAX_TTL_S["trainers"] == 600 and MAX_TTL_S["plan"] == 7200
    with pytest.raises(ValueError, match="announce_ttl_s"):
        dataclasses.replace(DHTConfig(), announce_ttl_s=3600.0)
    with pytest.raises(ValueError, match="plan_ttl_s"):
        DHTConfig(plan_ttl_s=1e9)
