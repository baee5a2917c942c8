"""How a process joins the DHT (`DHTConfig`: where it listens, whom it joins through, its run, how long its records
live, its bounds) and the RSA key file that signs its records and names it (`load_or_create_key`)."""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass

from hivemind.utils.crypto import RSAPrivateKey

from swarm.peers.entries import MAX_TTL_S
from swarm.peers.manifest import RUN_ID_RE, RunManifest

__all__ = ["DHTConfig", "load_or_create_key"]

_RUN_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
_PEER_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_MAX_SECRET_BYTES = 4096


@dataclass(frozen=True)
class DHTConfig:
    """How a process joins the DHT and how long its records live."""

    initial_peers: tuple[str, ...] = ()
    """Multiaddrs of live DHT nodes ('/ip4/1.2.3.4/tcp/5678/p2p/12D3...'); empty starts a new swarm."""
    host: str = "127.0.0.1"
    """IP address to listen on: loopback by default, '0.0.0.0' to accept peers from other machines."""
    port: int = 0
    """TCP port to listen on; 0 picks a free one (then the multiaddr changes on every start)."""
    announce_host: str | None = None
    """Public IP address to announce instead of the listening ones (behind NAT); needs an explicit port."""
    run_name: str = "swarm"
    """Namespace of the run's keys, so several runs can share one DHT."""
    announce_ttl_s: float = 30.0
    """Lifetime of a peer's (or trainer's) announcement; one that stops refreshing it disappears this long after
    (at most 600 s: readers refuse longer-lived announcements)."""
    link_ttl_s: float = 300.0
    """Lifetime of a link measurement (at most 3600 s)."""
    plan_ttl_s: float = 3600.0
    """Lifetime of a published plan (at most 7200 s; republish to keep a plan alive longer)."""
    start_timeout_s: float = 30.0
    """Bound on starting the DHT node and joining the swarm through initial_peers."""
    request_timeout_s: float = 10.0
    """Bound on one DHT get or store."""
    client_mode: bool = False
    """Join without serving others' records (short-lived tools such as `swarm status`)."""
    identity_path: str | None = None
    """libp2p identity file, so a bootstrap node keeps its multiaddr across restarts (created if missing)."""
    signing_key_path: str | None = None
    """RSA key that signs this peer's records and defines its peer id (created if missing); None: a fresh key."""
    trusted_planners: tuple[str, ...] = ()
    """Peer ids whose plans readers accept (and who may plan); empty: the elected planner's (`elected_planner`)."""
    run_secret: str | None = None
    """Shared secret of a private run: stages serve only callers that prove they know it; None: open run."""
    allowed_trainers: tuple[str, ...] = ()
    """Peer ids of the trainers a private run serves (the planner names only these); empty: any trainer."""
    run: str | None = None
    """The owned run to join: its id (the manifest is fetched from the DHT and verified) or its manifest file;
    its id becomes the run name. None: an unowned run under `run_name` (any peer can take over its planning)."""
    separate_process: bool = False
    """Run the DHT node in a forked child process (hivemind.DHT) rather than in a thread of this process
    (`swarm.peers.dht_node`): a second interpreter, ~140 MB more per process (`swarm bench footprint`), for a
    node whose event loop never waits for this process's GIL."""

    def __repr__(self) -> str:
        # a config is logged and printed; the run secret must never be
        shown = "<hidden>" if self.run_secret is not None else None
        fields = ", ".join(f"{f}={getattr(self, f)!r}" for f in self.__dataclass_fields__ if f != "run_secret")
        return f"DHTConfig({fields}, run_secret={shown})"

    def __post_init__(self) -> None:
        object.__setattr__(self, "initial_peers", tuple(self.initial_peers))
        for name in ("trusted_planners", "allowed_trainers"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
            for pid in getattr(self, name):
                if not isinstance(pid, str) or _PEER_ID_RE.fullmatch(pid) is None:
                    raise ValueError(f"DHTConfig.{name}: expected peer ids of 1-64 [A-Za-z0-9._-], got {pid!r}")
        if self.run_secret is not None and not 1 <= len(str(self.run_secret).encode()) <= _MAX_SECRET_BYTES:
            raise ValueError(f"DHTConfig.run_secret: expected 1 to {_MAX_SECRET_BYTES} bytes")
        for maddr in self.initial_peers:
            if not isinstance(maddr, str) or not maddr.startswith("/") or "/p2p/" not in maddr:
                raise ValueError(f"DHTConfig.initial_peers: expected multiaddrs with a /p2p/ part, got {maddr!r}")
        for name in ("host", "announce_host"):
            value = getattr(self, name)
            try:
                if value is not None or name == "host":
                    ipaddress.ip_address(value)
            except ValueError:
                raise ValueError(f"DHTConfig.{name}: expected an IP address, got {value!r}") from None
        if not 0 <= self.port <= 65535:
            raise ValueError(f"DHTConfig.port: expected a port in [0, 65535], got {self.port}")
        if self.announce_host is not None and self.port == 0:
            raise ValueError("DHTConfig.port: announce_host needs an explicit port (0 can't be announced)")
        if self.run is not None:
            self._own_run()
        if _RUN_NAME_RE.fullmatch(self.run_name) is None:
            raise ValueError(f"DHTConfig.run_name: expected 1-64 characters [A-Za-z0-9_-], got {self.run_name!r}")
        for name in ("announce_ttl_s", "link_ttl_s", "plan_ttl_s", "start_timeout_s", "request_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"DHTConfig.{name}: expected a positive number of seconds, got {getattr(self, name)}")
        for name, kind in (("announce_ttl_s", "peers"), ("link_ttl_s", "links"), ("plan_ttl_s", "plan")):
            if getattr(self, name) > MAX_TTL_S[kind]:
                raise ValueError(f"DHTConfig.{name}: at most {MAX_TTL_S[kind]:.0f} s (readers refuse longer lives)")

    def _own_run(self) -> None:
        """An owned run: its id is the run name; its planners and trainers come from the manifest only."""
        run = self.run if RUN_ID_RE.fullmatch(str(self.run)) else RunManifest.load(str(self.run)).run_id
        if self.run_name not in ("swarm", run):
            raise ValueError(f"DHTConfig.run_name: {self.run_name!r}, but run {run}'s keys are under its id")
        if self.trusted_planners or self.allowed_trainers:
            raise ValueError(
                "DHTConfig: --trusted-planners and --trainers are for private runs; an owned run's planners and "
                "trainers are the ones its manifest and the owner's delegations name"
            )
        object.__setattr__(self, "run_name", run)

    def run_manifest(self) -> RunManifest | None:
        """The manifest of `run` when it is a file (read and verified), else None (fetched by id on joining)."""
        if self.run is None or RUN_ID_RE.fullmatch(self.run):
            return None
        return RunManifest.load(self.run, self.run_name)

    @property
    def host_maddrs(self) -> list[str]:
        return [_maddr(self.host, self.port)]

    @property
    def announce_maddrs(self) -> list[str] | None:
        return None if self.announce_host is None else [_maddr(self.announce_host, self.port)]


def _maddr(host: str, port: int) -> str:
    return f"/ip{ipaddress.ip_address(host).version}/{host}/tcp/{port}"


def load_or_create_key(path: str | None) -> RSAPrivateKey:
    """The RSA key that signs a peer's records: read from `path`, created there (mode 0600) if missing, or fresh.

    The key defines the peer id, so a peer started again with the same file keeps its id.

    Raises:
        ValueError: the file can't be read or holds no RSA private key (the message names the file).
    """
    if path is None:
        return RSAPrivateKey()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return _read_key(path)
    except OSError as e:
        raise ValueError(f"identity file {path}: cannot create it: {e.strerror or e}") from None
    key = RSAPrivateKey()
    with os.fdopen(fd, "wb") as f:
        f.write(key.to_bytes())
    return key


def _read_key(path: str) -> RSAPrivateKey:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    try:
        with open(path, "rb") as f:
            data = f.read(1 << 16)
    except OSError as e:
        raise ValueError(f"identity file {path}: cannot read it: {e.strerror or e}") from None
    try:
        loaded = serialization.load_der_private_key(data, password=None)
    except (ValueError, TypeError) as e:
        raise ValueError(f"identity file {path}: not an RSA private key in DER ({e})") from None
    if not isinstance(loaded, rsa.RSAPrivateKey):
        raise ValueError(f"identity file {path}: holds a {type(loaded).__name__}, not an RSA private key")
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key._private_key = loaded  # what hivemind's own (pickle-free) __setstate__ does with DER bytes
    return key
