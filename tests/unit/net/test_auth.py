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
