"""Remembered validator verdicts (`swarm.peers.verdicts`): a record found valid is not checked again, and any
record that differs in a byte, or was refused, is checked in full."""

from __future__ import annotations

import dataclasses

import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.utils import MSGPackSerializer
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from swarm.peers import entries
from swarm.peers.entries import RunKeys, RunRecordValidator
from swarm.peers.records import MAX_CLOCK_SKEW_S, PeerAnnouncement
from swarm.peers.verdicts import CachedSignatureValidator, VerdictCache

NOW = 1_000_000.0


@pytest.fixture(scope="module")
def signer():
    return CachedSignatureValidator(RSAPrivateKey())


def _announcement(signer, started_at: float = NOW, address: str = "127.0.0.1:5000") -> DHTRecord:
    """A peer's announcement under run "r" as a DHT node stores it: signed by its owner subkey."""
    from swarm.peers.entries import peer_id_of

    owner = signer.local_public_key
    peer_id = peer_id_of(owner[len(b"[owner:") : -1])
    ann = PeerAnnouncement(peer_id, address, "cpu", 1 << 30, 10.0, started_at=started_at)
    record = DHTRecord(
        key=DHTID.generate(source=RunKeys.of_run("r").peers).to_bytes(),
        subkey=MSGPackSerializer.dumps(owner),
        value=MSGPackSerializer.dumps(ann.to_wire()),
        expiration_time=NOW + 60,
    )
    return dataclasses.replace(record, value=signer.sign_value(record))


def _counting(monkeypatch, cls, name):
    calls = []
    real = getattr(cls, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(cls, name, counted)
    return calls


def test_a_valid_signature_is_checked_once_and_any_changed_byte_is_checked_in_full(signer, monkeypatch):
    record = _announcement(signer)
    verified = _counting(monkeypatch, RSAPublicKey, "verify")
    assert signer.validate(record) and signer.validate(record) and signer.validate(dataclasses.replace(record))
    assert len(verified) == 1 and signer.verdicts.hits >= 2
    # the same key and subkey with another value, or the same value to live longer: a forgery, checked and refused
    forged = dataclasses.replace(record, value=record.value.replace(b"127.0.0.1", b"10.66.6.6"))
    assert not signer.validate(forged) and not signer.validate(forged)
    longer = dataclasses.replace(record, expiration_time=record.expiration_time + 3600)
    assert not signer.validate(longer)
    assert len(verified) == 4, "a refused record is checked again each time, never remembered"


def test_the_runs_record_rules_remember_only_records_they_passed(signer, monkeypatch):
    rules = RunRecordValidator(RunKeys.of_run("r"))
    composite = CompositeValidator([signer, rules])  # as a DHT node runs them: signature first, then the rules
    monkeypatch.setattr(entries, "get_dht_time", lambda: NOW)
    parsed = _counting(monkeypatch, entries, "parse_entry")
    record = _announcement(signer)
    assert composite.validate(record) and composite.validate(record)
    assert len(parsed) == 1 and len(rules.verdicts) == 1
    # from the future: refused now, and checked again (and passed) once its time has come
    ahead = _announcement(signer, started_at=NOW + MAX_CLOCK_SKEW_S + 30)
    assert not composite.validate(ahead) and not composite.validate(ahead)
    monkeypatch.setattr(entries, "get_dht_time", lambda: NOW + 60)
    assert composite.validate(ahead)
    assert len(parsed) == 4
    # a malformed value under a run key is refused whatever was remembered before
    junk = dataclasses.replace(record, value=MSGPackSerializer.dumps(b"junk"))
    assert not rules.validate(junk)


def test_the_cache_is_bounded_by_entries_and_bytes():
    def ok(record):
        return True

    def records(n, size=10):
        return [DHTRecord(b"k", bytes([i]), b"v" * size, NOW) for i in range(n)]

    cache = VerdictCache(max_entries=3, max_bytes=1 << 20)
    for r in records(5):
        assert cache.check(r, ok)
    assert len(cache) == 3
    first, *_, last = records(5)
    assert not cache.check(first, lambda r: False), "evicted: checked again"
    assert cache.check(last, lambda r: False), "remembered: not checked"
    small = VerdictCache(max_entries=100, max_bytes=500)
    for r in records(10, size=100):
        small.check(r, ok)
    assert 0 < len(small) <= 500 // 100
    huge = DHTRecord(b"k", b"s", b"v" * 1000, NOW)
    assert small.check(huge, ok) and not small.check(huge, lambda r: False), "too large to remember: not kept"
