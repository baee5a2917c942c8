"""`serve_metrics` on loopback: GET /metrics answers the Prometheus text, other paths 404, close frees the port;
swarm-peer and swarm train serve theirs with --metrics-port; `swarm status --serve` serves the run's live page."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from swarm.metrics import Metrics, sample_key, serve_metrics
from swarm.testbed.local import local_swarm

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


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


def _scrape(url: str) -> dict[str, float]:
    """The served text parsed back into snapshot keys (labels sorted), as a Prometheus server would read it."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return {
        sample_key(s.name, s.labels): s.value for family in text_string_to_metric_families(text) for s in family.samples
    }


def _served_url(swarm, name: str) -> str:
    lines = [line for line in swarm.procs.tail(name, 500).splitlines() if "metrics at " in line]
    assert lines, swarm.procs.tail(name)
    url = lines[0].rsplit("metrics at ", 1)[1].strip()
    assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
    return url


def test_swarm_peer_and_trainer_serve_metrics_with_metrics_port(tmp_path):
    model = ["--layers", "2", "--hidden", "32", "--heads", "2", "--seq-len", "16"]
    codecs = ["--fw-codec", "aqsgd2", "--bw-codec", "gradq4"]
    with local_swarm(tmp_path, 2, [*model, *codecs, "--assign", "even", "--metrics-port", "0"]) as swarm:
        urls = [_served_url(swarm, name) for name in ("peer0", "peer1")]
        url = urls[0]
        with urllib.request.urlopen(url, timeout=10) as reply:
            assert "\nswarm_plan_version 0.0\n" in reply.read().decode()
        trainer = subprocess.run(
            [
                sys.executable, "-m", "swarm.cli", "train", "--address-file", str(swarm.address_file), *model,
                "--num-stages", "2", "--train-samples", "8", "--batch-size", "8", "--micro-batches", "2",
                "--steps", "3", "--out", str(tmp_path / "train"), "--metrics-port", "0",
            ],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert trainer.returncode == 0, trainer.stderr[-2000:]
        assert "metrics at http://127.0.0.1:" in trainer.stderr
        # while the peers serve the run: bytes, step time and AQ-SGD buffer hits (the same 8 samples, 3 steps)
        # on stage 0, whichever peer took it (the even split orders peers by when they announced)
        scraped = [_scrape(u) for u in urls]
        served = next((s for s in scraped if 'swarm_phase_seconds_count{phase="compute",stage="0"}' in s), {})
        assert served["swarm_steps_total"] == 3 and served["swarm_step_seconds_count"] == 3
        assert served['swarm_wire_bytes_total{direction="forward",link="0"}'] > 0
        assert served['swarm_aqsgd_buffer_misses_total{link="0"}'] == 8  # first sights
        assert served['swarm_aqsgd_buffer_hits_total{link="0"}'] == 16  # steps 2 and 3
        assert served['swarm_phase_seconds_count{phase="compute",stage="0"}'] == 3 * 2 * 2  # F and B per micro-batch
        _check_status_page(swarm, tmp_path / "train")
        codes = swarm.procs.close()
    assert codes["peer0"] == codes["peer1"] == 0, "the peers stop their metrics servers and exit cleanly"
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url, timeout=5)


def _check_status_page(swarm, steps_dir) -> None:
    """`swarm status --serve 0` on the live swarm: the page and its JSON (the peers, the plan's stages, the
    bootstrap peer alive, the trainer's 3 steps), then SIGTERM ends it with 0."""
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "swarm.cli", "status", "--address-file", str(swarm.address_file), "--serve", "0",
            "--steps", str(steps_dir), "--refresh-s", "1",
        ],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        line = proc.stderr.readline()  # its first line names the page, once the DHT is joined and the port bound
        found = re.search(r"status page at (http://\S+/)", line)
        assert found, line + proc.stderr.read(2000) if proc.poll() is not None else line
        base = found.group(1)
        with urllib.request.urlopen(base, timeout=10) as reply:
            assert reply.headers["Content-Type"].startswith("text/html") and b"/api/status" in reply.read()
        deadline, snap = time.monotonic() + 60, {}
        while time.monotonic() < deadline:  # the poller's first read is under way when the port opens
            with urllib.request.urlopen(base + "api/status", timeout=10) as reply:
                snap = json.loads(reply.read())
            if snap.get("stages") and snap.get("steps"):
                break
            time.sleep(0.2)
        assert snap.get("format") == "swarm-status/1", snap
        assert len(snap["peers"]) == 2 and len(snap["stages"]) == 2, snap
        assert snap["bootstrap"] and all(b["alive"] for b in snap["bootstrap"]), snap["bootstrap"]
        assert snap["steps"]["rows"] == 3 and snap["steps"]["last"]["step"] == 3, snap["steps"]
        assert sum(p["answered"] is True for p in snap["peers"]) == 2, "both serving peers answered Status"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:  # SIGTERM first: a SIGKILLed status would leave its DHT process behind
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        proc.stderr.close()
