"""--identity keeps a peer's id across restarts, the trust and private-run flags reach DHTConfig on every
command that joins the DHT, and a peer never announces a wildcard address for its stage service."""

from __future__ import annotations

import argparse
import os
import stat

import pytest

from swarm.daemon import bootstrap
from swarm.daemon.addresses import stage_address, stage_announce_host
from swarm.daemon.peer import build_parser as peer_parser
from swarm.daemon.peer import config_from_args as peer_config
from swarm.peers.dht import peer_id_of
from swarm.peers.dht_config import load_or_create_key
from swarm.train import trainer

TRUST_FLAGS = ("--identity", "--trusted-planners", "--run-secret-file", "--trainers")


def _parsers() -> dict[str, argparse.ArgumentParser]:
    boot = argparse.ArgumentParser(prog="swarm bootstrap")
    bootstrap.add_arguments(boot)
    train = argparse.ArgumentParser(prog="swarm train")
    trainer.add_arguments(train)
    return {"swarm-peer": peer_parser(), "swarm bootstrap": boot, "swarm train": train}


@pytest.mark.parametrize("command", ["swarm-peer", "swarm bootstrap", "swarm train"])
def test_every_command_joining_the_dht_has_the_identity_and_trust_flags(command):
    text = _parsers()[command].format_help()
    for flag in TRUST_FLAGS:
        assert flag in text, f"{command} lacks {flag}"


def test_bootstrap_help_tells_the_two_identities_apart():
    text = " ".join(_parsers()["swarm bootstrap"].format_help().split())
    assert "--identity-path" in text and "libp2p" in text and "peer id" in text


def test_an_identity_file_is_created_0600_and_keeps_the_peer_id(tmp_path):
    path = str(tmp_path / "peer.key")
    first = load_or_create_key(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    again = load_or_create_key(path)
    ids = {peer_id_of(k.get_public_key().to_bytes()) for k in (first, again)}
    assert len(ids) == 1


def test_a_malformed_or_unreadable_identity_file_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.key"
    bad.write_bytes(b"not a key")
    with pytest.raises(ValueError, match=f"identity file {bad}: not an RSA private key"):
        load_or_create_key(str(bad))
    with pytest.raises(ValueError, match="identity file .*: cannot create it"):
        load_or_create_key(str(tmp_path / "missing-dir" / "peer.key"))


def test_flags_reach_the_dht_config_and_the_secret_stays_off_the_command_line(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("s3cret\n")
    key = tmp_path / "id.key"
    args = peer_parser().parse_args(
        ["--identity", str(key), "--trusted-planners", "aa,bb", "--trainers", "t1",
         "--run-secret-file", str(secret), "--host", "0.0.0.0", "--announce-host", "10.1.2.3"]
    )  # fmt: skip
    cfg = peer_config(args)
    assert cfg.dht.signing_key_path == str(key) and key.exists()
    assert cfg.dht.trusted_planners == ("aa", "bb") and cfg.dht.allowed_trainers == ("t1",)
    assert cfg.dht.run_secret == "s3cret" and cfg.announce_host == "10.1.2.3"
    assert "s3cret" not in repr(cfg), "the secret is never printed with the config"


def test_bad_secret_and_identity_files_are_named(tmp_path):
    parser = _parsers()["swarm bootstrap"]
    empty = tmp_path / "empty"
    empty.write_text("\n")
    for flags, message in (
        (["--run-secret-file", str(empty)], "--run-secret-file"),
        (["--run-secret-file", str(tmp_path / "nope")], "cannot read"),
        (["--identity", str(empty)], "not an RSA private key"),
    ):
        with pytest.raises(ValueError, match=message):
            bootstrap.bootstrap_flags().from_args(parser.parse_args(flags))


def test_a_wildcard_host_announces_the_outward_address_or_refuses():
    assert stage_announce_host("127.0.0.1") == "127.0.0.1"
    assert stage_announce_host("0.0.0.0", detect=lambda version: "192.0.2.7") == "192.0.2.7"
    assert stage_announce_host("::", detect=lambda version: "2001:db8::7") == "2001:db8::7"
    assert stage_announce_host("0.0.0.0", "198.51.100.1", detect=lambda v: None) == "198.51.100.1"
    with pytest.raises(ValueError, match="--announce-host"):
        stage_announce_host("0.0.0.0", detect=lambda version: None)
    for wildcard in ("0.0.0.0", "::"):
        with pytest.raises(ValueError, match="wildcard"):
            stage_announce_host("0.0.0.0", wildcard)
    with pytest.raises(ValueError, match="IP address"):
        stage_announce_host("0.0.0.0", "example.com")
    assert stage_address("2001:db8::7", 5000) == "[2001:db8::7]:5000"
    assert stage_address("192.0.2.7", 5000) == "192.0.2.7:5000"
