"""`swarm bootstrap`: a DHT node that peers and trainers join through; prints its multiaddrs, serves until stopped.

Also home of the DHT flags and address files that every command joining the DHT shares (status, peer, train).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import signal
import threading
from collections.abc import Sequence
from functools import cache
from typing import Any

from swarm.flags import Flags
from swarm.options import DHT_FLAGS
from swarm.peers.dht import DHTConfig, SwarmDHT, quiet_hivemind

__all__ = [
    "add_arguments",
    "add_dht_arguments",
    "dht_config_from_args",
    "joined_peers",
    "read_address_file",
    "run",
    "write_address_file",
]

logger = logging.getLogger(__name__)

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_dht_arguments(parser)
    parser.add_argument(
        "--address-file",
        metavar="PATH",
        help="also write the node's multiaddrs to PATH, one per line, once it is up (atomically, so scripts "
        "can wait for the file); the file is removed on exit",
    )
    parser.add_argument(
        "--identity-path",
        metavar="PATH",
        help="libp2p identity file of the DHT node (created if missing): with --port, the multiaddrs stay the "
        "same across restarts, so peers' --initial-peers stay valid (--identity is the swarm peer id's RSA key)",
    )
    parser.add_argument(
        "--report-s",
        type=float,
        default=60.0,
        help="seconds between log lines counting the run's announced peers (default 60; 0: never)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="also log hivemind's info messages")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    quiet_hivemind(logging.INFO if args.verbose else logging.WARNING)
    try:
        config = dht_config_from_args(args, identity_path=args.identity_path)
    except ValueError as e:
        logger.error("%s", e)
        return 2

    # Handlers first: a signal during the start must still end in a clean shutdown, not an orphaned daemon.
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda signum, _frame: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            dht = SwarmDHT(config)
        except (TimeoutError, RuntimeError) as e:
            logger.error("%s", e)
            return 1
        with dht:
            maddrs = dht.visible_maddrs()
            print("\n".join(maddrs), flush=True)
            if args.address_file:
                write_address_file(args.address_file, maddrs)
            logger.info("bootstrap node up for run %r; join with --initial-peers %s", config.run_name, " ".join(maddrs))
            try:
                while not stop.wait(args.report_s if args.report_s > 0 else None):
                    _report(dht)
            finally:
                if args.address_file:
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(args.address_file)
            logger.info("shutting down")
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _report(dht: SwarmDHT) -> None:
    try:
        peers = dht.peers()
    except TimeoutError as e:
        logger.warning("%s", e)
        return
    stages = sorted({p.stage for p in peers if p.stage is not None})
    logger.info("%d peers announced in run %r, serving stages %s", len(peers), dht.config.run_name, stages)


@cache
def _dht_flags() -> Flags[DHTConfig]:
    return Flags(DHTConfig, spec=DHT_FLAGS)


def add_dht_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds --initial-peers, --host, --port, --run-name and the identity and trust flags to a command (its
    --address-file is its own): `swarm.options.DHT_FLAGS`, as swarm-peer and swarm train have them."""
    _dht_flags().add_to(parser, config_flag=False)


def dht_config_from_args(args: argparse.Namespace, **overrides: Any) -> DHTConfig:
    """The DHTConfig of a command's parsed arguments (see add_dht_arguments), with `overrides` on top.

    Raises:
        ValueError: a flag's value is invalid (the message names the flag or field).
    """
    return dataclasses.replace(_dht_flags().from_args(args), **overrides)


def read_address_file(path: str) -> list[str]:
    """The multiaddrs in an address file: one per line, blank lines and '#' comments ignored."""
    with open(path) as f:
        return [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]


def joined_peers(initial_peers: tuple[str, ...], address_file: str | None) -> tuple[str, ...]:
    """`initial_peers` and the multiaddrs in `address_file`, each once (so joining them again changes nothing)."""
    extra = read_address_file(address_file) if address_file else []
    return tuple(dict.fromkeys([*initial_peers, *extra]))


def write_address_file(path: str, maddrs: Sequence[str]) -> None:
    """Writes multiaddrs one per line, atomically: a reader never sees a half-written file."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write("".join(f"{m}\n" for m in maddrs))
    os.replace(tmp, path)
