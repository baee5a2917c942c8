"""The DHT's record validators check a record they accepted before only once: every peer reads the run's records
twice a second and each read validated every record again. Only the same key, subkey, value (its signature
included) and expiration count as seen; a changed byte is checked anew, and refused records are never remembered."""

from __future__ import annotations

import dataclasses

from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer, get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from swarm.peers.entries import RunKeys, RunRecordValidator, SeenRecords, SigningValidator
from swarm.peers.records import PlanRecord

STAGES = [{"layer_start": 0, "layer_end": 1, "peer_ids": ["a"]}, {"layer_start": 1, "layer_end": 2, "peer_ids": ["b"]}]


def _signed(signer: SigningValidator, value: bytes, subkey: bytes | None = None) -> DHTRecord:
    record = DHTRecord(b"key", subkey if subkey is not None else signer.local_public_key, value, get_dht_time() + 60)
    return dataclasses.replace(record, value=signer.sign_value(record))


def test_a_signed_record_is_verified_once_and_a_changed_or_forged_one_every_time(monkeypatch):
    signer = SigningValidator(RSAPrivateKey())
    record = _signed(signer, b"announcement")
    checks = []
    verify = type(signer).__mro__[1].validate  # hivemind's own check
    monkeypatch.setattr(type(signer).__mro__[1], "validate", lambda self, r: checks.append(r) or verify(self, r))
    assert signer.validate(record) and signer.validate(record) and signer.validate(record)
    assert len(checks) == 1, "an accepted record is verified once"
    later = dataclasses.replace(record, expiration_time=record.expiration_time + 1)
    assert not signer.validate(later), "the signature covers the expiration: not the record seen"
    forged = dataclasses.replace(record, value=record.value.replace(b"announcement", b"announcemenT"))
    assert not signer.validate(forged) and not signer.validate(forged)
    assert len(checks) == 4, "refused records are checked every time, never remembered"
    stranger = SigningValidator(RSAPrivateKey())
    theirs = _signed(stranger, b"announcement")
    assert signer.validate(theirs), "another owner's correctly signed record"


def test_the_run_validator_parses_an_accepted_record_once_and_refuses_a_malformed_one_every_time(monkeypatch):
    keys = RunKeys.of_run("run")
    validator = RunRecordValidator(keys)

    owner = SigningValidator(RSAPrivateKey()).local_public_key
    plan = PlanRecord(version=3, document={"stages": STAGES}, created_at=get_dht_time())
    key = DHTID.generate(source=keys.plan).to_bytes()
    subkey, value = MSGPackSerializer.dumps(owner + b"#3"), MSGPackSerializer.dumps(plan.to_wire())
    good = DHTRecord(key, subkey, value, get_dht_time() + 60)
    parsed = []
    parses = validator._parses
    monkeypatch.setattr(validator, "_parses", lambda kind, r: parsed.append(r) or parses(kind, r))
    assert validator.validate(good) and validator.validate(good)
    assert len(parsed) == 1
    bad = dataclasses.replace(good, value=MSGPackSerializer.dumps({"nonsense": 1}))
    assert not validator.validate(bad) and not validator.validate(bad)
    assert len(parsed) == 3


def test_the_seen_records_are_bounded_least_recently_seen_first():
    seen = SeenRecords(size=2)
    a, b, c = (SeenRecords.digest(DHTRecord(b"k", b"s", v, 1.0)) for v in (b"a", b"b", b"c"))
    seen.add(a)
    seen.add(b)
    assert seen.seen(a)  # a is now the most recently seen
    seen.add(c)
    assert seen.seen(a) and seen.seen(c) and not seen.seen(b)
    assert SeenRecords.digest(DHTRecord(b"k", b"s", b"a", 1.0)) != SeenRecords.digest(DHTRecord(b"ks", b"", b"a", 1.0))
