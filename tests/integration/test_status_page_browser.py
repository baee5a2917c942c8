"""The status page in a real headless browser (Chromium, from Debian's `chromium` package): it fetches
/api/status, draws the run, and shows a hostile run name and bootstrap address as text, never as markup.
Skipped, with the reason, where no Chromium is installed."""

from __future__ import annotations

import html
import re
import shutil
import subprocess
from html.parser import HTMLParser

import pytest

from swarm.daemon.status_page import StatusPoller, status_routes
from swarm.metrics import serve_metrics
from tests.status_fixtures import XSS, snapshot, write_steps

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "headless_shell")
BROWSER = next((b for b in BROWSERS if shutil.which(b)), None)


def headless(url: str, tmp_path, *action: str) -> subprocess.CompletedProcess:
    """Chromium, headless, run on `url` with `action` (--dump-dom, --screenshot=...), JS given 8 s of virtual
    time to fetch and draw (the page fetches /api/status at once)."""
    argv = [
        BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
        f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=8000", "--window-size=1280,1000",
        *action, url,
    ]  # fmt: skip
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


class Elements(HTMLParser):
    """The tags of a document, and its text."""

    def __init__(self):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data):
        self.text.append(data)


@pytest.mark.skipif(BROWSER is None, reason="no Chromium: `apt-get install chromium` (Debian) to run the page in one")
def test_the_page_draws_the_run_and_shows_hostile_strings_as_text(tmp_path):
    snap = snapshot(write_steps(tmp_path / "train", n=60))
    poller = StatusPoller(lambda: snap, refresh_s=3600)
    try:
        with serve_metrics(None, 0, routes=status_routes(poller)) as server:
            done = headless(f"http://127.0.0.1:{server.port}/", tmp_path, "--dump-dom")
    finally:
        poller.close()
    assert done.returncode == 0, done.stderr[-2000:]
    dom = Elements()
    dom.feed(done.stdout)
    text = " ".join(" ".join(dom.text).split())
    # drawn from /api/status by the page's script
    for shown in ("stage 1", "layers 2:4", "QmPeerCc", "QmRelayR", "1 / 2", "plan history", "v3", "16.0 samples/s"):
        assert shown in text, (shown, text[:3000])
    assert sum(tag == "polyline" for tag, _ in dom.tags) >= 3, "the loss, its mean and the throughput are drawn"
    # the hostile strings are there, as text: no element, no handler, no script of theirs ran
    assert "<img src=x onerror=\"document.title='pwned'\">" in text
    assert not any(tag == "img" for tag, _ in dom.tags)
    assert sum(tag == "script" for tag, _ in dom.tags) == 1, "only the page's own script"
    assert not any(k.startswith("on") for _, attrs in dom.tags for k in attrs)
    title = re.search(r"<title>(.*?)</title>", done.stdout, re.S).group(1)
    assert html.unescape(title) == "swarm status: " + XSS, "document.title was set from the run name, as text"
