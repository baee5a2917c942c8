"""The status page over HTTP on loopback, in process (the metrics server's one event loop): the page and its
JSON are served with their headers, hostile strings arrive escaped, requests are answered from the poller's cache
(never one DHT read per request), and bad, oversized, too many or unknown requests are refused."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from swarm.daemon.status_page import PAGE_FILE, DhtReader, PageLimits, StatusPoller, page_html, status_routes
from swarm.metrics import Metrics, MetricsServerLimits, serve_metrics
from tests.status_fixtures import XSS, R, records, snapshot, write_steps

pytestmark = pytest.mark.timeout(60)


def _wait(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _settles(value, quiet_s: float, timeout_s: float = 10.0) -> bool:
    """Whether `value()` stops changing for `quiet_s` (many refresh periods) within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    last, since = value(), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        if value() != last:
            last, since = value(), time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return True
    return False


def poller_reads(poller: StatusPoller, timeout_s: float) -> bool:
    """Whether the poller finished a read within `timeout_s` (watched directly: polling the page as fast would
    meet its rate limit)."""
    return poller.ready.wait(timeout_s)


class CountingSource:
    """A status source that counts its reads and fails when told to."""

    def __init__(self, snap: dict):
        self.snap, self.reads, self.fail = snap, 0, None

    def __call__(self) -> dict:
        self.reads += 1
        if self.fail is not None:
            raise self.fail
        return self.snap


@pytest.fixture
def page(tmp_path):
    source = CountingSource(snapshot(write_steps(tmp_path / "train")))
    poller = StatusPoller(source, refresh_s=3600)
    assert poller.ready.wait(10)
    limits = PageLimits(requests_per_s=1000, burst=1000)
    with serve_metrics(None, 0, routes=status_routes(poller, limits)) as server:
        yield server, source, poller
    poller.close()


def _get(server, path: str):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}{path}", timeout=10) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def _raw(server, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", server.port), 10) as sock:
        try:
            sock.sendall(request)
        except OSError:
            pass  # closed while it was sending an overlong request
        sock.settimeout(10)
        answer = b""
        try:
            while chunk := sock.recv(4096):
                answer += chunk
        except ConnectionResetError:
            pass
        return answer


def test_the_page_is_one_self_contained_file_under_a_strict_policy(page):
    server, _, _ = page
    status, headers, body = _get(server, "/")
    assert status == 200 and headers["Content-Type"].startswith("text/html") and body == PAGE_FILE.read_bytes()
    csp = headers["Content-Security-Policy"]
    script = re.search(rb"<script>(.*?)</script>", body, re.S).group(1)
    digest = base64.b64encode(hashlib.sha256(script).digest()).decode()
    assert f"script-src 'sha256-{digest}'" in csp, "only the page's own inline script runs"
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp and "'unsafe-inline'" not in csp
    assert headers["X-Content-Type-Options"] == "nosniff" and headers["Cache-Control"] == "no-store"
    assert not re.search(rb"""(src|href)\s*=\s*["']?(https?:)?//""", body), "nothing fetched from elsewhere"
    assert not re.search(rb"innerHTML|outerHTML|insertAdjacentHTML|document\.write|eval\(", body), (
        "peer strings enter the page as text only"
    )
    assert _get(server, "/status")[2] == body


def test_api_status_is_the_cached_view_with_hostile_strings_escaped(page):
    server, source, _ = page
    reads = source.reads
    for _ in range(5):
        status, headers, body = _get(server, "/api/status?x=1")
        assert status == 200 and headers["Content-Type"] == "application/json"
    assert source.reads == reads, "requests read the cache: no DHT read per request"
    assert b"<" not in body and b">" not in body, "markup is escaped even inside the JSON"
    snap = json.loads(body)
    assert snap["run"] == XSS and snap["bootstrap"][1]["target"] == XSS
    assert set(snap) >= {
        "format", "run", "time", "error", "bootstrap", "peers", "trainers", "relays", "links", "plan", "stages",
        "plan_history", "steps",
    }  # fmt: skip
    assert snap["steps"]["rows"] == 40 and len(snap["stages"]) == 2


def test_a_failed_read_keeps_the_last_view_and_says_why(page):
    server, source, poller = page
    source.fail = TimeoutError("DHT get did not finish within 20 s")
    poller.refresh()
    snap = json.loads(_get(server, "/api/status")[2])
    assert snap["error"] == "TimeoutError: DHT get did not finish within 20 s"
    assert len(snap["peers"]) == 4, "the last good view is still shown under the error"
    source.fail = None
    poller.refresh()
    assert json.loads(_get(server, "/api/status")[2])["error"] is None


@pytest.mark.parametrize(
    "request_bytes, status",
    [
        (b"POST /api/status HTTP/1.1\r\nContent-Length: 0\r\n\r\n", b"405"),
        (b"GET /../../etc/passwd HTTP/1.1\r\n\r\n", b"404"),
        (b"GET /metrics HTTP/1.1\r\n\r\n", b"404"),  # no metrics given: the page's server serves no /metrics
        (b"\x00\xff garbage\r\n\r\n", b"400"),
        (b"GET /api/status HTTP/1.1\r\nX: " + b"a" * 20000 + b"\r\n\r\n", b""),  # oversized: closed unanswered
    ],
)
def test_bad_requests_are_refused(page, request_bytes, status):
    server, _, _ = page
    answer = _raw(server, request_bytes)
    assert answer.split(b" ", 2)[1:2] == ([status] if status else []), answer[:80]
    assert _get(server, "/api/status")[0] == 200, "the server still serves"


def test_a_client_past_its_rate_is_answered_429(tmp_path):
    poller = StatusPoller(lambda: snapshot(), refresh_s=3600)
    with serve_metrics(None, 0, routes=status_routes(poller, PageLimits(requests_per_s=0.01, burst=3))) as server:
        codes = [_get(server, "/api/status")[0] for _ in range(5)]
        assert codes == [200, 200, 200, 429, 429]
        status, headers, _ = _get(server, "/")
        assert status == 429 and headers["Retry-After"] == "1"
    poller.close()


def test_a_route_that_raises_is_a_500_and_the_metrics_route_still_answers():
    def broken(client: str):
        raise RuntimeError("bug")

    with serve_metrics(Metrics(), 0, routes={"/broken": broken}) as server:
        assert _get(server, "/broken")[0] == 500
        status, _, body = _get(server, "/metrics")
        assert status == 200 and b"swarm_steps_total" in body


def test_idle_connections_beyond_the_limit_do_not_block_the_page(tmp_path):
    poller = StatusPoller(lambda: snapshot(), refresh_s=3600)
    limits = MetricsServerLimits(max_connections=8, read_timeout_s=5.0)
    with serve_metrics(None, 0, limits=limits, routes=status_routes(poller)) as server:
        idle = [socket.create_connection(("127.0.0.1", server.port), 10) for _ in range(40)]
        try:
            assert _wait(lambda: server.open_connections() <= 8)
            assert _get(server, "/api/status")[0] == 200, "the oldest idle connection made room"
            assert threading.active_count() < 40, "idle connections hold no thread"
        finally:
            for sock in idle:
                sock.close()
    poller.close()


def test_the_page_file_must_hold_one_script_and_one_style(tmp_path, monkeypatch):
    import swarm.daemon.status_page as status_page

    bad = tmp_path / "page.html"
    bad.write_text("<html><script>a</script><script>b</script><style></style></html>")
    monkeypatch.setattr(status_page, "PAGE_FILE", bad)
    page_html.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="exactly one inline <script>"):
            page_html()
    finally:
        page_html.cache_clear()


def test_a_lazy_poller_reads_only_while_the_page_is_asked_for():
    source = CountingSource(snapshot())
    poller = StatusPoller(source, refresh_s=0.05, idle_s=0.5)
    try:
        with serve_metrics(None, 0, routes=status_routes(poller)) as server:
            assert not poller.ready.wait(0.3) and source.reads == 0, "nobody looked: no read"
            assert json.loads(_get(server, "/api/status")[2])["error"] == "not read yet"
            assert _wait(lambda: source.reads >= 3), "asked for: it reads every refresh_s"
            assert json.loads(_get(server, "/api/status")[2])["run"] == XSS
            assert _settles(lambda: source.reads, quiet_s=1.0), "idle past idle_s: it stops reading"
            stopped = source.reads
            _get(server, "/api/status")
            assert _wait(lambda: source.reads > stopped), "asked for again: it reads again"
    finally:
        poller.close()
    assert not poller._thread.is_alive()


class FakeDHT:
    """What a DhtReader asks of a SwarmDHT, from `records()`; counts its reads."""

    def __init__(self, relay_address: str):
        from dataclasses import replace

        self.peers_, self.links_, self.plan, self.trainers_ = records()
        self.peers_ = [replace(p, address=relay_address) if p.peer_id == R else p for p in self.peers_]
        self.reads = 0

    def peers(self):
        self.reads += 1
        return self.peers_

    def links(self):
        return self.links_

    def get_plan(self):
        return self.plan

    def trainers(self):
        return self.trainers_


def test_the_dht_reader_probes_bootstrap_peers_and_relays_and_keeps_plan_history(tmp_path):
    from dataclasses import replace

    with socket.create_server(("127.0.0.1", 0)) as listening, socket.create_server(("127.0.0.1", 0)) as closed:
        up, down = listening.getsockname()[1], closed.getsockname()[1]
        closed.close()  # nothing listens there now
        dht = FakeDHT(relay_address=f"127.0.0.1:{up}")
        boot = [f"/ip4/127.0.0.1/tcp/{up}/p2p/QmBoot", f"/ip4/127.0.0.1/tcp/{down}/p2p/QmGone", "/ip4/1.2.3.4/udp/1"]
        reader = DhtReader(dht, "run", boot, str(write_steps(tmp_path)), metrics_of=lambda peers: {}, probe_timeout_s=2)
        try:
            snap = reader()
            assert [b["alive"] for b in snap["bootstrap"]] == [True, False, False]
            assert snap["bootstrap"][2]["error"] == "no TCP address in it"
            (relay,) = snap["relays"]
            assert relay["alive"] and relay["probe"]["alive"] and relay["probe"]["rtt_ms"] is not None
            dht.peers_ = [replace(p, address=f"127.0.0.1:{down}") if p.peer_id == R else p for p in dht.peers_]
            dht.plan = replace(dht.plan, version=4)
            snap = reader()
            (relay,) = snap["relays"]
            assert relay["announced"] and not relay["probe"]["alive"] and not relay["alive"], "announced, unreachable"
            assert [h["version"] for h in snap["plan_history"]] == [3, 4]
            assert snap["steps"]["rows"] == 40 and snap["peers"][0]["answered"] is False
        finally:
            reader.close()


def test_the_trainers_metrics_port_page_reads_only_when_asked(tmp_path):
    from swarm.peers.dht_config import DHTConfig
    from swarm.train.trainer import TrainConfig, trainer_page

    dht = FakeDHT(relay_address="127.0.0.1:9")
    write_steps(tmp_path / "train")
    cfg = TrainConfig(out=str(tmp_path / "train"), dht=DHTConfig(run_name="trainer-run"))
    page = trainer_page(dht, cfg)
    try:
        with serve_metrics(Metrics(), 0, routes=page.routes) as server:
            assert dht.reads == 0, "nobody looked at the page: the trainer's DHT node is not asked"
            assert _get(server, "/")[0] == 200 and _get(server, "/metrics")[0] == 200
            _get(server, "/api/status")
            assert poller_reads(page.poller, 30), "asked for: it reads"
            snap = json.loads(_get(server, "/api/status")[2])
            assert snap["run"] == "trainer-run"
            assert snap["steps"]["rows"] == 40 and len(snap["stages"]) == 2
    finally:
        page.close()
