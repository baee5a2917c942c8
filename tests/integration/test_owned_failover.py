"""An owned run on real processes: strangers with ground low ids hold planner leases and publish plans naming
themselves, then the planning delegate is killed; the other delegated planner takes over and repairs the plan,
and no stranger's plan is ever followed (a stranger may still be planned to serve a stage: anyone may).

Processes on loopback: a bootstrap node and 3 swarm-peers joined with `--run` (two hold the delegated planner
keys), 2 stranger DHT nodes in this process. Every process is reaped (ProcessGroup), every wait has a deadline.
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
    *MODEL_FLAGS, "--compute-speed", "50", "--num-stages", "2", "--replicas", "1", "--min-peers", "3",
    "--threads", "1",
]  # fmt: skip


def test_sybils_with_leases_and_a_killed_planner_hand_planning_to_the_other_delegate(tmp_path):
    from hivemind.utils import get_dht_time
    from hivemind.utils.crypto import RSAPrivateKey

    from swarm.daemon.run_cli import init_run
    from swarm.options import ModelFlags
    from swarm.peers.dht import SwarmDHT, peer_id_of
    from swarm.peers.dht_config import DHTConfig
    from swarm.peers.reannounce import Reannouncer
    from swarm.peers.records import PeerAnnouncement

    model = ModelFlags(layers=2, hidden=32, heads=2, seq_len=16)
    run = init_run(tmp_path / "run", model=model, fw_codec="fp32", bw_codec="fp32", n_planners=2)
    delegates = set(run.manifest.planners)
    with ProcessGroup(tmp_path / "logs") as procs:
        address_file = tmp_path / "bootstrap.addr"
        procs.start("bootstrap", swarm_command("bootstrap", "--address-file", str(address_file)))
        procs.wait_for_file(address_file, 60)
        for i in range(3):
            own = ["--identity", str(run.planner_keys[i])] if i < 2 else []
            argv = ["--address-file", str(address_file), "--run", str(run.manifest_path), *PEER_FLAGS, *own]
            procs.start(f"peer{i}", peer_command(*argv))
        initial = tuple(line for line in address_file.read_text().splitlines() if line.strip())
        joined = DHTConfig(initial_peers=initial, client_mode=True, run=run.run_id)
        strangers: list[SwarmDHT] = []
        beats: list[Reannouncer] = []
        with SwarmDHT(joined) as reader:
            try:
                for _ in range(2):  # Sybils with ids below every delegate, each holding a lease
                    key = RSAPrivateKey()
                    while peer_id_of(key.get_public_key().to_bytes()) > min(delegates):
                        key = RSAPrivateKey()
                    sybil = SwarmDHT(joined, private_key=key)
                    strangers.append(sybil)
                    sybil.planner_until = get_dht_time() + 50.0
                    me = PeerAnnouncement(sybil.peer_id, "127.0.0.1:9", "cpu", 1 << 30, 1.0, started_at=get_dht_time())
                    beats.append(Reannouncer(sybil, lambda me=me: me).start())

                def followed():
                    procs.check_alive()
                    record = reader.get_plan(2, check_trainers=False)
                    peers = [p for p in reader.peers() if p.peer_id not in {s.peer_id for s in strangers}]
                    every = (
                        record is not None and len(peers) == 3 and all(p.plan_version == record.version for p in peers)
                    )
                    return (record, peers) if every else None

                before, peers = wait_until("a plan every peer follows", followed, 180, procs)
                # (a Sybil may be planned to serve: anyone may serve stages; it is never the plan's author)
                hijack = {"stages": [{"layer_start": 0, "layer_end": 2, "peer_ids": [strangers[0].peer_id]}]}
                strangers[0].publish_plan(before.version + 100, hijack)
                names = peer_ids(procs)
                planner = next(p.peer_id for p in peers if p.planner_until > get_dht_time() - 1)
                assert planner in delegates, "the lease holder among the peers is a delegate"
                killed = time.monotonic()
                os.killpg(procs.procs[names[planner]].pid, signal.SIGKILL)
                procs.procs[names[planner]].wait(10)
                procs.procs.pop(names[planner])

                def repaired():
                    procs.check_alive()
                    record = reader.get_plan(2, check_trainers=False)
                    if record is None or record.version <= before.version:
                        return None
                    return record if planner not in record.document.named_peers() else None

                after = wait_until("a plan without the killed planner", repaired, 60, procs, poll_s=0.2)
                print(f"plan {after.version} by the other delegate {time.monotonic() - killed:.1f} s after the kill")
                assert after.version < before.version + 100, "the Sybil's plan was not followed"
                survivor = next(iter(delegates - {planner}))
                refused = f"refusing plan {before.version + 100} from {strangers[0].peer_id}"
                # the plan is in the DHT before its planner logs it (and the refusal is logged at the next read
                # of the plans): wait for both lines, then count
                logged = lambda: "published plan" in (t := procs.tail(names[survivor], 400)) and refused in t and t
                log = wait_until("the other delegate's log of its plan and of the refusal", logged, 30, procs)
                assert "published plan" in log, "the other delegate planned"
                assert log.count(refused) == 1, "the hijack is refused by name, once"
            finally:
                for beat in beats:
                    beat.stop()
                for sybil in strangers:
                    sybil.shutdown()
