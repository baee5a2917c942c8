"""PeerAnnouncement's reach and relay fields: they survive the wire, and every inconsistent pair is refused by
name (a record read from the DHT decides where callers send their bytes)."""

from __future__ import annotations

import msgpack
import pytest

from swarm.peers.records import PeerAnnouncement

PEER_A, PEER_B = "ae7e50550f71764ff7dbb770", "a350c96e50acc97af69b165b"


def announcement(**changes) -> PeerAnnouncement:
    fields = dict(peer_id=PEER_A, address="127.0.0.1:5000", device="cpu", memory_bytes=1 << 30)
    fields["compute_layers_per_s"] = 9.0
    return PeerAnnouncement(**{**fields, **changes})


def test_reach_and_relay_round_trip_and_default_to_direct():
    relayed = announcement(reach="relay", relay=PEER_B)
    wire = msgpack.unpackb(msgpack.packb(relayed.to_wire()))
    assert PeerAnnouncement.from_wire(wire) == relayed
    old = {k: v for k, v in announcement().to_wire().items() if k not in ("reach", "relay")}  # an older peer's
    assert PeerAnnouncement.from_wire(old).reach == "direct" and PeerAnnouncement.from_wire(old).relay is None


@pytest.mark.parametrize(
    "changes,field",
    [
        (dict(reach="nat"), "reach"),
        (dict(reach=1), "reach"),
        (dict(reach="relay"), "relay"),  # no relay named
        (dict(reach="relay", relay=PEER_A), "relay"),  # itself
        (dict(reach="relay", relay="bad id!"), "relay"),
        (dict(reach="relay", relay=["x"]), "relay"),
        (dict(relay=PEER_B), "relay"),  # a relay while direct
    ],
)
def test_inconsistent_reach_is_refused_by_name(changes, field):
    with pytest.raises(ValueError, match=rf"PeerAnnouncement\.{field}"):
        PeerAnnouncement.from_wire({**announcement().to_wire(), **changes})
