"""An owned run's manifest and delegations: signed by the owner, self-verifying, refused by name when forged,
tampered, foreign, oversized or malformed; the highest valid delegation wins and a revocation holds for good."""

from __future__ import annotations

import json
import random

import pytest
from hivemind.utils.crypto import RSAPrivateKey

from swarm.peers.entries import MANIFEST_SUBKEY, RunKeys, RunRecordValidator, parse_run_entry
from swarm.peers.manifest import (
    MAX_MANIFEST_BYTES,
    RUN_ID_RE,
    AuthorityTracker,
    RunAuthority,
    RunDelegation,
    RunManifest,
)

NOW = 1.7e9
OWNER, STRANGER = RSAPrivateKey(), RSAPrivateKey()
P1, P2, T1, T2 = "a1" * 12, "a2" * 12, "b1" * 12, "b2" * 12


def manifest(owner=OWNER, **changes) -> RunManifest:
    content = dict(
        name="tiny run", created_at=NOW, model={"model": "gpt", "layers": 2, "hidden": 32, "seq-len": 64},
        codecs={"fw_codec": "aqsgd4", "bw_codec": "q8"}, lr=1e-3, warmup_steps=10, total_steps=100,
        planners=[P1], trainers=[T1], data="python docstrings",
    )  # fmt: skip
    return RunManifest.create(owner, **{**content, **changes})


def delegation(m: RunManifest, sequence: int, owner=OWNER, **changes) -> RunDelegation:
    content = dict(planners=[P1], trainers=[T1], revoked=(), created_at=NOW + sequence)
    return RunDelegation.create(owner, m, sequence, **{**content, **changes})


def resigned(wire: dict, key=OWNER) -> dict:
    """`wire` with a valid signature by `key` over its (possibly tampered) content."""
    from swarm.peers.manifest import _MANIFEST_DOMAIN, canonical

    body = {k: v for k, v in wire.items() if k != "signature"}
    return {**body, "signature": key.sign(_MANIFEST_DOMAIN + canonical(body)).decode()}


def test_a_manifest_round_trips_through_its_file_and_its_id_is_a_valid_run_name():
    m = manifest()
    assert RUN_ID_RE.fullmatch(m.run_id)
    assert RunManifest.from_json(m.to_json(), m.run_id) == m
    assert RunManifest.from_json(json.dumps(m.to_wire())) == m, "any JSON layout of the same fields verifies"
    assert m.planners == (P1,) and m.model_flags["layers"] == 2 and m.codec_labels["bw_codec"] == "q8"
    assert manifest().run_id == m.run_id, "the id is a hash of the content: the same content, the same id"
    assert manifest(lr=2e-3).run_id != m.run_id and manifest(owner=STRANGER).run_id != m.run_id


@pytest.mark.parametrize(
    "field, value",
    [("lr", 1.0), ("planners", [P2]), ("trainers", [T1, T2]), ("model", {"layers": 4}), ("name", "other")],
)
def test_a_tampered_field_fails_the_signature_or_the_id(field, value):
    wire = {**manifest().to_wire(), field: value}
    with pytest.raises(ValueError, match=r"RunManifest\.(signature|run_id)"):
        RunManifest.from_wire(wire)


def test_a_tampered_manifest_re_signed_by_a_stranger_is_another_run_not_this_one():
    m = manifest()
    with pytest.raises(ValueError, match=r"run_id: .* does not match"):  # new content: another id
        RunManifest.from_wire(resigned({**m.to_wire(), "planners": [P2]}, STRANGER))
    with pytest.raises(ValueError, match="signature: bad signature"):  # same content, signed by another key
        RunManifest.from_wire(resigned(m.to_wire(), STRANGER))
    stolen = resigned({**m.to_wire(), "owner_key": STRANGER.get_public_key().to_bytes().decode()}, STRANGER)
    with pytest.raises(ValueError, match=r"run_id: .* does not match its content and owner key"):
        RunManifest.from_wire(stolen)
    other = manifest(owner=STRANGER, planners=[P2])
    with pytest.raises(ValueError, match=f"the manifest of run {other.run_id}, not of run {m.run_id}"):
        RunManifest.from_json(other.to_json(), m.run_id)


def test_an_id_that_does_not_match_the_content_is_refused_by_name():
    wire = resigned({**manifest().to_wire(), "run_id": "0" * 32})
    with pytest.raises(ValueError, match=r"RunManifest\.run_id: 0{32} does not match"):
        RunManifest.from_wire(wire)


def test_an_unknown_or_missing_field_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown field 'extra'"):
        RunManifest.from_wire({**manifest().to_wire(), "extra": 1})
    wire = manifest().to_wire()
    del wire["lr"]
    with pytest.raises(ValueError, match=r"RunManifest\.lr: missing"):
        RunManifest.from_wire(wire)


def test_an_oversized_manifest_is_refused_before_it_is_parsed():
    text = manifest().to_json()
    padded = text[:-2] + " " * MAX_MANIFEST_BYTES + "}\n"
    with pytest.raises(ValueError, match=f"more than the {MAX_MANIFEST_BYTES} bound"):
        RunManifest.from_json(padded)
    with pytest.raises(ValueError, match=r"RunManifest\.data: expected a str of at most 1024"):
        manifest(data="x" * 2000)
    with pytest.raises(ValueError, match=r"RunManifest\.planners: expected a list of at most 16"):
        manifest(planners=[f"{i:024x}" for i in range(17)])


@pytest.mark.parametrize(
    "text, match",
    [
        ("", "not JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"name": NaN}', "not JSON"),
        ("[" * 10000, "not JSON"),
        (b"\xff\xfe", "not UTF-8"),
        ('{"name": "x"}', "missing"),
    ],
)
def test_bad_json_is_refused_by_name(text, match):
    with pytest.raises(ValueError, match=match):
        RunManifest.from_json(text)


def test_fuzzed_manifests_raise_value_error_and_nothing_else():
    rng = random.Random(0)
    wire = manifest().to_wire()
    junk = [None, True, -1, 2**70, 1e308, float("inf"), "", "x" * 300, [], {}, [[1]], {"a": {"b": []}}]
    for _ in range(300):
        bad = dict(wire)
        for key in rng.sample(sorted(wire), rng.randint(1, 3)):
            bad[key] = rng.choice(junk)
        with pytest.raises(ValueError):
            RunManifest.from_wire(bad)
    text = manifest().to_json()
    for _ in range(200):  # flipped bytes: not JSON, a bad field, or a bad signature, never another exception
        i = rng.randrange(len(text))
        flipped = text[:i] + chr(rng.randrange(32, 127)) + text[i + 1 :]
        if flipped != text:
            with pytest.raises(ValueError):
                RunManifest.from_json(flipped)


def test_a_weak_owner_key_is_refused():
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    weak = rsa.generate_private_key(public_exponent=65537, key_size=1024).public_key()
    text = weak.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()
    with pytest.raises(ValueError, match=r"owner_key: expected an RSA public key of 2048"):
        RunManifest.from_wire({**manifest().to_wire(), "owner_key": text})


def test_the_highest_valid_delegation_names_the_delegates_and_an_old_one_replayed_changes_nothing():
    m = manifest()
    d1 = delegation(m, 1, planners=[P1, P2], trainers=[T1, T2])
    d2 = delegation(m, 2, planners=[P2], trainers=[T2])
    assert RunAuthority.of(m) == RunAuthority(frozenset({P1}), frozenset({T1}), frozenset(), 0)
    assert RunAuthority.of(m, [d2, d1]).planners == {P2}
    tracker = AuthorityTracker(m)
    assert tracker.update([d2]) and tracker.authority.sequence == 2
    assert not tracker.update([d1]), "an old sequence replayed changes nothing"
    assert not tracker.update([]), "the newest stays known when the DHT no longer shows it"
    assert tracker.authority.planners == {P2} and tracker.newest == d2


def test_a_revoked_id_is_never_accepted_again():
    m = manifest(planners=[P1, P2])
    revoke = delegation(m, 1, planners=[P2], revoked=[P1])
    relist = delegation(m, 2, planners=[P1, P2])  # an owner mistake (or an old tool) lists P1 again
    tracker = AuthorityTracker(m)
    tracker.update([revoke])
    assert tracker.authority.planners == {P2} and P1 in tracker.authority.revoked
    tracker.update([relist])
    assert tracker.authority.sequence == 2 and tracker.authority.planners == {P2}, "revoked for good"
    assert RunAuthority.of(m, [relist], revoked=[P1]).planners == {P2}


def test_a_delegation_from_a_foreign_owner_or_for_another_run_is_refused_by_name():
    m, other = manifest(), manifest(owner=STRANGER)
    with pytest.raises(ValueError, match="this key is not the owner of run"):
        delegation(m, 1, owner=STRANGER)
    foreign = delegation(other, 5, owner=STRANGER, planners=[P2])
    with pytest.raises(ValueError, match=f"for run {other.run_id}, not {m.run_id}"):
        foreign.check_for(m)
    with pytest.raises(ValueError, match=f"for run {other.run_id}, not {m.run_id}"):
        RunAuthority.of(m, [foreign])
    # the stranger's key claiming this run's id: its key and digest do not hash to it
    wire = {**foreign.to_wire(), "run_id": m.run_id}
    with pytest.raises(ValueError, match="signed by a foreign owner"):
        RunDelegation.from_wire(wire)


def test_a_tampered_delegation_fails_its_signature():
    d = delegation(manifest(), 1)
    for field, value in (("planners", [P2]), ("sequence", 9), ("revoked", [P2]), ("created_at", NOW)):
        with pytest.raises(ValueError, match=r"RunDelegation\.signature: bad signature"):
            RunDelegation.from_wire({**d.to_wire(), field: value})
    with pytest.raises(ValueError, match="unknown field 'x'"):
        RunDelegation.from_wire({**d.to_wire(), "x": 1})
    assert RunDelegation.from_json(d.to_json()) == d


def test_dht_entries_of_the_run_verify_against_the_run_id_and_their_subkey():
    m = manifest()
    assert parse_run_entry("manifest", m.run_id, MANIFEST_SUBKEY, m.to_json(), NOW + 60, NOW) == m
    with pytest.raises(ValueError, match="not of run"):
        parse_run_entry("manifest", "f" * 32, MANIFEST_SUBKEY, m.to_json(), NOW + 60, NOW)
    with pytest.raises(ValueError, match="past the 3600 s bound"):
        parse_run_entry("manifest", m.run_id, MANIFEST_SUBKEY, m.to_json(), NOW + 1e6, NOW)
    d = delegation(m, 3)
    assert parse_run_entry("delegations", m.run_id, 3, d.to_json(), NOW + 60, NOW) == d
    with pytest.raises(ValueError, match="is not its subkey"):
        parse_run_entry("delegations", m.run_id, 4, d.to_json(), NOW + 60, NOW)


def test_honest_nodes_refuse_to_store_a_forged_manifest_or_delegation():
    from hivemind.dht.routing import DHTID
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils import MSGPackSerializer, get_dht_time

    m = manifest()
    keys = RunKeys.of_run(m.run_id)
    validator = RunRecordValidator(keys)

    def record(key: str, subkey, value) -> DHTRecord:
        return DHTRecord(
            DHTID.generate(source=key).to_bytes(), MSGPackSerializer.dumps(subkey), MSGPackSerializer.dumps(value),
            get_dht_time() + 600,
        )  # fmt: skip

    assert validator.validate(record(keys.manifest, MANIFEST_SUBKEY, m.to_json()))
    assert not validator.validate(record(keys.manifest, MANIFEST_SUBKEY, manifest(owner=STRANGER).to_json()))
    assert not validator.validate(record(keys.manifest, MANIFEST_SUBKEY, "{}"))
    assert validator.validate(record(keys.delegations, 1, delegation(m, 1).to_json()))
    assert not validator.validate(record(keys.delegations, 1, "garbage"))
    forged = {**delegation(m, 1).to_wire(), "planners": [P2]}
    assert not validator.validate(record(keys.delegations, 1, json.dumps(forged)))


def test_a_reader_takes_the_newest_valid_delegation_past_junk_and_verifies_a_bounded_number():
    from types import SimpleNamespace

    from hivemind.utils import get_dht_time

    from swarm.peers.dht import MAX_RUN_TRIES, SwarmDHT
    from swarm.peers.dht_config import DHTConfig

    m = manifest()
    good, old = delegation(m, 3), delegation(m, 1)

    def reader(entries: dict) -> SwarmDHT:
        dht = SwarmDHT.__new__(SwarmDHT)
        dht.config, dht._warned, dht._keys = DHTConfig(run_name=m.run_id), set(), RunKeys.of_run(m.run_id)
        held = {k: SimpleNamespace(value=v, expiration_time=get_dht_time() + 60) for k, v in entries.items()}
        dht._request = lambda what, submit: SimpleNamespace(value=held)
        return dht

    junk = {seq: "garbage" for seq in range(10, 20)}  # a dishonest node's higher sequence numbers
    assert reader({1: old.to_json(), 3: good.to_json(), **junk})._parse_run("delegations") == [good]
    flood = {seq: "garbage" for seq in range(10, 10 + MAX_RUN_TRIES)}
    assert reader({3: good.to_json(), **flood})._parse_run("delegations") == [], "bounded: gives up, keeps the last"
    assert reader({MANIFEST_SUBKEY: m.to_json()})._parse_run("manifest") == [m]
