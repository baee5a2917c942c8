"""`swarm testbed compose-run` for real: the image built, the compose swarm trained, the trainer's outputs
collected, a shaped link measured inside containers, and nothing of the run left (containers, network,
volume; a dockerd it started stopped, the FORWARD policy as before). Minutes: marked `docker`, so only
`pytest -m docker tests/integration/test_compose_run.py` runs it; it skips where no engine can be had."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import pytest

from swarm.testbed.compose_engine import forward_policy

MODEL = ["--layers", "2", "--hidden", "32", "--heads", "2", "--seq-len", "16"]


def _skip_reason() -> str | None:
    if shutil.which("docker") is None:
        return "no docker CLI (apt-get install docker.io)"
    if subprocess.run(["docker", "info"], capture_output=True, timeout=60).returncode == 0:
        return None
    if shutil.which("dockerd") is None:
        return "no docker engine running and no dockerd to start"
    if os.geteuid() != 0:
        return "no docker engine running, and starting dockerd needs root"
    return None


_REASON = _skip_reason()
pytestmark = [
    pytest.mark.docker,
    pytest.mark.integration,
    pytest.mark.timeout(3600),
    pytest.mark.skipif(_REASON is not None, reason=f"no docker engine: {_REASON}"),
]


def _leftovers() -> list[str]:
    ps = ["docker", "ps", "-a", "-q", "--filter", "label=com.docker.compose.project=swarm-testbed"]
    networks = ["docker", "network", "ls", "-q", "--filter", "label=com.docker.compose.project=swarm-testbed"]
    volumes = ["docker", "volume", "ls", "-q", "--filter", "label=com.docker.compose.project=swarm-testbed"]
    return [line for argv in (ps, networks, volumes) for line in subprocess.run(
        argv, capture_output=True, text=True, timeout=60).stdout.split()]  # fmt: skip


def test_compose_run_builds_trains_measures_and_leaves_nothing(tmp_path):
    engine_was_up = subprocess.run(["docker", "info"], capture_output=True, timeout=60).returncode == 0
    policy = forward_policy()
    argv = [sys.executable, "-m", "swarm.cli", "testbed", "compose-run", "--json", "--run-dir", str(tmp_path / "run")]
    argv += [*MODEL, "--epochs", "1", "--train-samples", "16", "--rate-mbit", "20"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=3500, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["exit_code"] == 0 and summary["steps"] == 2  # 16 samples, batches of 8, one epoch
    assert math.isfinite(summary["final_loss"]) and summary["final_loss"] > 0
    assert summary["build_s"] > 0 and summary["image_bytes"] > 100e6
    assert summary["measured_rate_mbit"] is not None, summary["rate_error"]
    assert 0.8 * 20 <= summary["measured_rate_mbit"] <= 20.5, "tbf at 20 Mbit/s inside a container"
    for name in ("steps_csv", "summary", "plot"):
        assert summary[name] and os.path.isfile(summary[name]), name
    if engine_was_up:
        assert _leftovers() == []
    else:  # the run started dockerd and stopped it again: nothing of it answers, the firewall is as it was
        assert subprocess.run(["docker", "info"], capture_output=True, timeout=60).returncode != 0
        assert forward_policy() == policy
