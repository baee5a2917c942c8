"""The DHT layer on a real loopback swarm: announcements, expiry, forgery, plans, and the bootstrap/status commands.

Three SwarmDHT nodes (each a hivemind DHT node in a thread, with its p2pd) serve the whole module; every wait polls
with a deadline, every process started here is shut down or killed and reaped.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest
from hivemind.dht import DHT
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import DHTRecord
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from swarm.peers.dht import SwarmDHT, peer_id_of, quiet_hivemind, wait_for
from swarm.peers.dht_config import DHTConfig
from swarm.peers.reannounce import Reannouncer
from swarm.peers.records import LinkMeasurement, PeerAnnouncement

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

WAIT_S = 20.0  # bound on any one condition to become true (they take well under a second when idle)
SHORT_TTL_S = 3.0


def announcement(dht: SwarmDHT, **changes) -> PeerAnnouncement:
    fields = dict(
        peer_id=dht.peer_id,
        address="127.0.0.1:5000",
        device="cpu",
        memory_bytes=1 << 30,
        compute_layers_per_s=10.0,
        started_at=get_dht_time(),
    )
    return PeerAnnouncement(**{**fields, **changes})


def peer(dht: SwarmDHT, peer_id: str) -> PeerAnnouncement | None:
    return next((a for a in dht.peers() if a.peer_id == peer_id), None)


@pytest.fixture(scope="module")
def swarm() -> Iterator[tuple[SwarmDHT, SwarmDHT, SwarmDHT]]:
    """Node a starts the swarm, b and c join through it; c's announcements live SHORT_TTL_S only."""
    quiet_hivemind()
    nodes: list[SwarmDHT] = []
    try:
        a = SwarmDHT(DHTConfig(run_name="test-dht"))
        nodes.append(a)
        joined = DHTConfig(initial_peers=tuple(a.visible_maddrs()), run_name="test-dht")
        nodes.append(SwarmDHT(joined))
        nodes.append(SwarmDHT(dataclasses.replace(joined, announce_ttl_s=SHORT_TTL_S)))
        yield nodes[0], nodes[1], nodes[2]
    finally:
        for node in nodes:
            node.shutdown()
        assert not any(node.is_alive() for node in nodes)


def test_visible_maddrs_are_loopback(swarm):
    a, _, _ = swarm
    maddrs = a.visible_maddrs()
    assert maddrs and all(m.startswith("/ip4/127.0.0.1/tcp/") and "/p2p/" in m for m in maddrs)


def test_announcement_is_seen_by_every_node(swarm):
    a, b, c = swarm
    ann = announcement(a, address="127.0.0.1:5001", device="cuda:0", codec="fp16")
    assert a.announce(ann, ttl_s=60)
    for reader in (b, c, a):
        assert wait_for(lambda r=reader: peer(r, a.peer_id), WAIT_S, what=f"{a.peer_id} visible") == ann


def test_announcing_for_another_peer_is_refused_locally(swarm):
    a, b, _ = swarm
    with pytest.raises(ValueError, match="peer_id"):
        b.announce(announcement(a))


def test_heartbeat_refreshes_then_the_announcement_expires(swarm):
    _, b, c = swarm
    beats = iter(range(1, 1_000_000))
    heartbeat = Reannouncer(c, lambda: announcement(c, plan_version=next(beats)))
    assert heartbeat.period_s == pytest.approx(SHORT_TTL_S / 3)
    with heartbeat:
        # Each beat carries a new plan_version: seeing 3 on another node means it was refreshed twice.
        wait_for(lambda: (p := peer(b, c.peer_id)) and p.plan_version >= 3, WAIT_S, what="two refreshes seen")
    assert heartbeat.beats >= 3
    wait_for(lambda: peer(b, c.peer_id) is None, SHORT_TTL_S + WAIT_S, what="announcement expired")


class _ForgingSigner(RSASignatureValidator):
    """A malicious node: signs every record with its own key, even under another owner's subkey, and stores
    anything it is sent (an honest node must not trust what it returns)."""

    def sign_value(self, record: DHTRecord) -> bytes:
        signature = self._private_key.sign(self._serialize_record(record))
        return record.value + self.SIGNATURE_FORMAT.replace(b"_value_", signature)

    def validate(self, record: DHTRecord) -> bool:
        return True


def test_forged_records_are_refused(swarm):
    a, b, c = swarm
    original = announcement(a, address="127.0.0.1:6000")
    assert a.announce(original, ttl_s=60)
    wait_for(lambda: peer(b, a.peer_id) == original, WAIT_S, what="original visible")

    forger_key = RSAPrivateKey()
    forger_signer = _ForgingSigner(forger_key)
    forger_id = peer_id_of(forger_key.get_public_key().to_bytes())
    hijacked = announcement(a, address="10.6.6.6:6666").to_wire()
    key, expiration = "test-dht.peers", get_dht_time() + 600  # later than the original: would win if accepted
    forger = DHT(
        initial_peers=a.visible_maddrs(),
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        record_validators=[forger_signer],
        start=True,
    )
    try:
        # The attacker reads a's subkey (its owner marker) from the DHT, as anyone can.
        entries = forger.get(key, latest=True, return_future=True).result(timeout=WAIT_S).value
        [a_owner] = [subkey for subkey, entry in entries.items() if entry.value.get("peer_id") == a.peer_id]
        forgeries = {
            "a's subkey, signed with the forger's key": (a_owner, hijacked),
            "the forger's own subkey, claiming a's peer id": (forger_signer.local_public_key, hijacked),
            "an unowned subkey": (b"no-owner", hijacked),
            "a plain value instead of a dictionary": (None, hijacked),
            "the forger's own subkey, garbage value": (forger_signer.local_public_key, {"peer_id": forger_id}),
        }
        for subkey, value in forgeries.values():
            forger.store(key, value, expiration, subkey=subkey, return_future=True).result(timeout=WAIT_S)
        for reader in (a, b, c):
            assert peer(reader, a.peer_id) == original
            assert peer(reader, forger_id) is None
    finally:
        forger.shutdown()
        assert not forger.is_alive()


def test_the_planner_lease_rides_on_every_announcement_and_an_hour_long_one_is_refused(swarm):
    a, b, c = swarm
    a.planner_until = get_dht_time() + 3.0  # what Planner.renew_lease sets; announce stamps it
    assert a.announce(announcement(a), ttl_s=60)
    seen = wait_for(lambda: (p := peer(b, a.peer_id)) and p.planner_until > 0 and p, WAIT_S, what="a's lease")
    assert seen.planner_until == a.planner_until
    c.planner_until = get_dht_time() + 3600  # signed by its owner, but it would keep c elected for an hour
    assert not c.announce(announcement(c), ttl_s=60), "honest nodes refuse to store it"
    assert peer(b, c.peer_id) is None
    c.planner_until = 0.0
    later = announcement(c, address="127.0.0.1:6001")
    assert c.announce(later, ttl_s=120)  # expires later: replaces whatever was stored
    assert wait_for(lambda: peer(b, c.peer_id) == later, WAIT_S, what="c's lease-less announcement")


def test_links_are_stored_per_source_and_destination(swarm):
    a, b, c = swarm
    assert c.store_link(LinkMeasurement(c.peer_id, a.peer_id, 0.010, 12.5e6, get_dht_time()))
    assert c.store_link(LinkMeasurement(c.peer_id, b.peer_id, 0.020, 1.25e6, get_dht_time()))
    newer = LinkMeasurement(c.peer_id, a.peer_id, 0.011, 11e6, get_dht_time())
    assert c.store_link(newer)  # replaces c->a
    links = wait_for(lambda: [m for m in b.links() if m.src == c.peer_id and m.rtt_s != 0.010], WAIT_S)
    assert {(m.dst, m.rtt_s) for m in links} == {(a.peer_id, 0.011), (b.peer_id, 0.020)}
    with pytest.raises(ValueError, match="src"):
        b.store_link(newer)


def _two_stages(first: str, second: str) -> dict:
    return {
        "stages": [
            {"layer_start": 0, "layer_end": 2, "peer_ids": [first]},
            {"layer_start": 2, "layer_end": 4, "peer_ids": [second]},
        ],
    }


def test_plans_count_only_from_the_elected_planner_and_only_when_valid(swarm):
    a, b, c = swarm
    elected, other = sorted((a, b), key=lambda n: n.peer_id)
    # the election must not hang on what earlier tests left announced (a's lapsed lease, c's lease-less record,
    # which would elect c or b): the elected one holds a live lease for the test, the other none
    elected.planner_until, other.planner_until = get_dht_time() + 50.0, 0.0
    for node in (a, b):
        assert node.announce(announcement(node), ttl_s=60)
    wait_for(
        lambda: (
            (seen := {p.peer_id: p for p in c.peers()}).keys() >= {a.peer_id, b.peer_id}
            and seen[elected.peer_id].planner_until == elected.planner_until
        ),
        WAIT_S,
        what="a and b announced, the elected one with its lease",
    )
    assert elected.publish_plan(1, _two_stages(a.peer_id, b.peer_id))
    assert elected.publish_plan(2, _two_stages(b.peer_id, a.peer_id))
    assert other.publish_plan(500, _two_stages(other.peer_id, elected.peer_id))  # not elected: to be ignored
    assert elected.publish_plan(3, {**_two_stages(a.peer_id, b.peer_id), "stages": [{"layer_start": 0,
                                    "layer_end": 1000000, "peer_ids": [a.peer_id]}]})  # fmt: skip
    for reader in (a, b, c):
        got = wait_for(lambda r=reader: (p := r.get_plan(4)) and p.version == 2 and p, WAIT_S, what="plan 2")
        assert got.document.stages[0].peer_ids == (b.peer_id,)
    with pytest.raises(ValueError, match="plan"):
        b.publish_plan(4, {"bad": float("nan")})

    picky_config = DHTConfig(
        initial_peers=tuple(a.visible_maddrs()), run_name="test-dht", client_mode=True, trusted_planners=("0" * 24,)
    )
    with SwarmDHT(picky_config) as picky:
        assert picky.get_plan(4) is None
    with SwarmDHT(dataclasses.replace(picky_config, trusted_planners=(other.peer_id,))) as trusting:
        assert wait_for(lambda: trusting.get_plan(4), WAIT_S, what="the trusted plan").version == 500


def test_wait_for_stages(swarm):
    a, b, _ = swarm
    assert a.announce(announcement(a, stage=0, layer_start=0, layer_end=2, plan_version=2), ttl_s=60)
    assert b.announce(announcement(b, stage=1, layer_start=2, layer_end=4, plan_version=2), ttl_s=60)
    progress: list[list[int]] = []
    served = a.wait_for_stages(2, WAIT_S, min_plan_version=2, on_progress=lambda s: progress.append(sorted(s)))
    assert [p.peer_id for p in served[0]] == [a.peer_id] and [p.peer_id for p in served[1]] == [b.peer_id]
    assert progress[-1] == [0, 1]
    with pytest.raises(TimeoutError, match=r"stages \[2\] of 3"):
        a.wait_for_stages(3, 1.0, poll_s=0.2)
    with pytest.raises(TimeoutError, match=r"stages \[0, 1\] of 2 .*plan version >= 3"):
        a.wait_for_stages(2, 1.0, min_plan_version=3, poll_s=0.2)


def test_bootstrap_and_status_commands(tmp_path):
    address_file = tmp_path / "bootstrap.addr"
    command = [sys.executable, "-m", "swarm.cli"]
    run_name = ["--run-name", "test-cli"]
    with open(tmp_path / "bootstrap.out", "w") as out, open(tmp_path / "bootstrap.err", "w") as err:
        bootstrap = subprocess.Popen(
            [*command, "bootstrap", "--address-file", str(address_file), "--report-s", "0", *run_name],
            stdout=out,
            stderr=err,
            start_new_session=True,  # its own process group, so cleanup can reach its DHT and p2p daemons
        )
    try:
        wait_for(lambda: address_file.exists() or bootstrap.poll() is not None, 60.0, what="address file")
        assert bootstrap.poll() is None, (tmp_path / "bootstrap.err").read_text()
        maddrs = address_file.read_text().split()
        assert maddrs and all("/p2p/" in m for m in maddrs)

        with SwarmDHT(DHTConfig(initial_peers=tuple(maddrs), run_name="test-cli")) as node:
            ann = announcement(node, stage=0, layer_start=0, layer_end=4, load=0.5)
            assert node.announce(ann, ttl_s=60)
            status = subprocess.run(
                [*command, "status", "--address-file", str(address_file), "--json", "--timeout-s", "20", *run_name],
                capture_output=True,
                text=True,
                timeout=60,
            )
        assert status.returncode == 0, status.stderr
        report = json.loads(status.stdout)
        assert report["run"] == "test-cli" and report["plan"] is None
        [listed] = [p for p in report["peers"] if p["peer_id"] == node.peer_id]
        assert PeerAnnouncement.from_wire({k: v for k, v in listed.items() if k != "age_s"}) == ann

        bootstrap.send_signal(signal.SIGTERM)
        assert bootstrap.wait(timeout=30) == 0, (tmp_path / "bootstrap.err").read_text()
        assert (tmp_path / "bootstrap.out").read_text().split() == maddrs
        assert not address_file.exists()
        # Its p2p daemon went with it: the process group it led is empty.
        wait_for(lambda: not _group_alive(bootstrap.pid), 10.0, what="bootstrap's processes gone")
    finally:
        if _group_alive(bootstrap.pid):
            os.killpg(bootstrap.pid, signal.SIGKILL)
        bootstrap.wait(timeout=30)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True
