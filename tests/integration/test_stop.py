"""Issue 28, "Stop and leave": `swarm stop` stops an owned run's peers, each with a final checkpoint of its own
layers and nothing handed over, while a stranger's order (refused by the command, and, stored behind its back,
by every peer) stops nothing.

One loopback swarm (a bootstrap node and 2 peers of an owned run, 2 stages) trains 2 steps; then a stranger tries
to stop it both ways, then the owner does. Every wait is on a condition with a deadline; every process is reaped.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest

from swarm.cli import main
from swarm.daemon.run_cli import init_run
from swarm.model.data import DataConfig, build_datasets, epoch_batches
from swarm.options import MODEL_FLAGS, ModelFlags
from swarm.peers.dht import SwarmDHT
from swarm.peers.dht_config import DHTConfig, load_or_create_key
from swarm.peers.stop import issue_stop
from swarm.runtime.driver import PipelineDriver
from swarm.testbed.local import local_swarm

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

MODEL = ModelFlags(layers=2, hidden=32, heads=2, seq_len=16)


def swarm_stop(capsys, address_file, run_id: str, key, *extra: str) -> tuple[int, str]:
    """`swarm stop --json` in this process (a second interpreter's start-up costs half a minute on a busy
    machine): its exit code and what it printed."""
    argv = ["stop", "--address-file", str(address_file), "--run", run_id, "--identity", str(key), "--json", *extra]
    capsys.readouterr()
    code = main(argv)
    return code, capsys.readouterr().out


def wait_for_line(procs, names: list[str], text: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(text in procs.tail(n, 10_000) for n in names):
        assert time.monotonic() < deadline, f"{text!r} not logged by all of {names}"
        time.sleep(0.2)  # polling the logs; the lines are what synchronize


def test_the_owner_stops_the_run_each_peer_saves_its_own_layers_and_a_stranger_stops_nothing(tmp_path, capsys):
    files = init_run(tmp_path / "run", name="stop", model=MODEL)
    checkpoints = tmp_path / "checkpoints"
    flags = [*MODEL_FLAGS.to_argv(MODEL), "--checkpoint-dir", str(checkpoints), "--no-link-probe"]
    stranger_key = tmp_path / "stranger.key"
    load_or_create_key(str(stranger_key))
    with local_swarm(tmp_path, 2, flags, run=files) as swarm:
        procs, names = swarm.procs, ["peer0", "peer1"]
        train, _, _ = build_datasets(DataConfig(seq_len_tokens=16, train_samples=16, eval_samples=0))
        pipe = PipelineDriver(
            *swarm.path.driver_args(),
            "1f1b",
            n_micro=2,
            deadline_s=60,
            plan_version=swarm.plan_version,
            signer=swarm.signer,
        )
        for step, batch in enumerate(epoch_batches(train, 8, 0, 0)):
            pipe.train_step(step, batch)
        pipe.close()

        code, out = swarm_stop(capsys, swarm.address_file, files.run_id, stranger_key, "--wait-s", "0")
        assert code == 2 and "refused: only its owner or trainers" in out, out

        initial = [m for m in swarm.address_file.read_text().splitlines() if m.strip()]
        joined = DHTConfig(initial_peers=initial, client_mode=True, run=files.run_id)
        with SwarmDHT(replace(joined, signing_key_path=str(stranger_key))) as stranger:
            issue_stop(stranger, "a stranger's")  # past the command's own check, straight into the DHT
        wait_for_line(procs, names, "refused: only its owner or trainers may stop this run", 60)
        procs.check_alive()

        code, out = swarm_stop(
            capsys, swarm.address_file, files.run_id, files.owner_key, "--reason", "test over", "--wait-s", "90"
        )
        assert code == 0 and sorted(json.loads(out)["stopped"]) == sorted(swarm.peers), out
        codes = {name: procs.procs[name].wait(30) for name in names}
    assert codes == {"peer0": 0, "peer1": 0}
    logs = {name: (tmp_path / "logs" / f"{name}.log").read_text() for name in names}
    for name, log in logs.items():
        assert "stop ordered by" in log and "test over" in log, log[-2000:]
        assert "of 1, layers" not in log, f"{name} took the whole model over:\n{log[-2000:]}"
        assert "final)" in log, f"{name} wrote no final checkpoint:\n{log[-2000:]}"
    assert sorted(p.name for p in checkpoints.glob("layers-*.safetensors")) == [
        "layers-0000-0001.safetensors",
        "layers-0001-0002.safetensors",
    ]
