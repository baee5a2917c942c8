"""The plan side of freezing: the `frozen_layers` key and the elastic repack (swarm.daemon.repack)."""

from __future__ import annotations

import math

import pytest

from swarm.daemon.repack import repack_layout, repack_plan, split_by_cost
from swarm.peers.plan import PlanDocument
from swarm.peers.records import PeerAnnouncement, PlanRecord, validate_plan

PEERS = [PeerAnnouncement(p, "127.0.0.1:5000", "cpu", 1 << 30, 1.0) for p in "abcd"]


def _plan() -> dict:
    return {"stages": [{"layer_start": 2 * i, "layer_end": 2 * i + 2, "peer_ids": [p]} for i, p in enumerate("abcd")]}


@pytest.mark.parametrize("frozen", [0, 3, 7])
def test_a_plan_may_name_a_frozen_prefix(frozen):
    validate_plan(PlanRecord(version=1, document={**_plan(), "frozen_layers": frozen}, created_at=1.0), 8, PEERS)


@pytest.mark.parametrize("bad", [-1, 8, 99, 2.0, True, "3", math.nan, [1]])
def test_a_malformed_frozen_prefix_is_refused(bad):
    with pytest.raises(ValueError, match="frozen_layers|JSON"):  # NaN: the record itself refuses it
        validate_plan(PlanRecord(version=1, document={**_plan(), "frozen_layers": bad}, created_at=1.0), 8, PEERS)


def test_split_by_cost_balances_the_costliest_stage():
    assert split_by_cost([1.0] * 8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert split_by_cost([1 / 3] * 6 + [1.0] * 2, 2) == [(0, 6), (6, 8)]
    with pytest.raises(ValueError):
        split_by_cost([1.0] * 2, 3)


def test_repack_halves_the_stages_once_the_frozen_prefix_allows_and_deals_the_freed_peers_as_replicas():
    assert repack_layout(8, 0, 4, 2.0, 4) == ([(0, 2), (2, 4), (4, 6), (6, 8)], [1, 1, 1, 1])
    assert repack_layout(8, 4, 4, 2.0, 4)[1] == [1, 1, 1, 1]  # 4 active layers on 2 stages would be 2.67 a stage
    assert repack_layout(8, 6, 4, 2.0, 4) == ([(0, 6), (6, 8)], [2, 2])
    codecs = [{"forward": "fp32", "backward": "fp32"}] * 3
    plan = repack_plan(PlanDocument.from_wire({**_plan(), "codecs": codecs}), 6)
    assert [(s.layer_start, s.layer_end, list(s.peer_ids)) for s in plan.stages] == [
        (0, 6, ["a", "b"]),
        (6, 8, ["c", "d"]),
    ]
    assert plan.frozen_layers == 6 and plan.codecs is None
    validate_plan(PlanRecord(version=2, document=plan, created_at=1.0), 8, PEERS)
    with pytest.raises(ValueError):
        repack_plan(PlanDocument.from_wire(_plan()), 8)  # the last layer always trains


def test_a_prefix_that_does_not_yet_allow_fewer_stages_is_carried_without_moving_any_layer():
    codecs = [{"forward": "fp32", "backward": "fp32"}] * 3
    current = PlanDocument.from_wire({**_plan(), "codecs": codecs})
    for frozen in (1, 2, 4, 5):  # 4 stages until 6 frozen layers fit 2 (cost 6 x 1/3 + 2 <= 2 layers)
        plan = repack_plan(current, frozen)
        assert plan.stage_dicts() == current.stage_dicts() and plan.codecs == current.codecs
        assert plan.frozen_layers == frozen
        validate_plan(PlanRecord(version=2, document=plan, created_at=1.0), 8, PEERS)
