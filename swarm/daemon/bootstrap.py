"""`swarm bootstrap`: a DHT node that peers and trainers join through; prints its multiaddrs, serves until stopped.

Also home of the address files that every command joining the DHT shares (status, peer, train).
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
from dataclasses import dataclass, field
from functools import cache

from swarm.flags import Flag, Flags, flag
from swarm.options import DHT_FLAGS
from swarm.peers.dht import SwarmDHT, quiet_hivemind
from swarm.peers.dht_config import DHTConfig

__all__ = [
    "BootstrapConfig",
    "add_arguments",
    "bootstrap_flags",
    "joined_peers",
    "read_address_file",
    "run",
    "write_address_file",
]

logger = logging.getLogger(__name__)

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


_DHT_FLAGS = dataclasses.replace(
    DHT_FLAGS,
    only=(*DHT_FLAGS.only, "identity_path"),
    fields={
        **DHT_FLAGS.fields,
        "identity_path": Flag(
            metavar="PATH",
            help="libp2p identity file of the DHT node (created if missing): with --port, the multiaddrs stay the "
            "same across restarts, so peers' --initial-peers stay valid (--identity is the swarm peer id's RSA key)",
        ),
    },
)


@dataclass(frozen=True)
class BootstrapConfig:
    """Everything `swarm bootstrap` is told: its fields are its flags (`bootstrap_flags`)."""

    address_file: str | None = field(default=None, metadata=flag(metavar="PATH", group="DHT"))
    """also write the node's multiaddrs to PATH, one per line, once it is up (atomically, so scripts can wait for
    the file); the file is removed on exit"""
    dht: DHTConfig = field(default_factory=DHTConfig, metadata={"flag": _DHT_FLAGS})
    """The node: where it listens, the run it serves, its libp2p identity (--identity-path) and its trust."""
    report_s: float = 60.0
    """seconds between log lines counting the run's announced peers (0: never)"""


@cache
def bootstrap_flags() -> Flags[BootstrapConfig]:
    """`swarm bootstrap`'s flags: `bootstrap_flags().to_argv(config)` is the command line of that node."""
    return Flags(BootstrapConfig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    bootstrap_flags().add_to(parser)
    parser.add_argument("-v", "--verbose", action="store_true", help="also log hivemind's info messages")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    quiet_hivemind(logging.INFO if args.verbose else logging.WARNING)
    try:
        boot = bootstrap_flags().from_args(args)
    except ValueError as e:
        logger.error("%s", e)
        return 2
    config = boot.dht

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
            if boot.address_file:
                write_address_file(boot.address_file, maddrs)
            logger.info("bootstrap node up for run %r; join with --initial-peers %s", config.run_name, " ".join(maddrs))
            try:
                while not stop.wait(boot.report_s if boot.report_s > 0 else None):
                    _report(dht)
            finally:
                if boot.address_file:
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(boot.address_file)
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


def read_address_file(path: str) -> list[str]:
    """The multiaddrs in an address file: one per line, blank lines and '#' comments ignored."""
    with open(path) as f:
        return [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]


def joined_peers(initial_peers: tuple[str, ...], address_file: str | None) -> tuple[str, ...]:
    """`initial_peers` and the multiaddrs in `address_file`, each once (so joining them again changes nothing)."""
    extra = read_address_file(address_file) if address_file else []
    return tuple(dict.fromkeys([*initial_peers, *extra]))


def reader_dht_config(dht: DHTConfig, address_file: str | None, timeout_s: float) -> DHTConfig:
    """The DHT config a short-lived reader (`swarm status`, `swarm stop`) joins with: `dht`'s initial peers and the
    address file's, in client mode (a reader should not become a home for others' records), bounded by
    `timeout_s`.

    Raises:
        OSError: the address file cannot be read.
        ValueError: nothing to join (no initial peers, no address file).
    """
    initial_peers = joined_peers(dht.initial_peers, address_file)
    if not initial_peers:
        raise ValueError("nothing to join: give --initial-peers MADDR... or --address-file PATH")
    return dataclasses.replace(
        dht, initial_peers=initial_peers, client_mode=True, start_timeout_s=timeout_s, request_timeout_s=timeout_s
    )


def write_address_file(path: str, maddrs: Sequence[str]) -> None:
    """Writes multiaddrs one per line, atomically: a reader never sees a half-written file."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write("".join(f"{m}\n" for m in maddrs))
    os.replace(tmp, path)
