"""A killed elected planner is replaced within seconds (its lease lapses; its announcement would live 30 s),
and the new planner inherits the followed plan: it repairs it, nobody else moves, no search anew.

Processes on loopback: a bootstrap node and 3 peers (2 stages + 1 standby), no trainer. Every process is
reaped (ProcessGroup), every wait has a deadline.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from swarm.testbed.procs import ProcessGroup, peer_command, swarm_command
from tests.integration.test_churn_peers import MODEL_FLAGS, peer_ids, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

PEER_FLAGS = [
    *MODEL_FLAGS, "--fw-codec", "fp32", "--bw-codec", "fp32", "--compute-speed", "50", "--num-stages", "2",
    "--replicas", "1", "--min-peers", "3", "--threads", "1",
]  # fmt: skip


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["killed", "terminated"])
def test_a_killed_or_leaving_planner_is_replaced_and_its_plan_repaired_within_seconds(tmp_path, sig):
    from hivemind.utils import get_dht_time

    from swarm.peers.dht import SwarmDHT
    from swarm.peers.dht_config import DHTConfig
    from swarm.peers.records import elected_planner

    with ProcessGroup(tmp_path / "logs") as procs:
        address_file = tmp_path / "bootstrap.addr"
        procs.start("bootstrap", swarm_command("bootstrap", "--address-file", str(address_file)))
        procs.wait_for_file(address_file, 60)
        for i in range(3):
            procs.start(f"peer{i}", peer_command("--address-file", str(address_file), *PEER_FLAGS))
        initial = [line for line in address_file.read_text().splitlines() if line.strip()]
        with SwarmDHT(DHTConfig(initial_peers=initial, client_mode=True)) as dht:

            def followed():
                procs.check_alive()
                record = dht.get_plan(2, check_trainers=False)
                peers = dht.peers()
                every = record is not None and len(peers) == 3 and all(p.plan_version == record.version for p in peers)
                return (record, peers) if every else None

            before, peers = wait_until("a plan every peer follows", followed, 180, procs)
            planner = elected_planner(peers, now=get_dht_time())
            assert next(p for p in peers if p.peer_id == planner).planner_until > get_dht_time() - 1, "it holds a lease"
            name = peer_ids(procs)[planner]
            killed = time.monotonic()
            if sig == signal.SIGKILL:
                os.killpg(procs.procs[name].pid, signal.SIGKILL)  # the planner and its DHT helper, without warning
                procs.procs[name].wait(10)
            else:
                procs.procs[name].send_signal(signal.SIGTERM)  # it announces leaving: no longer a candidate
            leaver = procs.procs.pop(name)  # check_alive watches the others; reaped below

            def repaired():
                procs.check_alive()
                record = dht.get_plan(2, check_trainers=False)
                if record is None or record.version <= before.version:
                    return None
                named = [*(p for s in record.document.stages for p in s.peer_ids), *record.document.unused_peer_ids]
                return record if sorted(named) == sorted(p.peer_id for p in peers if p.peer_id != planner) else None

            after = wait_until("a plan naming the survivors only", repaired, 60, procs, poll_s=0.1)
            took = time.monotonic() - killed
            print(f"plan {after.version} without the planner {took:.1f} s after {signal.Signals(sig).name}")
            assert took < 15, f"the repair took {took:.1f} s"
            for index, stage in enumerate(before.document.stages):
                for pid in stage.peer_ids:
                    if pid != planner:
                        assert pid in after.document.stages[index].peer_ids, "a survivor moved: searched anew"
            try:
                code = leaver.wait(60)  # a leaver exits once its successor serves its layers
            finally:
                if leaver.poll() is None:
                    os.killpg(leaver.pid, signal.SIGKILL)
                    leaver.wait(10)
            assert code == (0 if sig == signal.SIGTERM else -signal.SIGKILL)
