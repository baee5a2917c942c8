"""An owned run on a real loopback DHT: a volunteer joins by the run id alone and gets the verified manifest
(and its model), a forged manifest is refused by honest nodes, a stranger with a ground low id and a lease is
not followed, and the owner's delegation reaches every member.

Four SwarmDHT nodes (each a hivemind DHT process) serve the module: the delegated planner (started from the
manifest file), a follower and a stranger (both joined by id) and the trainer. Every wait polls with a deadline;
every node is shut down.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from swarm.compression import CodecConfig
from swarm.daemon.run_cli import RunFiles, init_run
from swarm.options import ModelFlags
from swarm.peers.dht import SwarmDHT, peer_id_of, quiet_hivemind, wait_for
from swarm.peers.dht_config import DHTConfig, load_or_create_key
from swarm.peers.entries import MANIFEST_SUBKEY
from swarm.peers.manifest import RunDelegation, RunManifest
from swarm.peers.records import PeerAnnouncement, TrainerAnnouncement

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

WAIT_S = 20.0


def announcement(dht: SwarmDHT, **changes) -> PeerAnnouncement:
    fields = dict(peer_id=dht.peer_id, address="127.0.0.1:5000", device="cpu", memory_bytes=1 << 30,
                  compute_layers_per_s=10.0, started_at=get_dht_time())  # fmt: skip
    return PeerAnnouncement(**{**fields, **changes})


LOW_ID = 1 / 16
"""A planner's id in the lowest this share of the id space is drawn again: grinding a stranger's key below it would
take 1 / share key generations on average (each 0.1-1 s on a loaded machine); one in the lowest 1/1000 took past
the fixture's 120 s in a suite."""


def ground_key(below: str, tries: int = 2000) -> RSAPrivateKey:
    """A key whose peer id sorts below `below` (a few tries: what a stranger grinds for a minute to go lower)."""
    for _ in range(tries):
        key = RSAPrivateKey()
        if peer_id_of(key.get_public_key().to_bytes()) < below:
            return key
    raise AssertionError(f"no key below {below} in {tries} tries")


def low(peer_id: str) -> bool:
    """Whether a (hex) peer id sorts in the lowest `LOW_ID` of the id space."""
    return int(peer_id[:8], 16) < LOW_ID * 16**8


@dataclasses.dataclass
class Run:
    files: RunFiles
    planner: SwarmDHT
    follower: SwarmDHT
    stranger: SwarmDHT
    trainer: SwarmDHT
    maddrs: tuple[str, ...]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Iterator[Run]:
    quiet_hivemind()
    nodes: list[SwarmDHT] = []
    try:
        for _ in range(20):  # a run whose planner a stranger can undercut in a few tries (LOW_ID)
            files = init_run(tmp_path_factory.mktemp("run"), name="it", model=ModelFlags(layers=2, hidden=32, heads=2))
            planner_key = str(files.planner_keys[0])
            planner = SwarmDHT(DHTConfig(run=str(files.manifest_path), signing_key_path=planner_key))
            if not low(planner.peer_id):
                break
            planner.shutdown()
        nodes.append(planner)
        maddrs = tuple(planner.visible_maddrs())
        joined = DHTConfig(initial_peers=maddrs, run=files.run_id)
        nodes.append(follower := SwarmDHT(joined))
        nodes.append(stranger := SwarmDHT(joined, private_key=ground_key(planner.peer_id)))
        nodes.append(trainer := SwarmDHT(dataclasses.replace(joined, signing_key_path=str(files.trainer_keys[0]))))
        yield Run(files, planner, follower, stranger, trainer, maddrs)
    finally:
        for node in nodes:
            node.shutdown()


def test_a_volunteer_joined_by_id_holds_the_verified_manifest(run: Run):
    assert run.follower.config.run_name == run.files.run_id
    assert run.follower.manifest == run.files.manifest
    assert run.follower.authority().planners == {run.planner.peer_id}


def test_swarm_peer_run_id_takes_its_model_from_the_manifest_and_refuses_a_contradicting_flag(run: Run):
    from swarm.daemon.peer_config import build_parser, config_from_args

    parser = build_parser()
    argv = ["--run", run.files.run_id, "--initial-peers", *run.maddrs]
    cfg = config_from_args(parser.parse_args(argv))
    assert (cfg.model.n_layers, cfg.model.hidden_dim, cfg.model.n_heads) == (2, 32, 2)
    labels = run.files.manifest.codec_labels
    assert (cfg.fw_codec, cfg.bw_codec) == (
        CodecConfig.parse(labels["fw_codec"]),
        CodecConfig.parse(labels["bw_codec"]),
    )
    assert cfg.optim.lr_peak == run.files.manifest.lr and cfg.dht.run_name == run.files.run_id
    with pytest.raises(ValueError, match=r"--layers 7 contradicts run .* manifest, which sets 2"):
        config_from_args(parser.parse_args([*argv, "--layers", "7"]))
    same = config_from_args(parser.parse_args([*argv, "--layers", "2"]))  # agreeing with it is fine
    assert same.model == cfg.model


def test_honest_nodes_refuse_a_forged_manifest_and_readers_keep_the_real_one(run: Run):
    forged = RunManifest.create(
        RSAPrivateKey(), name="forged", created_at=1.0, model={"layers": 9}, codecs={"fw_codec": "fp32",
        "bw_codec": "fp32"}, lr=1.0, warmup_steps=0, total_steps=1, planners=[run.stranger.peer_id], trainers=[],
    )  # fmt: skip
    assert not run.stranger._store(run.stranger._keys.manifest, MANIFEST_SUBKEY, forged.to_json(), 1800.0)
    assert not run.stranger._store(run.stranger._keys.manifest, MANIFEST_SUBKEY, "{}", 1800.0)
    assert run.follower.fetch_manifest() == run.files.manifest


def test_a_stranger_with_a_ground_low_id_and_a_lease_is_not_followed(run: Run, caplog):
    planner, stranger, follower = run.planner, run.stranger, run.follower
    assert stranger.peer_id < planner.peer_id
    planner.announce(announcement(planner))
    stranger.planner_until = get_dht_time() + 30.0
    stranger.announce(announcement(stranger))
    stranger.announce(TrainerAnnouncement(stranger.peer_id, started_at=get_dht_time()))
    one_stage = lambda pid, **extra: {"stages": [{"layer_start": 0, "layer_end": 2, "peer_ids": [pid]}], **extra}
    assert planner.publish_plan(1, one_stage(planner.peer_id))
    assert stranger.publish_plan(50, one_stage(stranger.peer_id, trainer_ids=[stranger.peer_id]))
    wait_for(lambda: len(follower.peers()) >= 2 and len(follower._parse_all(follower._keys.plan, "plan")) >= 2, WAIT_S)
    with caplog.at_level(logging.WARNING, logger="swarm.peers.dht"):
        for _ in range(3):
            got = follower.get_plan(2, check_trainers=False)
            assert got is not None and got.version == 1 and got.document.place_of(planner.peer_id) is not None
    refused = [r.getMessage() for r in caplog.records if f"refusing plan 50 from {stranger.peer_id}" in r.getMessage()]
    assert len(refused) == 1, "named once, not once per poll"
    assert stranger.peer_id not in [t.peer_id for t in follower.trainers()]


def test_a_swarm_peer_joined_by_the_run_id_alone_serves_the_manifests_model(run: Run, tmp_path):
    from swarm.model.spec import model_identity
    from swarm.testbed.procs import ProcessGroup, peer_command
    from tests.integration.test_churn_peers import status_of, wait_until

    argv = ["--run", run.files.run_id, "--initial-peers", *run.maddrs, "--compute-speed", "50", "--reach", "direct"]
    with ProcessGroup(tmp_path / "logs") as procs:
        procs.start("volunteer", peer_command(*argv, "--threads", "1", "--no-link-probe"))  # no model flag at all
        mine = {run.planner.peer_id, run.stranger.peer_id}

        def announced():
            procs.check_alive()
            return next((p for p in run.planner.peers() if p.peer_id not in mine), None)

        volunteer = wait_until("the volunteer's announcement", announced, 90, procs)
        run.planner.announce(announcement(run.planner))
        stage = {"layer_start": 0, "layer_end": 2, "peer_ids": [volunteer.peer_id]}  # the manifest's 2 layers
        assert run.planner.publish_plan(2, {"stages": [stage]})
        # a peer with the default model (4 layers) would refuse this plan as not covering its model
        serving = lambda: "serving stage 0 of 1, layers [0, 2)" in procs.tail("volunteer", 200)
        wait_until("the volunteer serves the manifest's model", serving, 60, procs)
        expected = model_identity(ModelFlags(**_model_kwargs(run.files.manifest)).build())
        assert status_of(None, volunteer.address, volunteer.peer_id).model_identity == expected
        assert f"owned run {run.files.run_id}" in procs.tail("volunteer", 400)


def _model_kwargs(manifest: RunManifest) -> dict:
    return {key.replace("-", "_"): value for key, value in manifest.model}


def test_the_owners_delegation_reaches_every_member_and_an_old_one_replayed_changes_nothing(run: Run):
    owner = load_or_create_key(str(run.files.owner_key))
    m = run.files.manifest
    second = peer_id_of(RSAPrivateKey().get_public_key().to_bytes())
    d1 = RunDelegation.create(owner, m, 1, planners=[*m.planners, second], trainers=m.trainers, created_at=1.0)
    d2 = RunDelegation.create(owner, m, 2, planners=[second], trainers=m.trainers, revoked=m.planners, created_at=2.0)
    assert run.trainer.publish_delegation(d2)
    wait_for(lambda: run.follower.authority(max_age_s=0.0).sequence == 2, WAIT_S, what="delegation 2 seen")
    assert run.follower.authority().planners == {second} and run.planner.peer_id in run.follower.authority().revoked
    assert run.trainer.publish_delegation(d1)  # an old one, replayed
    assert run.follower.authority(max_age_s=0.0).sequence == 2
    wait_for(lambda: run.planner.authority(max_age_s=0.0).sequence == 2, WAIT_S, what="the planner sees it too")
    assert run.planner.planners() == (second,), "the revoked planner itself stops planning"


def test_swarm_run_show_verifies_a_run_fetched_by_id(run: Run, capsys):
    from swarm.daemon import run_cli

    parser = argparse.ArgumentParser()
    run_cli.add_arguments(parser)
    args = parser.parse_args(["show", run.files.run_id, "--initial-peers", *run.maddrs, "--json"])
    assert run_cli.run(args) == 0
    import json

    shown = json.loads(capsys.readouterr().out)
    assert shown["manifest"]["run_id"] == run.files.run_id
    assert Path(run.files.manifest_path).exists()


def test_a_peer_of_an_unowned_run_says_once_that_anyone_can_take_its_planning_over(run: Run, tmp_path):
    from swarm.testbed.procs import ProcessGroup, peer_command
    from tests.integration.test_churn_peers import wait_until

    argv = ["--run-name", "unowned-test", "--initial-peers", *run.maddrs, "--compute-speed", "50", "--reach", "direct"]
    with ProcessGroup(tmp_path / "logs") as procs:
        procs.start("peer", peer_command(*argv, "--threads", "1", "--assign", "even", "--num-stages", "1"))
        wait_until("the peer serves", lambda: "ready" in procs.tail("peer", 200), 90, procs)
        assert procs.tail("peer", 400).count("this run is unowned: any peer can take over its planning") == 1


def test_swarm_run_revoke_publishes_the_next_delegation_above_the_runs_newest(run: Run):
    from swarm.daemon import run_cli

    parser = argparse.ArgumentParser()
    run_cli.add_arguments(parser)
    before = run.follower.authority(max_age_s=0.0).sequence  # delegations published without files (above)
    victim = next(iter(run.files.manifest.trainers))
    args = parser.parse_args(["revoke", str(run.files.manifest_path), victim, "--initial-peers", *run.maddrs])
    assert run_cli.run(args) == 0
    wait_for(lambda: run.follower.authority(max_age_s=0.0).sequence == before + 1, WAIT_S, what="the revocation")
    now = run.follower.authority()
    assert victim in now.revoked and victim not in now.trainers
    assert run.planner.peer_id in now.revoked, "earlier revocations are kept"
    assert victim not in [t.peer_id for t in run.follower.trainers()]


def test_swarm_train_with_a_key_the_owner_did_not_delegate_stops_at_once_naming_it(run: Run, tmp_path, capsys):
    from swarm.train.trainer import add_arguments
    from swarm.train.trainer import run as train

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    key = str(tmp_path / "stranger.key")
    args = parser.parse_args(["--run", run.files.run_id, "--identity", key, "--initial-peers", *run.maddrs])
    assert train(args) == 2
    assert f"is not a trainer of run {run.files.run_id}" in capsys.readouterr().err
