"""Issue 28 papercut: `swarm status` listed peers that had left 20 s earlier (their announcements live on for a
TTL). Peers whose stage port does not answer are listed apart, by name, and marked in the JSON."""

from __future__ import annotations

from swarm.daemon import status
from swarm.peers.records import PeerAnnouncement

NOW = 1.7e9


def peer(name: str, port: int) -> PeerAnnouncement:
    return PeerAnnouncement(name * 12, f"127.0.0.1:{port}", "cpu", 1 << 30, 1.0, started_at=NOW - 60, stage=0,
                            layer_start=0, layer_end=1)  # fmt: skip


def test_a_peer_that_does_not_answer_is_listed_apart_as_left(monkeypatch):
    peers = [peer("a", 5001), peer("b", 5002)]
    monkeypatch.setattr(status, "listening", lambda address, timeout_s: address.endswith(":5001"))
    up = status.answering(peers, timeout_s=0.1)
    assert up == {"a" * 12}
    text = status.render("r", peers, [], None, NOW, {}, up)
    table, _, left = text.partition("left (")
    assert "aaaaaaaa" in table and "bbbbbbbb" not in table and "1 peers" in text
    assert "bbbbbbbb at 127.0.0.1:5002" in left
    wire = status.to_json("r", peers, [], None, NOW, {}, up)
    assert [p["answering"] for p in wire["peers"]] == [True, False]


def test_without_a_liveness_check_every_peer_is_listed():
    peers = [peer("a", 5001), peer("b", 5002)]
    text = status.render("r", peers, [], None, NOW)
    assert "aaaaaaaa" in text and "bbbbbbbb" in text and "left (" not in text
    assert all(p["answering"] for p in status.to_json("r", peers, [], None, NOW)["peers"])


def test_a_bad_address_is_not_listening():
    assert not status.listening("no-port", timeout_s=0.1)
