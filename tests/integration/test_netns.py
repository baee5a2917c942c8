"""The namespace testbed for real (root and `ip netns` needed): a 2-peer swarm, each process in its own
namespace, links shaped by tc; the shaped rate holds, peers announce across the bridge, the trainer trains,
and `down` leaves no namespace, link or process behind, also after the testbed process was SIGKILLed."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest

from swarm.testbed.netns import list_links, list_namespaces, measure_rate, namespace_pids, sweep, unavailable_reason
from tests.integration.swarm_fixtures import alive

PREFIX = "swt-"
MODEL = ["--layers", "2", "--hidden", "32", "--heads", "2", "--seq-len", "16"]


def _skip_reason() -> str | None:
    reason = unavailable_reason()
    if reason is None and (list_namespaces(PREFIX) or list_links(PREFIX)):
        reason = f"a testbed with prefix {PREFIX!r} is up already (`swarm testbed down` removes it)"
    return reason


_REASON = _skip_reason()
pytestmark = [
    pytest.mark.netns,
    pytest.mark.integration,
    pytest.mark.timeout(240),
    pytest.mark.skipif(_REASON is not None, reason=f"namespace testbed unavailable: {_REASON}"),
]


def run_testbed(*args: str, timeout_s: float) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "swarm.cli", "testbed", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)


def assert_nothing_left(pids: list[int]) -> None:
    assert list_namespaces(PREFIX) == [] and list_links(PREFIX) == []
    assert [pid for pid in pids if alive(pid)] == []


def test_up_shapes_links_announces_trains_and_down_leaves_nothing(tmp_path):
    run_dir = tmp_path / "testbed"
    pids: list[int] = []
    try:
        up = run_testbed(
            "up", "--run-dir", str(run_dir), "--peers", "2", "--rate-mbit", "10", *MODEL,
            "--train", "--epochs", "1", "--train-samples", "16", timeout_s=150,
        )  # fmt: skip
        assert up.returncode == 0, up.stderr[-3000:]
        pids = [pid for ns in list_namespaces(PREFIX) for pid in namespace_pids(ns)]

        # both peers announced their stage from their own namespace's address, seen from the trainer's
        dht = json.loads((run_dir / "dht_status.json").read_text())
        assert sorted((p["address"], p["stage"] is not None) for p in dht["peers"]) == [
            ("10.77.0.10:50051", True),
            ("10.77.0.11:50051", True),
        ]
        assert sorted(p["stage"] for p in dht["peers"]) == [0, 1]
        summary = json.loads((run_dir / "train" / "summary.json").read_text())
        assert summary["steps"] == 2 and math.isfinite(summary["final_loss"]) and summary["wire_bytes"] > 0
        assert "steps:        2" in up.stdout

        # the kernel holds the configured rate: TCP goodput within 10 % of 10 Mbit/s (2 MB, about 1.7 s)
        goodput_mbit = measure_rate(f"{PREFIX}peer0", f"{PREFIX}peer1", 2_000_000, timeout_s=30) * 8 / 1e6
        assert abs(goodput_mbit / 10 - 1) < 0.10, f"{goodput_mbit:.2f} Mbit/s on a 10 Mbit/s link"

        status = run_testbed("status", "--run-dir", str(run_dir), "--json", timeout_s=60)
        assert status.returncode == 0, status.stderr
        rows = {r["service"]: r for r in json.loads(status.stdout)["namespaces"]}
        assert list(rows) == ["bootstrap", "peer0", "peer1", "trainer"]
        assert all(r["shaping"] == "tbf 10 Mbit/s" and r["sent_bytes"] > 0 for r in rows.values())
        assert any(p.startswith("swarm-peer") for p in rows["peer0"]["processes"])

        down = run_testbed("down", "--run-dir", str(run_dir), timeout_s=60)
        assert down.returncode == 0, down.stderr
        assert_nothing_left(pids)
        assert run_testbed("status", "--run-dir", str(run_dir), timeout_s=30).returncode == 1
    finally:
        sweep(PREFIX, grace_s=2)


def test_down_cleans_up_after_the_testbed_process_is_killed(tmp_path):
    run_dir = tmp_path / "testbed"
    argv = [sys.executable, "-m", "swarm.cli", "testbed", "up", "--run-dir", str(run_dir), "--peers", "2", *MODEL]
    up = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 90
        while True:  # kill it once both peers run inside their namespaces, mid-start
            assert up.poll() is None and time.monotonic() < deadline, "the testbed never started its peers"
            if all(namespace_pids(f"{PREFIX}peer{i}") for i in range(2)):
                break
            time.sleep(0.2)
        os.kill(up.pid, signal.SIGKILL)
        up.wait(10)
        pids = [pid for ns in list_namespaces(PREFIX) for pid in namespace_pids(ns)]
        assert pids and list_links(PREFIX), "the crash should leave processes and links behind"

        down = run_testbed("down", "--run-dir", str(run_dir), timeout_s=60)
        assert down.returncode == 0, down.stderr
        assert "removed 4 namespaces" in down.stdout
        assert_nothing_left(pids)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait(10)
        sweep(PREFIX, grace_s=2)
