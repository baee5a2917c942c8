"""Issue 28, `swarm stop`: a stop order counts only from a key that may stop the run (the owner or a delegated
trainer of an owned run, a private run's trainers, anyone in an unowned run), proves a private run's secret,
names this run, is not dated in the future nor lives past its bound, and is refused by name otherwise; it is
meant only for peers that started before it was issued."""

from __future__ import annotations

import math

import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils.crypto import RSAPrivateKey

from swarm.peers.dht_config import DHTConfig
from swarm.peers.entries import peer_id_of
from swarm.peers.manifest import RunAuthority
from swarm.peers.stop import MAX_STOP_TTL_S, StopAuthority, StopOrder, issue_stop, stop_authority, stop_orders
from tests.unit.peers.test_manifest import NOW, OWNER, STRANGER, T1, manifest

TRAINER = RSAPrivateKey()


def subkey(key: RSAPrivateKey) -> bytes:
    return RSASignatureValidator(key).local_public_key


def pid(key: RSAPrivateKey) -> str:
    return peer_id_of(key.get_public_key().to_bytes())


class FakeDHT:
    """What the stop functions use of a `SwarmDHT`: its config, key, run documents and one signed key."""

    def __init__(self, config: DHTConfig, key=STRANGER, owned=None, authority=None):
        self.config, self.peer_id, self._key = config, pid(key), key
        self.manifest, self._authority = owned, authority
        self.entries: dict[bytes, tuple[dict, float]] = {}

    def authority(self):
        return self._authority

    def store_signed(self, kind, value, ttl_s):
        assert kind == "stop"
        self.entries[subkey(self._key)] = (value, NOW + ttl_s)
        return True

    def read_signed(self, kind):
        return [(k, v, e) for k, (v, e) in self.entries.items()]


def test_an_order_round_trips_through_the_dht_with_its_signer_from_the_subkey():
    dht = FakeDHT(DHTConfig(run_name="r1"), key=TRAINER)
    issued = issue_stop(dht, "done", issued_at=NOW)
    orders, skipped = stop_orders(dht, now=NOW + 1)
    assert orders == [issued] and not skipped and orders[0].signer == pid(TRAINER) and orders[0].reason == "done"


@pytest.mark.parametrize(
    ("value", "expiration", "match"),
    [
        ({"run": "r2", "issued_at": NOW}, NOW + 60, "for run 'r2'"),
        ({"run": "r1", "issued_at": NOW + 3600}, NOW + 60, "in the future"),
        ({"run": "r1", "issued_at": NOW}, NOW + 10 * MAX_STOP_TTL_S, "past the 600 s bound"),
        ({"run": "r1", "issued_at": math.nan}, NOW + 60, "issued_at"),
        ({"run": "r1", "issued_at": True}, NOW + 60, "issued_at"),
        ({"run": "r1", "issued_at": NOW, "reason": "x" * 500}, NOW + 60, "reason"),
        ({"run": "r1", "issued_at": NOW, "reason": "a\x1b[2Jb"}, NOW + 60, "reason"),
        ({"run": "r1", "issued_at": NOW, "signer": "someone"}, NOW + 60, "expected an object"),
        ({"run": "r1", "issued_at": NOW, "proof": "zz"}, NOW + 60, "proof"),
        (["r1", NOW], NOW + 60, "expected an object"),
    ],
)
def test_a_bad_order_is_skipped_naming_what_is_wrong(value, expiration, match):
    dht = FakeDHT(DHTConfig(run_name="r1"))
    dht.entries[subkey(STRANGER)] = (value, expiration)
    orders, skipped = stop_orders(dht, now=NOW)
    assert not orders and len(skipped) == 1 and match in skipped[0], skipped


def test_an_unsigned_subkey_is_skipped():
    dht = FakeDHT(DHTConfig(run_name="r1"))
    dht.entries[b"anyone"] = ({"run": "r1", "issued_at": NOW}, NOW + 60)
    dht.entries[subkey(STRANGER) + b"#x"] = ({"run": "r1", "issued_at": NOW}, NOW + 60)
    orders, skipped = stop_orders(dht, now=NOW)
    assert not orders and all("no owner public key" in s for s in skipped) and len(skipped) == 2


def test_in_an_owned_run_only_the_owner_and_the_delegated_trainers_may_stop_it():
    owned = manifest(trainers=[pid(TRAINER)])
    dht = FakeDHT(DHTConfig(run_name=owned.run_id), owned=owned)
    authority = stop_authority(dht)
    authority.check(StopOrder(owned.run_id, NOW, signer=pid(OWNER)))
    authority.check(StopOrder(owned.run_id, NOW, signer=pid(TRAINER)))
    with pytest.raises(ValueError, match=f"stop order from {pid(STRANGER)} refused: only its owner or trainers"):
        authority.check(StopOrder(owned.run_id, NOW, signer=pid(STRANGER)))


def test_a_revoked_trainer_may_no_longer_stop_the_run():
    owned = manifest(trainers=[pid(TRAINER)])
    now = RunAuthority(frozenset(), frozenset({T1}), frozenset({pid(TRAINER)}), 2)
    authority = stop_authority(FakeDHT(DHTConfig(run_name=owned.run_id), owned=owned, authority=now))
    with pytest.raises(ValueError, match="refused"):
        authority.check(StopOrder(owned.run_id, NOW, signer=pid(TRAINER)))
    authority.check(StopOrder(owned.run_id, NOW, signer=T1))


def test_a_private_run_takes_its_trainers_orders_with_the_secrets_proof_only():
    config = DHTConfig(run_name="r1", allowed_trainers=(pid(TRAINER),), run_secret="s3cret")
    authority = stop_authority(FakeDHT(config))
    order = StopOrder("r1", NOW, "bye", pid(TRAINER))
    authority.check(order.prove("s3cret"))
    for bad in (order, order.prove("guess"), StopOrder("r1", NOW, "bye!", pid(TRAINER), order.prove("s3cret").proof)):
        with pytest.raises(ValueError, match="does not prove the run secret"):
            authority.check(bad)
    with pytest.raises(ValueError, match="only its trainers"):
        authority.check(StopOrder("r1", NOW, "bye", pid(STRANGER)).prove("s3cret"))
    assert "s3cret" not in repr(authority)


def test_a_stolen_proof_does_not_move_to_another_signer():
    authority = StopAuthority(None, "s3cret")
    proof = StopOrder("r1", NOW, "", pid(TRAINER)).prove("s3cret").proof
    with pytest.raises(ValueError, match="does not prove"):
        authority.check(StopOrder("r1", NOW, "", pid(STRANGER), proof))


def test_an_unowned_open_run_takes_anyones_order():
    authority = stop_authority(FakeDHT(DHTConfig(run_name="r1")))
    assert authority.signers is None
    authority.check(StopOrder("r1", NOW, signer=pid(STRANGER)))


def test_an_order_is_meant_only_for_peers_started_before_it():
    order = StopOrder("r1", NOW)
    assert order.issued_after(NOW - 10) and not order.issued_after(NOW) and not order.issued_after(NOW + 10)


def test_issue_stop_raises_when_no_node_stores_it():
    dht = FakeDHT(DHTConfig(run_name="r1"))
    dht.store_signed = lambda *a: False
    with pytest.raises(RuntimeError, match="no DHT node stored"):
        issue_stop(dht, issued_at=NOW)


def test_issue_stop_proves_the_secret_of_a_private_run():
    dht = FakeDHT(DHTConfig(run_name="r1", run_secret="s3cret"), key=TRAINER)
    order = issue_stop(dht, issued_at=NOW)
    assert order.proves("s3cret") and dht.entries[subkey(TRAINER)][0]["proof"] == order.proof
