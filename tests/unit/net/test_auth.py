"""Call tokens: a valid token names its caller; every way of getting one wrong is refused with a message that
says which; verified tokens are remembered (bounded), and signers renew theirs at half their lifetime."""

from __future__ import annotations

import time

import pytest

from swarm.net import auth
from swarm.net.auth import TOKEN_KEY, AuthError, CallSigner, CallVerifier, Identity
from swarm.peers.dht import peer_id_of


@pytest.fixture(scope="module")
def alice() -> Identity:
    return Identity.generate()


@pytest.fixture(scope="module")
def bob() -> Identity:
    return Identity.generate()


def refused(verifier: CallVerifier, metadata, match: str) -> None:
    with pytest.raises(AuthError, match=match):
        verifier.caller(metadata)


def test_identity_peer_id_is_the_key_hash_and_load_keeps_it(tmp_path, alice):
    assert alice.peer_id == peer_id_of(alice.key.get_public_key().to_bytes())
    path = str(tmp_path / "id.key")
    first = Identity.load(path)
    assert (tmp_path / "id.key").stat().st_mode & 0o777 == 0o600
    assert Identity.load(path).peer_id == first.peer_id != alice.peer_id


def test_valid_token_names_the_caller(alice, bob):
    md = CallSigner(alice).metadata(bob.peer_id)
    assert md[0][0] == TOKEN_KEY and isinstance(md[0][1], bytes)
    # gRPC hands metadata over as (key, value) pairs among others
    assert CallVerifier(bob.peer_id).caller([("user-agent", "x"), *md]) == alice.peer_id


def test_missing_and_duplicate_tokens_are_refused(alice, bob):
    verifier = CallVerifier(bob.peer_id)
    refused(verifier, None, "missing call token")
    refused(verifier, [("other", b"x")], "missing call token")
    md = CallSigner(alice).metadata(bob.peer_id)
    refused(verifier, [*md, *md], "2 call tokens")


def test_expired_token_is_refused(alice, bob):
    token = CallSigner(alice, ttl_s=10).token(bob.peer_id, now=time.time() - 100)
    refused(CallVerifier(bob.peer_id), [(TOKEN_KEY, token)], "expired")


def test_cached_token_is_refused_once_expired(alice, bob):
    verifier = CallVerifier(bob.peer_id)
    md = [(TOKEN_KEY, CallSigner(alice, ttl_s=10).token(bob.peer_id))]
    assert verifier.caller(md) == alice.peer_id
    with pytest.raises(AuthError, match="expired"):
        verifier.caller(md, now=time.time() + 60)


def test_token_from_the_future_is_refused(alice, bob):
    token = CallSigner(alice).token(bob.peer_id, now=time.time() + 3000)
    refused(CallVerifier(bob.peer_id), [(TOKEN_KEY, token)], "in the future")


def test_wrong_audience_is_refused(alice, bob):
    md = CallSigner(alice).metadata(alice.peer_id)  # a token for another callee, replayed to bob
    refused(CallVerifier(bob.peer_id), md, "wrong audience")


@pytest.mark.parametrize("where", ["key", "audience", "times", "signature"])
def test_tampered_token_is_refused(alice, bob, where):
    token = bytearray(CallSigner(alice).token(bob.peer_id))
    key_len = len(alice.public_key)
    offset = {"key": 6 + key_len // 2, "audience": 6 + key_len + 1 + 3, "times": 6 + key_len + 26, "signature": -10}
    token[offset[where]] ^= 0x01
    with pytest.raises(AuthError, match="bad signature|wrong audience|valid RSA public key|lifetime|expired"):
        CallVerifier(bob.peer_id).caller([(TOKEN_KEY, bytes(token))])


def test_key_swapped_for_another_is_refused(alice, bob):
    """Mallory keeps Alice's signature but names her own key: the signature no longer verifies."""
    mallory = Identity.generate()
    token = CallSigner(alice).token(bob.peer_id)
    forged = token.replace(alice.public_key, mallory.public_key)
    refused(CallVerifier(bob.peer_id), [(TOKEN_KEY, forged)], "bad signature")


@pytest.mark.parametrize("token", [b"", b"swt1" + b"\0" * 100, b"x" * 50, "text"])  # swt1: the token before delegation
def test_unknown_format_is_refused(bob, token):
    refused(CallVerifier(bob.peer_id), [(TOKEN_KEY, token)], "unknown token format")


@pytest.mark.parametrize("cut", [6, 40, 300])
def test_truncated_token_is_refused(alice, bob, cut):
    token = CallSigner(alice).token(bob.peer_id)[:cut]
    refused(CallVerifier(bob.peer_id), [(TOKEN_KEY, token)], "malformed token")


def test_oversized_metadata_is_refused_unparsed(bob):
    refused(CallVerifier(bob.peer_id), [(TOKEN_KEY, b"swt1" + b"\0" * 10_000)], "exceeds 4096")


def test_overlong_lifetime_is_refused(alice, bob, monkeypatch):
    signer = CallSigner(alice)
    signer.ttl_s = 10 * auth.MAX_TTL_S  # what a hostile signer could write; the constructor refuses it
    refused(CallVerifier(bob.peer_id), [(TOKEN_KEY, signer.token(bob.peer_id))], "lifetime")
    with pytest.raises(ValueError, match="ttl_s"):
        CallSigner(alice, ttl_s=10 * auth.MAX_TTL_S)


def test_run_secret_is_required_and_checked(alice, bob):
    private = CallVerifier(bob.peer_id, run_secret="s3cret")
    assert private.caller(CallSigner(alice, run_secret="s3cret").metadata(bob.peer_id)) == alice.peer_id
    refused(private, CallSigner(alice).metadata(bob.peer_id), "run secret")
    refused(private, CallSigner(alice, run_secret="guess").metadata(bob.peer_id), "run secret")
    # a public run ignores the proof of a secret
    assert CallVerifier(bob.peer_id).caller(CallSigner(alice, run_secret="x").metadata(bob.peer_id)) == alice.peer_id


def test_secret_mac_cannot_be_moved_to_another_token(alice, bob):
    """The mac covers the body and the signature covers the mac: neither can be swapped in."""
    with_secret = CallSigner(alice, run_secret="s3cret").token(bob.peer_id)
    mallory = Identity.generate()
    without = CallSigner(mallory).token(bob.peer_id)
    # graft: mallory's body and signature with alice's mac length and mac: the signature fails
    body_len = int.from_bytes(without[4:6], "big")
    a_body_len = int.from_bytes(with_secret[4:6], "big")
    alice_mac = with_secret[6 + a_body_len : 6 + a_body_len + 33]
    grafted = without[: 6 + body_len] + alice_mac + without[6 + body_len + 1 :]
    refused(CallVerifier(bob.peer_id, run_secret="s3cret"), [(TOKEN_KEY, grafted)], "run secret|bad signature")


def test_verifier_checks_rsa_once_per_token_and_its_cache_is_bounded(alice, bob, monkeypatch):
    verifier = CallVerifier(bob.peer_id, cache_size=3)
    checks = []
    real = CallVerifier._verify
    monkeypatch.setattr(CallVerifier, "_verify", lambda self, t, now: checks.append(1) or real(self, t, now))
    signer = CallSigner(alice)
    md = signer.metadata(bob.peer_id)
    for _ in range(5):
        assert verifier.caller(md) == alice.peer_id
    assert len(checks) == 1
    for _ in range(10):
        verifier.caller([(TOKEN_KEY, signer.token(bob.peer_id))])
    assert len(verifier._cache) == 3
    assert len(checks) == 11


def test_signer_caches_per_audience_and_renews_at_half_life(alice, bob, monkeypatch):
    signer = CallSigner(alice, ttl_s=100)
    clock = [1000.0]
    monkeypatch.setattr(auth.time, "monotonic", lambda: clock[0])
    first = signer.metadata(bob.peer_id)
    assert signer.metadata(bob.peer_id) is first
    assert signer.metadata(alice.peer_id) != first
    clock[0] += 49
    assert signer.metadata(bob.peer_id) is first
    clock[0] += 2
    assert signer.metadata(bob.peer_id) != first


# ---- call proofs: each call bound to its callee, method and fields, once -----------------------------------------

STEP = "/swarm.Stage/Step"


def test_a_call_with_its_proof_is_served_once(alice, bob):
    verifier, request = CallVerifier(bob.peer_id), b"step 7"
    md = CallSigner(alice).metadata(bob.peer_id, STEP, request)
    assert {key for key, _ in md} == {TOKEN_KEY, auth.PROOF_KEY}
    assert verifier.call(md, STEP, request) == alice.peer_id
    with pytest.raises(AuthError, match="replayed call"):
        verifier.call(md, STEP, request)
    assert verifier.caller(md) == alice.peer_id, "the token alone still names the caller (the relay's own calls)"


def test_a_captured_proof_is_refused_for_another_method_fields_or_callee(alice, bob):
    verifier, signer = CallVerifier(bob.peer_id), CallSigner(alice)
    forward = signer.metadata(bob.peer_id, "/swarm.Stage/Forward", b"first item")
    with pytest.raises(AuthError, match="bad call proof"):
        verifier.call(forward, STEP, b"first item")  # a Forward turned into a Step
    step = signer.metadata(bob.peer_id, STEP, b"step 7")
    with pytest.raises(AuthError, match="bad call proof"):
        verifier.call(step, STEP, b"step 7, abandon")  # the same method with other fields
    token = signer.metadata(bob.peer_id)
    for_carol = signer.proof("carol", STEP, b"step 7")  # a proof made for another callee, beside bob's token
    with pytest.raises(AuthError, match="bad call proof"):
        verifier.call((*token, (auth.PROOF_KEY, for_carol)), STEP, b"step 7")
    mallory = CallSigner(Identity.generate())  # another caller's proof beside alice's token
    theirs = mallory.proof(bob.peer_id, STEP, b"step 7")
    with pytest.raises(AuthError, match="bad call proof"):
        verifier.call((*token, (auth.PROOF_KEY, theirs)), STEP, b"step 7")
    assert verifier.call(signer.metadata(bob.peer_id, STEP, b"step 7"), STEP, b"step 7") == alice.peer_id


def test_protobuf_fields_are_digested_as_they_travel(alice, bob):
    from swarm.proto import stage_pb2

    request = stage_pb2.StepRequest(step=3, abandon=True, attempt_id=9)
    md = CallSigner(alice).metadata(bob.peer_id, STEP, request)
    parsed = stage_pb2.StepRequest.FromString(request.SerializeToString())  # what the callee holds
    assert CallVerifier(bob.peer_id).call(md, STEP, parsed) == alice.peer_id
    assert auth.call_digest(request.SerializeToString()) == auth.call_digest(parsed)


@pytest.mark.parametrize(
    ("offset_s", "match"),
    [
        (-(auth.FRESH_S + auth.CLOCK_SKEW_S) - 5, "stale call proof"),
        (auth.CLOCK_SKEW_S + 5, "in the future"),
        (float("nan"), "not a time"),
        (float("inf"), "not a time"),
    ],
)
def test_a_proof_outside_the_window_is_refused(alice, bob, offset_s, match):
    now = time.time()
    md = CallSigner(alice).metadata(bob.peer_id, STEP, b"x", now=now + offset_s)
    with pytest.raises(AuthError, match=match):
        CallVerifier(bob.peer_id).call(md, STEP, b"x", now=now)


def test_a_proof_within_the_window_and_the_skew_is_served(alice, bob):
    now, verifier, signer = time.time(), CallVerifier(bob.peer_id), CallSigner(alice)
    for offset_s in (-(auth.FRESH_S + auth.CLOCK_SKEW_S) + 1, auth.CLOCK_SKEW_S - 1, 0.0):
        assert verifier.call(signer.metadata(bob.peer_id, STEP, b"x", now=now + offset_s), STEP, b"x", now=now)


def test_missing_duplicate_or_malformed_proofs_are_refused(alice, bob):
    verifier, signer = CallVerifier(bob.peer_id), CallSigner(alice)
    token = signer.metadata(bob.peer_id)
    with pytest.raises(AuthError, match="missing call proof"):
        verifier.call(token, STEP, b"x")
    md = signer.metadata(bob.peer_id, STEP, b"x")
    with pytest.raises(AuthError, match="2 call proofs"):
        verifier.call((*md, md[1]), STEP, b"x")
    for bad in (b"", b"swp1" + bytes(10), b"swp9" + md[1][1][4:], md[1][1] + b"\0"):
        with pytest.raises(AuthError, match="malformed call proof"):
            verifier.call((*token, (auth.PROOF_KEY, bad)), STEP, b"x")
    proof = bytearray(md[1][1])
    proof[-1] ^= 1  # the signature
    with pytest.raises(AuthError, match="bad call proof"):
        verifier.call((*token, (auth.PROOF_KEY, bytes(proof))), STEP, b"x")


def test_a_proof_does_not_stand_in_for_the_run_secret(alice, bob):
    private = CallVerifier(bob.peer_id, run_secret="s3cret")
    with pytest.raises(AuthError, match="run secret"):
        private.call(CallSigner(alice).metadata(bob.peer_id, STEP, b"x"), STEP, b"x")
    assert private.call(CallSigner(alice, run_secret="s3cret").metadata(bob.peer_id, STEP, b"x"), STEP, b"x")


def test_concurrent_copies_of_one_call_are_served_once(alice, bob):
    import threading

    verifier = CallVerifier(bob.peer_id)
    md = CallSigner(alice).metadata(bob.peer_id, STEP, b"x")
    verifier.caller(md)  # the token verified: the race is on the proof alone
    served, start = [], threading.Barrier(8)

    def send() -> None:
        start.wait(timeout=10)
        try:
            served.append(verifier.call(md, STEP, b"x"))
        except AuthError:
            pass

    threads = [threading.Thread(target=send) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert served == [alice.peer_id]


def test_the_delegate_key_is_renewed_with_the_tokens_and_old_tokens_proofs_still_verify(alice, bob, monkeypatch):
    signer, verifier = CallSigner(alice, ttl_s=100), CallVerifier(bob.peer_id)
    clock = [1000.0]
    monkeypatch.setattr(auth.time, "monotonic", lambda: clock[0])
    first = signer.metadata(bob.peer_id, STEP, b"a")
    clock[0] += 51  # past half the lifetime: a new token naming a new delegate
    second = signer.metadata(bob.peer_id, STEP, b"b")
    assert first[0] != second[0]
    assert auth._parse(first[0][1]).delegate != auth._parse(second[0][1]).delegate
    assert verifier.call(first, STEP, b"a") == verifier.call(second, STEP, b"b") == alice.peer_id
    # a proof under the new delegate beside the old token does not verify
    with pytest.raises(AuthError, match="bad call proof"):
        verifier.call((first[0], second[1]), STEP, b"b")


# ---- the replay cache: bounded, never lets a nonce through twice ------------------------------------------------


def test_the_replay_cache_stays_bounded_under_a_flood_and_never_admits_a_nonce_twice():
    cache, now = auth.ReplayCache(capacity=100, retain_s=120.0), 1000.0
    admitted = []
    for i in range(5000):  # a flood of fresh nonces, 10 per simulated ms
        nonce, ts = i.to_bytes(16, "big"), now + i / 10_000
        cache.admit(nonce, ts, now + i / 10_000)
        admitted.append((nonce, ts))
        assert len(cache) <= 100
    later = now + 0.5
    for nonce, ts in admitted:  # every one of them, sent again: remembered, or older than the cache covers
        with pytest.raises(AuthError, match="replayed call|older than"):
            cache.admit(nonce, ts, later)
    cache.admit(b"honest".ljust(16, b"\0"), later, later)  # a fresh call is still served


def test_the_replay_cache_forgets_nonces_once_their_window_is_over():
    cache = auth.ReplayCache(capacity=100, retain_s=10.0)
    cache.admit(b"a" * 16, 100.0, 100.0)
    cache.admit(b"b" * 16, 105.0, 105.0)
    cache.admit(b"c" * 16, 111.0, 111.0)  # a's window (100 + 10) is over: forgotten
    assert len(cache) == 2
    with pytest.raises(AuthError, match="replayed call"):
        cache.admit(b"b" * 16, 105.0, 111.0)


def test_a_verifier_refuses_an_old_replay_after_the_cache_forgot_it(alice, bob):
    verifier, now = CallVerifier(bob.peer_id), time.time()
    md = CallSigner(alice).metadata(bob.peer_id, STEP, b"x", now=now)
    verifier.call(md, STEP, b"x", now=now)
    late = now + auth.FRESH_S + auth.CLOCK_SKEW_S + 1  # the nonce is forgotten, and the proof is stale
    with pytest.raises(AuthError, match="stale call proof"):
        verifier.call(md, STEP, b"x", now=late)


def test_a_verifier_under_a_flood_of_signed_calls_stays_bounded_and_still_refuses_replays(alice, bob):
    verifier, signer = CallVerifier(bob.peer_id, replay_cache_size=50), CallSigner(alice)
    flood = [signer.metadata(bob.peer_id, STEP, b"x") for _ in range(200)]
    for md in flood:
        verifier.call(md, STEP, b"x")
    assert len(verifier.replays) == 50
    for md in (flood[0], flood[120], flood[-1]):  # forgotten or remembered, each is refused
        with pytest.raises(AuthError, match="replayed call|older than"):
            verifier.call(md, STEP, b"x")
    assert verifier.call(signer.metadata(bob.peer_id, STEP, b"x"), STEP, b"x") == alice.peer_id
