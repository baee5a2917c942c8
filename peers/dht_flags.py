"""The DHT flags that every command joining the DHT shares (bootstrap, status, swarm-peer, train), the
`DHTConfig` they give, and address files (multiaddrs one per line, as `swarm bootstrap` writes them)."""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Sequence
from typing import Any

from swarm.peers.dht import DHTConfig, load_or_create_key

__all__ = ["add_dht_arguments", "dht_config_from_args", "read_address_file", "read_secret_file", "write_address_file"]


def add_dht_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds --initial-peers, --host, --port, --run-name to a command (its --address-file is its own)."""
    defaults = DHTConfig()
    group = parser.add_argument_group("DHT")
    group.add_argument(
        "--initial-peers",
        nargs="+",
        default=[],
        metavar="MADDR",
        help="multiaddrs of live DHT nodes to join through, as `swarm bootstrap` prints them "
        "(/ip4/HOST/tcp/PORT/p2p/ID); none starts a new swarm",
    )
    group.add_argument(
        "--host",
        default=defaults.host,
        help=f"IP address the DHT node listens on (default {defaults.host}; 0.0.0.0 to accept other machines)",
    )
    group.add_argument("--port", type=int, default=0, help="TCP port the DHT node listens on (default: any free)")
    group.add_argument(
        "--run-name",
        default=defaults.run_name,
        help=f"namespace of the run's DHT keys, so runs can share a DHT (default {defaults.run_name!r})",
    )
    group = parser.add_argument_group("identity and trust")
    group.add_argument(
        "--identity",
        metavar="FILE",
        default=None,
        help="RSA key (DER) that signs this process's records and calls; its hash is the peer id, so a restart "
        "with the same file keeps the id (created with mode 0600 if missing; default: a fresh key each start)",
    )
    group.add_argument(
        "--trusted-planners",
        type=_peer_ids,
        default=(),
        metavar="ID[,ID...]",
        help="follow plans only from these peer ids, and let only them plan (default: the elected planner, the "
        "lowest announced id holding the planner lease; a stranger can grind a key for a low id, so open "
        "swarms should name their planners)",
    )
    group.add_argument(
        "--run-secret-file",
        metavar="FILE",
        default=None,
        help="private run: a secret shared by the run's peers and trainers, read from FILE (never on the command "
        "line); stages serve only callers that know it",
    )
    group.add_argument(
        "--trainers",
        type=_peer_ids,
        default=(),
        metavar="ID[,ID...]",
        help="private run: the peer ids of the trainers the stages serve (default: any announced trainer)",
    )


def _peer_ids(text: str) -> tuple[str, ...]:
    ids = tuple(part.strip() for part in text.split(",") if part.strip())
    if not ids:
        raise argparse.ArgumentTypeError(f"expected peer ids separated by commas, got {text!r}")
    return ids


def read_secret_file(path: str) -> str:
    """The run secret in `path` (surrounding whitespace stripped). Raises ValueError naming the file."""
    try:
        with open(path, "rb") as f:
            data = f.read(4097)
    except OSError as e:
        raise ValueError(f"--run-secret-file {path}: cannot read it: {e.strerror or e}") from None
    try:
        secret = data.decode().strip()
    except UnicodeDecodeError:
        raise ValueError(f"--run-secret-file {path}: not UTF-8 text") from None
    if not secret or len(data) > 4096:
        raise ValueError(f"--run-secret-file {path}: expected 1 to 4096 bytes of text")
    return secret


def dht_config_from_args(args: argparse.Namespace, **overrides: Any) -> DHTConfig:
    """The DHTConfig of a command's parsed arguments (see add_dht_arguments), with `overrides` on top.

    Raises:
        ValueError: a flag's value is invalid (the message names the flag or field).
    """
    fields = {"initial_peers": tuple(args.initial_peers), "host": args.host, "port": args.port}
    secret_file, identity = getattr(args, "run_secret_file", None), getattr(args, "identity", None)
    if identity is not None:
        load_or_create_key(identity)  # an unreadable or malformed file fails here, named, not in a child process
    trust = {
        "signing_key_path": identity,
        "trusted_planners": tuple(getattr(args, "trusted_planners", ())),
        "allowed_trainers": tuple(getattr(args, "trainers", ())),
        "run_secret": read_secret_file(secret_file) if secret_file else None,
    }
    return dataclasses.replace(DHTConfig(run_name=args.run_name, **fields, **trust), **overrides)


def read_address_file(path: str) -> list[str]:
    """The multiaddrs in an address file: one per line, blank lines and '#' comments ignored."""
    with open(path) as f:
        return [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]


def write_address_file(path: str, maddrs: Sequence[str]) -> None:
    """Writes multiaddrs one per line, atomically: a reader never sees a half-written file."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write("".join(f"{m}\n" for m in maddrs))
    os.replace(tmp, path)
