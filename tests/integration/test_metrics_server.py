"""`serve_metrics` on loopback: GET /metrics answers the Prometheus text, other paths 404, close frees the port."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request

import pytest

from swarm.metrics import Metrics, serve_metrics

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def test_serves_metrics_404s_elsewhere_and_frees_its_port():
    metrics = Metrics()
    metrics.steps.inc(2)
    server = serve_metrics(metrics, 0)
    port = server.port
    assert port > 0 and server.url == f"http://127.0.0.1:{port}/metrics"
    try:
        with urllib.request.urlopen(server.url, timeout=10) as reply:
            assert reply.status == 200
            assert reply.headers["Content-Type"].startswith("text/plain")
            body = reply.read().decode()
        assert "# HELP swarm_steps" in body and "\nswarm_steps_total 2.0\n" in body
        metrics.steps.inc()  # served live, not a copy taken at start
        with urllib.request.urlopen(server.url, timeout=10) as reply:
            assert "swarm_steps_total 3.0" in reply.read().decode()
        for path in ("/", "/metricsx", "/favicon.ico"):
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10)
            assert err.value.code == 404, path
    finally:
        server.close()
    with socket.socket() as s:  # closed: nothing listens on the port, a new server may take it
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers do: TIME_WAIT of served connections
        s.bind(("127.0.0.1", port))
        s.listen()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)  # refused once that one is gone
