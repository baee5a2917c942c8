"""`swarm stop`: tells every peer of a run to checkpoint its own layers and exit, and waits until they have.

It joins the run's DHT, stores a stop order signed with `--identity` (`swarm.peers.stop`: in an owned run the
owner's key or a delegated trainer's; in a private run one of its `--trainers`, proving `--run-secret-file`;
in an unowned run any key), then watches the peers that were announced: each one's stage service stops
listening once it has written its final checkpoint. Peers obey within a few seconds (they read the order every
2 s, finish the open step, save); trainers that watch the order stop after their current step.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import dataclass, field
from functools import cache

from swarm.daemon.bootstrap import LOG_FORMAT, reader_dht_config
from swarm.daemon.status import listening
from swarm.flags import Flags, flag
from swarm.options import DHT_FLAGS
from swarm.peers.dht import SwarmDHT, quiet_hivemind
from swarm.peers.dht_config import DHTConfig

__all__ = ["StopConfig", "add_arguments", "run", "stop_flags"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StopConfig:
    """Everything `swarm stop` is told: its fields are its flags (`stop_flags`)."""

    address_file: str | None = field(default=None, metadata=flag(metavar="PATH", group="DHT"))
    """read multiaddrs to join through from PATH (as `swarm bootstrap --address-file` writes them), in addition to
    any --initial-peers"""
    dht: DHTConfig = field(default_factory=DHTConfig, metadata={"flag": DHT_FLAGS})
    """How it joins the DHT; --identity is the key that signs the order (an owned run: owner.key or a trainer's)."""
    reason: str = ""
    """why, in a few words: every peer logs it"""
    wait_s: float = 60.0
    """wait at most this long, in seconds, for every announced peer to stop (0: issue the order and return)"""
    json: bool = False
    """print one JSON object (order, peers stopped, peers still up) instead of lines"""
    timeout_s: float = 20.0
    """bound, in seconds, on joining the DHT and on each query"""

    def __post_init__(self) -> None:
        if self.wait_s < 0 or self.timeout_s <= 0:
            raise ValueError("StopConfig: need wait_s >= 0 and timeout_s > 0")

    def dht_config(self) -> DHTConfig:
        """The DHT config to join with: the address file's peers too, in client mode, bounded by --timeout-s.

        Raises:
            OSError: the address file cannot be read.
            ValueError: nothing to join (no initial peers, no address file).
        """
        return reader_dht_config(self.dht, self.address_file, self.timeout_s)


@cache
def stop_flags() -> Flags[StopConfig]:
    return Flags(StopConfig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    stop_flags().add_to(parser)
    parser.add_argument("-v", "--verbose", action="store_true", help="log our and hivemind's info messages")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format=LOG_FORMAT)
    quiet_hivemind(logging.INFO if args.verbose else logging.WARNING)
    try:
        cfg = stop_flags().from_args(args)
        config = cfg.dht_config()
    except (OSError, ValueError) as e:
        logger.error("%s", e)
        return 2
    say = (lambda _: None) if cfg.json else (lambda line: print(line, file=sys.stderr))
    try:
        with SwarmDHT(config) as dht:
            code, report = stop_run(dht, cfg.reason, cfg.wait_s, say)
    except (TimeoutError, RuntimeError) as e:
        logger.error("%s", e)
        return 1
    if cfg.json:
        print(json.dumps(report))
    elif "error" in report:
        logger.error("%s", report["error"])
    return code


def stop_run(dht: SwarmDHT, reason: str, wait_s: float, say) -> tuple[int, dict]:
    """Issues the stop order (refused here first if this key may not stop the run) and waits up to `wait_s` for
    the announced peers to stop listening; (exit code, report)."""
    from swarm.peers.stop import StopOrder, issue_stop, stop_authority

    secret = dht.config.run_secret
    draft = StopOrder(dht.config.run_name, 0.0, reason, dht.peer_id)
    try:
        stop_authority(dht).check(draft if secret is None else draft.prove(secret))
    except ValueError as e:
        return 2, {"error": f"{e} (this key's id is {dht.peer_id}; give the right one with --identity)"}
    peers = {p.peer_id: p.address for p in dht.peers()}
    order = issue_stop(dht, reason)
    say(f"stop order for run {order.run} stored (signed by {order.signer}); {len(peers)} peers announced")
    up = dict(peers)
    deadline = time.monotonic() + wait_s
    while up and time.monotonic() < deadline:
        for pid, address in list(up.items()):
            if not listening(address):
                del up[pid]
                say(f"peer {pid} at {address} stopped ({len(peers) - len(up)} of {len(peers)})")
        if up:
            time.sleep(0.5)  # polling the peers' ports; the deadline bounds it
    report = {
        "run": order.run, "signer": order.signer, "issued_at": order.issued_at, "reason": order.reason,
        "stopped": sorted(set(peers) - set(up)), "still_up": sorted(up),
    }  # fmt: skip
    if up and wait_s > 0:
        say(f"still up after {wait_s:.0f} s: " + ", ".join(f"{p} at {a}" for p, a in sorted(up.items())))
        return 1, report
    if not up:
        say("every announced peer stopped")
    return 0, report
