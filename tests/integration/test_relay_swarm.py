"""A loopback swarm of swarm-peer processes in which one peer runs `--reach relay` (behaves as behind NAT: its
DHT node in client mode, every call to it through its relay): it trains to the same losses as the in-process
pipeline, and its relay counts the bytes it forwarded. Issue 16's first target, with real daemons."""

from __future__ import annotations

import time

import pytest

from swarm.compression import CodecConfig
from swarm.daemon.nat import announced_dial
from swarm.metrics import total
from swarm.model.data import DataConfig, build_datasets, epoch_batches
from swarm.net.connect import GrpcConnector
from swarm.runtime.driver import PipelineDriver
from swarm.runtime.inprocess import LocalPipeline
from swarm.testbed.local import local_swarm
from tests.integration.swarm_fixtures import TINY

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

MODEL_FLAGS = ["--layers", "3", "--hidden", "32", "--heads", "2", "--seq-len", "16"]


def test_a_swarm_with_a_peer_behind_nat_trains_exactly_as_in_process(tmp_path):
    train, _, _ = build_datasets(DataConfig(seq_len_tokens=16, train_samples=16, eval_samples=0))
    data = list(epoch_batches(train, 8, 0, 0)) + list(epoch_batches(train, 8, 1, 0))
    fp32 = CodecConfig("fp32")
    local = LocalPipeline(TINY, 2, fp32, fp32, "1f1b")
    expected = [local.train_step(b, 2).loss for b in data]
    flags = [*MODEL_FLAGS, "--fw-codec", "fp32", "--bw-codec", "fp32"]
    with local_swarm(tmp_path, 2, flags, per_peer_flags=[["--reach", "direct"], ["--reach", "relay"]]) as swarm:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the relayed peer announces its relay once one is reachable
            relayed = [p for p in swarm.dht.peers() if p.reach == "relay"]
            if relayed:
                break
            time.sleep(0.2)
        assert len(relayed) == 1 and relayed[0].peer_id in swarm.peers
        connector = GrpcConnector(signer=swarm.signer, dial=announced_dial(swarm.dht.peers, swarm.signer))
        pipe = PipelineDriver(
            swarm.route, swarm.peers, "1f1b", n_micro=2, deadline_s=60, plan_version=swarm.plan_version,
            connector=connector,
        )  # fmt: skip
        got = [pipe.train_step(step, b).loss for step, b in enumerate(data)]
        statuses = pipe.status()
        pipe.close()
        codes = swarm.procs.close()
    assert got == expected  # float equality: the relay changes where bytes go, not the math
    relay_status = next(s for s in statuses if s.peer_id == relayed[0].relay)
    assert total(dict(relay_status.metrics), "swarm_relayed_bytes_total") > 0
    conns = dict(relay_status.metrics)
    assert conns.get('swarm_relayed_connections_total{path="data-port"}', 0) > 0, "plain TCP by the data port"
    assert conns.get('swarm_relayed_connections_total{path="frames"}', 0) == 0
    assert codes["peer0"] == 0 and codes["peer1"] == 0, "peers must shut down cleanly"
