"""Starting and reaping the processes of a local swarm (bootstrap node, peers), so none outlives its owner."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path


class ProcessGroup:
    """Children started in their own sessions; `close()` (or leaving the `with`) stops every one of them."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_dir / f"{name}.log", "w")  # noqa: SIM115 (kept open for the child's lifetime)
        proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
        log.close()
        self.procs[name] = proc
        return proc

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                tail = self.tail(name)
                raise RuntimeError(f"{name} exited with code {proc.returncode}; last lines of its log:\n{tail}")

    def tail(self, name: str, lines: int = 15) -> str:
        path = self.log_dir / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def wait_for_file(self, path: Path, timeout_s: float) -> str:
        """Waits until a child writes `path` (non-empty), failing early if a child dies."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if path.exists() and path.stat().st_size > 0:
                return path.read_text()
            self.check_alive()
            time.sleep(0.1)
        raise TimeoutError(f"{path} did not appear within {timeout_s:.0f} s")

    def close(self, grace_s: float = 15.0, sig: int = signal.SIGTERM) -> dict[str, int | None]:
        """`sig` to every child (each stops its own helpers, e.g. its DHT process), SIGKILL to the whole
        session of any child still running after `grace_s`; returns the exit codes.

        SIGTERM makes a peer leave (it hands its stage over while the run trains on); SIGINT stops it (it
        checkpoints its own layers and exits): what a finished run's peers should do."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(sig)
        deadline = time.monotonic() + grace_s
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait(5)
        for proc in self.procs.values():  # grandchildren (hivemind's p2pd) live in the same session
            _signal_group(proc, signal.SIGKILL)
        return {name: proc.returncode for name, proc in self.procs.items()}

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def swarm_command(*args: str) -> list[str]:
    """argv running a `swarm` subcommand with this interpreter (no reliance on PATH)."""
    return [sys.executable, "-m", "swarm.cli", *args]


def peer_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "swarm.daemon.peer", *args]
