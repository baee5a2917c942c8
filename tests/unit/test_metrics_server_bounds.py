"""The `/metrics` endpoint's bounds (issue 27) on loopback: 400 idle connections held 400 threads and never
timed out; now they cost no thread, the oldest give way to new ones past `max_connections`, idle ones are
closed at the read deadline, and a scrape is still answered meanwhile. Garbage, other methods and overlong
requests are answered or closed without a thread either."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request

import psutil
import pytest

from swarm.metrics import Metrics, MetricsServerLimits, serve_metrics

pytestmark = pytest.mark.timeout(60)


def _wait(predicate, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _closed_by_server(sock: socket.socket, timeout_s: float = 10.0) -> bool:
    sock.settimeout(timeout_s)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_400_idle_connections_hold_no_thread_and_a_scrape_is_still_answered():
    metrics = Metrics()
    metrics.steps.inc(5)
    me = psutil.Process()
    limits = MetricsServerLimits(max_connections=32, read_timeout_s=3.0)
    with serve_metrics(metrics, 0, limits=limits) as server:
        threads_before = me.num_threads()
        idle = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(400)]
        try:
            for sock in idle[:50]:
                sock.sendall(b"GET /metr")  # half a request: slow, not merely idle
            assert _wait(lambda: server.dropped >= 400 - limits.max_connections), server.dropped
            threads_held = me.num_threads()
            assert server.open_connections() <= limits.max_connections
            with urllib.request.urlopen(server.url, timeout=10) as reply:  # a scraper is not shut out
                assert reply.status == 200 and b"swarm_steps_total 5.0" in reply.read()
            print(f"threads {threads_before} -> {threads_held} with 400 idle connections")
            assert threads_held - threads_before <= 2, (threads_before, threads_held)
            # the ones still open are closed at the read deadline, not held forever
            assert _wait(lambda: server.open_connections() == 0, 3 * limits.read_timeout_s)
            assert _closed_by_server(idle[-1])
        finally:
            for sock in idle:
                sock.close()


@pytest.mark.parametrize(
    "request_bytes, status",
    [
        (b"POST /metrics HTTP/1.1\r\n\r\n", b"405"),
        (b"GET /other HTTP/1.1\r\n\r\n", b"404"),
        (b"\x00\xff garbage\r\n\r\n", b"400"),
        (b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 20000 + b"\r\n\r\n", b""),  # too long: closed unanswered
    ],
)
def test_bad_requests_are_answered_or_closed(request_bytes, status):
    with serve_metrics(Metrics(), 0) as server, socket.create_connection(("127.0.0.1", server.port), 10) as sock:
        try:
            sock.sendall(request_bytes)
        except OSError:
            pass  # closed while it was sending the overlong request
        sock.settimeout(10)
        answer = b""
        try:
            while chunk := sock.recv(4096):
                answer += chunk
        except ConnectionResetError:
            pass
        assert answer.split(b" ", 2)[1:2] == ([status] if status else []), answer[:80]


def test_close_ends_open_connections_and_the_thread():
    server = serve_metrics(Metrics(), 0)
    sock = socket.create_connection(("127.0.0.1", server.port), 10)
    try:
        assert _wait(lambda: server.open_connections() == 1)
        server.close()
        assert _closed_by_server(sock)
        assert not any(t.name == f"metrics-{server.port}" for t in threading.enumerate())
    finally:
        sock.close()
