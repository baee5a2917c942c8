"""EvenSplit: peers ordered by start time, then id, take stages in turn, each an even slice of the layers."""

from __future__ import annotations

import random

import pytest

from swarm.daemon.assign import EvenSplit
from swarm.peers.records import PeerAnnouncement
from swarm.runtime.host import StageRole


def peer(peer_id: str, started_at: float) -> PeerAnnouncement:
    return PeerAnnouncement(
        peer_id=peer_id, address="127.0.0.1:5000", device="cpu", memory_bytes=1 << 30, compute_layers_per_s=1.0,
        started_at=started_at,
    )  # fmt: skip


def roles(split: EvenSplit, peers: list[PeerAnnouncement]) -> dict[str, StageRole | None]:
    return {p.peer_id: split.assign(peers, p.peer_id) for p in peers}


def test_peers_take_stages_in_order_of_start_time_then_id_whatever_the_listing_order():
    peers = [peer("c", 10.0), peer("a", 30.0), peer("b", 10.0), peer("d", 20.0)]
    split = EvenSplit(n_stages=4, n_layers=8)
    want = {
        "b": StageRole(0, 4, 0, 2), "c": StageRole(1, 4, 2, 4), "d": StageRole(2, 4, 4, 6), "a": StageRole(3, 4, 6, 8),
    }  # fmt: skip
    for seed in range(5):
        random.Random(seed).shuffle(peers)
        assert roles(split, peers) == want


@pytest.mark.parametrize("n_layers,n_stages", [(8, 4), (7, 3), (5, 5), (12, 5), (3, 1)])
def test_stages_get_contiguous_slices_that_differ_by_at_most_one_layer(n_layers, n_stages):
    split = EvenSplit(n_stages, n_layers)
    peers = [peer(f"p{i}", float(i)) for i in range(n_stages)]
    got = [split.assign(peers, p.peer_id) for p in peers]
    assert [r.stage for r in got] == list(range(n_stages))
    assert all(r.n_stages == n_stages for r in got)
    assert got[0].layer_start == 0 and got[-1].layer_end == n_layers
    assert all(a.layer_end == b.layer_start for a, b in zip(got[:-1], got[1:], strict=True))
    sizes = [r.layer_end - r.layer_start for r in got]
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # earlier stages take the remainder


def test_with_fewer_peers_than_stages_nobody_is_assigned_yet():
    split = EvenSplit(n_stages=3, n_layers=6)
    peers = [peer("a", 1.0), peer("b", 2.0)]
    assert roles(split, peers) == {"a": None, "b": None}
    peers.append(peer("c", 3.0))
    assert [r.stage for r in roles(split, peers).values()] == [0, 1, 2]


def test_peers_beyond_the_stages_wait_on_standby_and_move_up_when_an_earlier_peer_leaves():
    split = EvenSplit(n_stages=2, n_layers=4)
    peers = [peer("a", 1.0), peer("b", 2.0), peer("c", 3.0), peer("d", 4.0)]
    assert roles(split, peers) == {"a": StageRole(0, 2, 0, 2), "b": StageRole(1, 2, 2, 4), "c": None, "d": None}
    del peers[0]
    assert roles(split, peers) == {"b": StageRole(0, 2, 0, 2), "c": StageRole(1, 2, 2, 4), "d": None}


def test_a_peer_that_has_not_announced_itself_gets_no_stage():
    split = EvenSplit(n_stages=1, n_layers=2)
    assert split.assign([peer("a", 1.0)], "z") is None


def test_a_fixed_stage_is_served_whatever_the_others_announce():
    split = EvenSplit(n_stages=3, n_layers=6, fixed_stage=2)
    assert split.assign([], "a") == StageRole(2, 3, 4, 6)
    assert split.assign([peer("b", 0.0), peer("a", 1.0)], "a") == StageRole(2, 3, 4, 6)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"n_stages": 5, "n_layers": 4}, "cannot split 4 layers into 5 stages"),
        ({"n_stages": 0, "n_layers": 4}, "cannot split"),
        ({"n_stages": 2, "n_layers": 4, "fixed_stage": 2}, "outside 0..1"),
        ({"n_stages": 2, "n_layers": 4, "fixed_stage": -1}, "outside 0..1"),
    ],
)
def test_impossible_splits_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EvenSplit(**kwargs)
