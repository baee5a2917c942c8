"""`swarm run init/show/delegate/revoke`, and a peer's and a trainer's settings from a manifest file: the
manifest wins, a flag that contradicts it is refused by name. No sockets."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from swarm.daemon import run_cli
from swarm.daemon.run_cli import init_run
from swarm.options import ModelFlags
from swarm.peers.dht_config import DHTConfig
from swarm.peers.manifest import RunAuthority, RunDelegation, RunManifest


def cli(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    run_cli.add_arguments(parser)
    return run_cli.run(parser.parse_args(list(argv)))


@pytest.fixture
def files(tmp_path):
    return init_run(tmp_path / "run", name="unit", model=ModelFlags(layers=2, hidden=32, heads=2), total_steps=50)


def test_init_writes_the_owner_key_a_verified_manifest_and_the_delegated_keys(files):
    m = RunManifest.load(str(files.manifest_path))
    assert m == files.manifest and m.total_steps == 50 and m.model_flags["layers"] == 2
    assert "weights" not in m.model_flags, "local paths stay out of the manifest"
    assert [p.name for p in (*files.planner_keys, *files.trainer_keys)] == ["planner.key", "trainer.key"]
    for key in (files.owner_key, *files.planner_keys, *files.trainer_keys):
        assert os.stat(key).st_mode & 0o777 == 0o600
    with pytest.raises(ValueError, match="already holds a run"):
        init_run(files.dir)


def test_init_from_flags_prints_the_run_id_and_the_commands(tmp_path, capsys):
    toml = tmp_path / "run.toml"
    toml.write_text('name = "from-toml"\nlayers = 3\n')
    assert cli("init", "--out", str(tmp_path / "r"), "--config", str(toml), "--planners", "2") == 0
    out = capsys.readouterr().out
    m = RunManifest.load(str(tmp_path / "r" / "run.json"))
    assert m.name == "from-toml" and m.model_flags["layers"] == 3 and len(m.planners) == 2
    assert f"swarm-peer --run {m.run_id} --initial-peers MADDR" in out
    assert f"swarm train --run {m.run_id} --identity" in out
    assert cli("init", "--out", str(tmp_path / "bad"), "--fw-codec", "nonsense") == 2


def test_init_delegates_existing_ids_instead_of_making_keys(tmp_path):
    made = init_run(tmp_path / "r", planners=("p" * 24,), trainers=("t" * 24,))
    assert made.planner_keys == () and made.trainer_keys == ()
    assert made.manifest.planners == ("p" * 24,) and made.manifest.trainers == ("t" * 24,)


def test_show_verifies_a_manifest_file_and_refuses_a_tampered_one(files, capsys):
    assert cli("show", str(files.manifest_path), "--json") == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["manifest"]["run_id"] == files.run_id and shown["authority"]["sequence"] == 0
    wire = json.loads(files.manifest_path.read_text())
    files.manifest_path.write_text(json.dumps({**wire, "lr": 5.0}))
    assert cli("show", str(files.manifest_path)) == 2
    assert "RunManifest.run_id" in capsys.readouterr().err


def test_delegate_then_revoke_write_the_next_signed_delegations(files, capsys):
    newcomer = "ab" * 12
    assert cli("delegate", str(files.manifest_path), "--planner", newcomer) == 0
    assert cli("revoke", str(files.manifest_path), files.manifest.planners[0]) == 0
    d1 = RunDelegation.from_json((files.dir / "delegation-1.json").read_text())
    d2 = RunDelegation.from_json((files.dir / "delegation-2.json").read_text())
    assert set(d1.planners) == {files.manifest.planners[0], newcomer} and d1.revoked == ()
    assert d2.planners == (newcomer,) and d2.revoked == files.manifest.planners
    assert RunAuthority.of(files.manifest, [d1, d2]).planners == {newcomer}
    assert cli("delegate", str(files.manifest_path), "--planner", files.manifest.planners[0]) == 2
    assert "never accepted again" in capsys.readouterr().err
    assert cli("show", str(files.manifest_path), "--json") == 0
    assert json.loads(capsys.readouterr().out)["authority"]["sequence"] == 2


def test_delegate_refuses_without_the_owner_key(files, capsys):
    os.remove(files.owner_key)
    assert cli("delegate", str(files.manifest_path), "--trainer", "cd" * 12) == 2
    assert "owner key" in capsys.readouterr().err


def test_a_peer_takes_model_codecs_and_schedule_from_the_manifest_file(files):
    from swarm.daemon.peer_config import build_parser, config_from_args

    parser = build_parser()
    cfg = config_from_args(parser.parse_args(["--run", str(files.manifest_path)]))
    assert (cfg.model.n_layers, cfg.model.hidden_dim) == (2, 32)
    assert cfg.optim.total_steps == 50 and cfg.optim.warmup_steps == files.manifest.warmup_steps
    assert cfg.dht.run_name == files.run_id
    with pytest.raises(ValueError, match=r"--total-steps 7 contradicts run .*, which sets 50"):
        config_from_args(parser.parse_args(["--run", str(files.manifest_path), "--total-steps", "7"]))
    with pytest.raises(ValueError, match=r"--fw-codec 'fp32' contradicts"):
        config_from_args(parser.parse_args(["--run", str(files.manifest_path), "--fw-codec", "fp32"]))


def test_a_trainer_takes_its_model_from_the_manifest_file(files):
    from swarm.train.trainer import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cfg = config_from_args(
        parser.parse_args(["--run", str(files.manifest_path), "--identity", str(files.trainer_keys[0])])
    )
    assert cfg.model.n_layers == 2 and cfg.dht.run_name == files.run_id
    with pytest.raises(ValueError, match="--hidden 64 contradicts"):
        config_from_args(parser.parse_args(["--run", str(files.manifest_path), "--hidden", "64"]))


def test_run_refuses_private_run_flags_and_another_run_name(files):
    with pytest.raises(ValueError, match="an owned run's planners and trainers"):
        DHTConfig(run=files.run_id, trusted_planners=("a",))
    with pytest.raises(ValueError, match="keys are under its id"):
        DHTConfig(run=files.run_id, run_name="other")
    assert DHTConfig(run=str(files.manifest_path)).run_name == files.run_id
    with pytest.raises(ValueError, match="manifest .*: cannot read it"):
        DHTConfig(run="no-such-file.json")
