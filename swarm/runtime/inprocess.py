"""The swarm's runtime in one process: stage hosts (one per stage, or R replicas of each), in-process links.

`LocalPipeline` builds the same `StageHost`s and `StageServicer`s a swarm runs, registers them on a
`LocalNetwork` instead of gRPC servers, and drives them with the same `PipelineDriver` as `swarm train`.
So the convergence experiment and the unit tests run the code the swarm runs: every activation is encoded,
framed, cut into stream items, parsed, unframed and decoded, and the bytes counted are the stream items'.
Calls are authenticated and authorized as in a swarm: each host and the driver has its own key, every call
carries a signed token, and each stage serves only its plan neighbours and the driver (`auth=False` turns
that off, for measuring its cost).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence

import grpc
import torch

from swarm.compression import CodecConfig
from swarm.model.data import Batch, SampleSet
from swarm.model.gpt import split_layers
from swarm.model.spec import AnyModelConfig
from swarm.net.auth import CallSigner, CallVerifier, Identity
from swarm.net.connect import LocalNetwork
from swarm.peers.shaper import LinkShaping
from swarm.runtime.boundary import LinkEnds
from swarm.runtime.driver import PipelineDriver, StepResult
from swarm.runtime.freeze import FreezePolicy, FreezingDriver
from swarm.runtime.host import StageHost, StageRole
from swarm.runtime.policy import Roster
from swarm.runtime.referee import StageReferee
from swarm.runtime.schedules import SCHEDULES
from swarm.runtime.service import StageServicer
from swarm.runtime.worker import StageConfig, StageWorker

__all__ = ["LocalPipeline"]


class LocalPipeline:
    """Stage hosts in this process, joined by in-process links, driven one optimizer step at a time.

    With `replicas` R > 1, every stage has R hosts and replica r of every stage forms route r (a nested
    roster, `StageRole.replica`); with a per-stage sequence (R_0, R_1, ...), stage s has R_s hosts and the
    driver runs the lcm(R_s) routes of `swarm.peers.routes`. `kill` takes a host off the network for fault
    tests.

    Args:
        model: the model to split.
        n_stages: pipeline stages (even layer ranges, see `split_layers`).
        forward: codec of the activations on every boundary.
        backward: codec of the activation gradients on every boundary.
        schedule: a name in `swarm.runtime.schedules.SCHEDULES`.
        stage_cfg: optimizer and precision of every stage.
        shaping: application-level link shaping (None: unshaped).
        adaptive_zstd: decide zstd per link from its rate as a swarm does; the default compresses every
            message where it shrinks it, as on the slow links this pipeline stands for.
        auth: authenticate every call and authorize it by the roster (a key per host and one for the
            driver, generated here); False only to measure what that costs.
        replicas: hosts per stage: one count for every stage, or one per stage.
        layers: each stage's [start, end) layers (default: `split_layers`, as even as possible).
    """

    def __init__(
        self,
        model: AnyModelConfig,
        n_stages: int,
        forward: CodecConfig | None = None,
        backward: CodecConfig | None = None,
        schedule: str = "1f1b",
        stage_cfg: StageConfig | None = None,
        shaping: LinkShaping | None = None,
        adaptive_zstd: bool = False,
        auth: bool = True,
        replicas: int | Sequence[int] = 1,
        layers: Sequence[tuple[int, int]] | None = None,
    ):
        counts = [replicas] * n_stages if isinstance(replicas, int) else [int(r) for r in replicas]
        if n_stages < 1 or len(counts) != n_stages or min(counts) < 1:
            raise ValueError(f"a pipeline needs at least one stage and replica each, got {n_stages} x {replicas}")
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r}; expected one of {sorted(SCHEDULES)}")
        self.model, self.schedule, self.replicas = model, schedule, replicas
        self.shaping, self.adaptive_zstd = shaping, adaptive_zstd
        self.network = LocalNetwork()
        self.counts = tuple(counts)
        grid = [(s, r) for s in range(n_stages) for r in range(counts[s])]
        # one replica keeps the addresses a single pipeline always had
        name = (lambda s, r: f"{s}") if max(counts) == 1 else (lambda s, r: f"{s}.{r}")
        self.replica_addresses = [[f"local:{name(s, r)}" for r in range(counts[s])] for s in range(n_stages)]
        self.addresses = [a[0] for a in self.replica_addresses]
        self.replica_hosts: list[list[StageHost]] = [[] for _ in range(n_stages)]
        self.switches: list[list[_Switch]] = [[] for _ in range(n_stages)]
        """what the network serves at each host's address: its servicer, until `kill`"""
        forward, backward = forward or CodecConfig("fp32"), backward or CodecConfig("fp32")
        # identities: one per host and one for the driver (the trainer), as separate peers would hold
        ids = {key: Identity.generate() for key in grid} if auth else {}
        # without auth, ids as long as real ones (the calls' bytes are the same) and the same in every run: the
        # route split of the samples hashes them (`routing.assign_samples`), so a run repeats to the bit
        peer = {key: ids[key].peer_id if auth else _local_peer_id(name(*key)) for key in grid}
        self.trainer = Identity.generate() if auth else None
        self.replica_peers = [[peer[(s, r)] for r in range(counts[s])] for s in range(n_stages)]
        trainers = frozenset([self.trainer.peer_id] if self.trainer else [])
        roster = Roster(
            self._shape(self.replica_peers), self._shape(self.replica_addresses), trainers, frozenset(peer.values())
        )
        cfg = stage_cfg or StageConfig()
        layers = list(layers) if layers is not None else split_layers(model.n_layers, n_stages)
        if len(layers) != n_stages:
            raise ValueError(f"{len(layers)} layer ranges for {n_stages} stages")
        self.referee = StageReferee(model, layers, cfg)
        """the trainer's own recomputation, which settles a dispute between two replicas (`swarm.runtime.referee`)"""
        for s, r in grid:
            role = StageRole(s, n_stages, *layers[s], replica=r)
            connector = self.network.connector(CallSigner(ids[(s, r)]) if auth else None)
            host = StageHost(role, model, cfg, self._links(forward, backward), peer[(s, r)], connector)
            verifier = CallVerifier(peer[(s, r)]) if auth else None
            servicer = StageServicer(host, verifier, roster)  # without auth the roster only gives routes
            self.switches[s].append(_Switch(servicer))
            self.network.register(self.replica_addresses[s][r], self.switches[s][r], peer[(s, r)])
            self.replica_hosts[s].append(host)
        self.hosts = [h[0] for h in self.replica_hosts]
        self.killed: set[tuple[int, int]] = set()
        self._driver: PipelineDriver | None = None
        self._step = 0
        self.freeze: FreezePolicy | None = None
        """the trainer's freezing criterion (`swarm.runtime.freeze`); set before the first step"""
        self.driver_options: dict = {}
        """keyword arguments of every driver this pipeline makes (`PipelineDriver`'s), under `driver`'s own"""

    def _shape(self, grid: list[list[str]]) -> tuple:
        """Flat (one replica per stage, the roster's original shape) or nested `[stage][replica]`."""
        return tuple(row[0] for row in grid) if max(self.counts) == 1 else tuple(tuple(row) for row in grid)

    def kill(self, stage: int, replica: int = 0) -> None:
        """Takes that replica's host off the network: every later call to it fails with UNAVAILABLE, as a call
        to a peer that is gone does (calls already inside it run on, as in a killed process's last moments)."""
        self.switches[stage][replica].killed = True
        self.killed.add((stage, replica))

    def _links(self, forward: CodecConfig, backward: CodecConfig) -> LinkEnds:
        return LinkEnds(forward, backward, self.shaping, adaptive_zstd=self.adaptive_zstd)

    @property
    def workers(self) -> list[StageWorker]:
        """Replica 0 of every stage (the replicas hold the same weights)."""
        return [h.worker for h in self.hosts]

    def set_codecs(self, forward: CodecConfig, backward: CodecConfig) -> None:
        """Fresh boundary ends with these codecs on every stage (AQ-SGD buffers start empty), between steps."""
        for host in (h for row in self.replica_hosts for h in row):
            host.apply(dataclasses.replace(host.assignment, links=self._links(forward, backward)))

    def driver(self, n_micro: int, **driver_options) -> PipelineDriver:
        """The driver for steps of `n_micro` micro-batches; `driver_options` (PipelineDriver's keyword
        arguments) make a fresh one."""
        if self._driver is None or self._driver.n_micro != n_micro or driver_options:
            if self._driver is not None:
                self._driver.close()
            connector = self.network.connector(CallSigner(self.trainer) if self.trainer else None)
            route, peers = self._shape(self.replica_addresses), self._shape(self.replica_peers)
            options = {"tied": self.model.tied_embeddings, "referee": self.referee, **self.driver_options,
                       **driver_options}  # fmt: skip
            if self.freeze is not None:
                options["policy"] = self.freeze
            cls = PipelineDriver if self.freeze is None else FreezingDriver
            self._driver = cls(route, peers, self.schedule, n_micro, connector=connector, **options)
        return self._driver

    def train_step(self, batch: Batch, n_micro: int) -> StepResult:
        """One optimizer step on `batch` split into `n_micro` micro-batches."""
        result = self.driver(n_micro).train_step(self._step, batch)
        self._step += 1
        return result

    def forward_backward(self, batch: Batch, n_micro: int) -> float:
        """Every micro-batch's forward and backward, no optimizer step: the gradients stay on the stages (for
        checks) until `abandon_step`. Returns the mean loss."""
        loss, _ = self.driver(n_micro).forward_backward(self._step, batch)
        return loss

    def abandon_step(self) -> None:
        """Drops the gradients of a `forward_backward` and moves to the next step."""
        if self._driver is not None:
            self._driver.abandon(self._step)
        self._step += 1

    @torch.no_grad()
    def evaluate(self, data: SampleSet, batch_size: int) -> float:
        """Mean loss over `data` through the stages' exact forward (no codecs, nothing kept).

        Held-out samples have no AQ-SGD buffers and evaluation should measure the weights, not the link,
        so this bypasses the boundaries.
        """
        total, count = 0.0, 0
        for start in range(0, len(data), batch_size):
            batch = data.batch(slice(start, start + batch_size))
            x = batch.tokens
            for worker in self.workers[:-1]:
                x = worker.infer(x)
            total += float(self.workers[-1].infer(x, batch.targets)) * len(batch.sample_ids)
            count += len(batch.sample_ids)
        return total / max(count, 1)

    def close(self) -> None:
        if self._driver is not None:
            self._driver.close()


class _Switch:
    """Serves `target`'s methods until `killed`; then every call fails with UNAVAILABLE, as a call to a peer
    that is gone does. Tests may swap `target` (e.g. for a servicer that hangs)."""

    def __init__(self, target: StageServicer):
        self.target, self.killed = target, False

    def __getattr__(self, name: str):
        if not self.killed:
            return getattr(self.target, name)

        def gone(request, context):
            context.abort(grpc.StatusCode.UNAVAILABLE, f"connection refused ({name} to a killed host)")

        return gone


def _local_peer_id(name: str) -> str:
    """A peer id for an unauthenticated in-process host: 24 hex digits like a real one, fixed by its place."""
    return hashlib.blake2b(f"local:{name}".encode(), digest_size=12).hexdigest()
