"""A whole swarm as local processes on 127.0.0.1: a DHT bootstrap node and swarm-peer daemons, found
through the DHT like any remote swarm, and all stopped when the `with` block ends."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from swarm.testbed.procs import ProcessGroup, peer_command, swarm_command


@dataclass
class LocalSwarm:
    route: list[str]
    """gRPC address of each stage, in pipeline order"""
    peers: list[str]
    """peer id of each stage"""
    procs: ProcessGroup
    address_file: Path
    plan_version: int = 0
    """the plan the peers follow (0: an even split, no plan)"""
    signer: object = None
    """the `CallSigner` of the swarm's trainer: the one trainer the plan names, announced while the swarm runs"""
    found: object = None
    """the `PlanRoutes` the trainer discovered (with the plan's predicted step time); None: built from the fields"""
    dht: object = None
    """the trainer's DHT client while the swarm runs: `train(..., dht=)` follows re-published plans with it"""

    @property
    def path(self):
        from swarm.peers.routes import PlanRoutes

        return self.found if self.found is not None else PlanRoutes(self.route, self.peers, self.plan_version)


@contextmanager
def local_swarm(
    out: Path,
    n_peers: int,
    peer_flags: list[str],
    say: Callable[[str], None] = lambda _: None,
    timeout_s: float = 120.0,
    per_peer_flags: list[list[str]] | None = None,
    run=None,
    n_stages: int | None = None,
) -> Iterator[LocalSwarm]:
    """Starts a bootstrap node and `n_peers` peers (one stage each, as the planner assigns them) and waits
    until every stage is served under a plan that names this swarm's trainer (stages serve training calls
    only from the plan's trainers): train with `LocalSwarm.signer`.

    `peer_flags` (every peer's) and `per_peer_flags` (each one's own) are swarm-peer argv, e.g. a
    `PeerConfig`'s (`swarm.daemon.peer_config.peer_flags().to_argv`); they come after the swarm's own (its address
    file and stage count), so they win.

    `run` (a `swarm.daemon.run_cli.RunFiles`) makes it an owned run: every peer joins with `--run` (the
    manifest file), the first peers hold the delegated planner keys, and the trainer signs with the delegated
    trainer key; the manifest's model, codecs and schedule must agree with `peer_flags`. None: an unowned run.
    `n_stages`: the pipeline's stages when `peer_flags` plan fewer than one a peer (replicas, `--num-stages`)."""
    import time

    from swarm.daemon.bootstrap import BootstrapConfig, bootstrap_flags
    from swarm.daemon.peer_config import PeerConfig
    from swarm.daemon.peer_config import peer_flags as peer_cli
    from swarm.net.auth import CallSigner, Identity
    from swarm.peers.dht import SwarmDHT
    from swarm.peers.dht_config import DHTConfig
    from swarm.peers.reannounce import Reannouncer
    from swarm.peers.records import TrainerAnnouncement
    from swarm.train.follower import discover_route

    with ProcessGroup(out / "logs") as procs:
        address_file = out / "bootstrap.addr"
        address_file.unlink(missing_ok=True)
        owned = () if run is None else ("--run", str(run.manifest_path))
        boot = [*bootstrap_flags().to_argv(BootstrapConfig(address_file=str(address_file))), *owned]
        procs.start("bootstrap", swarm_command("bootstrap", *boot))
        procs.wait_for_file(address_file, 60)
        joining = peer_cli().to_argv(PeerConfig(address_file=str(address_file), num_stages=n_stages or n_peers))
        for i in range(n_peers):
            own = per_peer_flags[i] if per_peer_flags else []  # e.g. one peer's own --rate-mbit
            if run is not None:  # the delegated planners first, volunteers after
                keys = run.planner_keys
                own = [*owned, *(["--identity", str(keys[i])] if i < len(keys) else []), *own]
            argv = peer_command(*joining, *peer_flags, *own)
            procs.start(f"peer{i}", argv)
        initial = [line for line in address_file.read_text().splitlines() if line.strip()]
        if run is None:
            trainer, dht_config = Identity.generate(), DHTConfig(initial_peers=initial, client_mode=True)
        else:
            from swarm.peers.dht_config import load_or_create_key

            trainer = Identity(load_or_create_key(str(run.trainer_keys[0])))
            dht_config = DHTConfig(initial_peers=initial, client_mode=True, run=str(run.manifest_path))
        with SwarmDHT(dht_config, private_key=trainer.key) as dht:
            me = TrainerAnnouncement(dht.peer_id, started_at=time.time())
            with Reannouncer(dht, lambda: me):

                def show(line: str) -> None:
                    procs.check_alive()
                    say(line)

                stages = n_stages or n_peers
                found = discover_route(dht, stages, timeout_s, show, trainer_id=dht.peer_id, check=procs.check_alive)
                yield LocalSwarm(
                    found.addresses, found.peer_ids, procs, address_file, found.plan_version, CallSigner(trainer),
                    found, dht,
                )  # fmt: skip
