"""The planner lease on a peer's announcement is validated like every other field, and bounded: a lease that
reaches far into the future (which would keep a dead or hostile holder elected) is refused by readers and by
honest DHT nodes."""

from __future__ import annotations

import pytest

from swarm.peers.entries import parse_entry, peer_id_of
from swarm.peers.records import MAX_CLOCK_SKEW_S, MAX_PLANNER_LEASE_S, PeerAnnouncement

NOW = 1_000_000.0


def _signed(planner_until) -> tuple[bytes, dict]:
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.utils.crypto import RSAPrivateKey

    key = RSAPrivateKey()
    owner = RSASignatureValidator(key).local_public_key
    ann = PeerAnnouncement(peer_id_of(key.get_public_key().to_bytes()), "127.0.0.1:5000", "cpu", 1, 1.0)
    return owner, {**ann.to_wire(), "planner_until": planner_until}


def test_a_lease_within_the_bound_is_taken():
    subkey, value = _signed(NOW + 3.0)
    assert parse_entry("peers", subkey, value, expiration=NOW + 30, now=NOW).planner_until == NOW + 3.0


@pytest.mark.parametrize("ahead", [MAX_PLANNER_LEASE_S + MAX_CLOCK_SKEW_S + 1, 3600.0, 1e9])
def test_an_oversized_lease_is_refused(ahead):
    subkey, value = _signed(NOW + ahead)
    with pytest.raises(ValueError, match="planner_until"):
        parse_entry("peers", subkey, value, expiration=NOW + 30, now=NOW)


@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf"), True, "soon", None, [1.0], 1e12])
def test_a_forged_lease_field_is_named(value):
    subkey, wire = _signed(value)
    with pytest.raises(ValueError, match=r"PeerAnnouncement\.planner_until"):
        parse_entry("peers", subkey, wire, expiration=NOW + 30, now=NOW)


def test_an_announcement_without_a_lease_never_led():
    subkey, wire = _signed(0.0)
    del wire["planner_until"]  # an older peer
    assert parse_entry("peers", subkey, wire, expiration=NOW + 30, now=NOW).planner_until == 0.0
