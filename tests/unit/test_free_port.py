"""`free_port`: ports a caller binds a moment later, away from what the kernel hands out on its own."""

import socket

from swarm import report
from swarm.report import free_port


def test_ports_come_from_below_the_ephemeral_range_and_never_twice():
    low = report._ephemeral_low()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports), "one process never gets a port twice"
    if low > 2048:  # Linux: port 0 and outgoing connections take ports from [low, high]
        assert all(max(1024, low - 10000) <= p < low for p in ports)
    for p in ports[:5]:  # and each is bindable now
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", p))


def test_a_port_something_listens_on_is_skipped(monkeypatch):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        picks = iter([taken, *range(20000, 20100)])
        monkeypatch.setattr(report, "_ephemeral_low", lambda: 60000)
        monkeypatch.setattr("random.randrange", lambda lo, hi: next(picks))
        port = free_port()
    assert port != taken
