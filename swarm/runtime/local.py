"""The swarm's runtime in one process: one stage host per stage, wired by in-process links.

`LocalPipeline` builds the same `StageHost`s and `StageServicer`s a swarm runs, registers them on a
`LocalNetwork` instead of gRPC servers, and drives them with the same `PipelineDriver` as `swarm train`.
So the convergence experiment and the unit tests run the code the swarm runs: every activation is encoded,
framed, cut into stream items, parsed, unframed and decoded, and the bytes counted are the stream items'.
Calls are authenticated and authorized as in a swarm: each host and the driver has its own key, every call
carries a signed token, and each stage serves only its plan neighbours and the driver (`auth=False` turns
that off, for measuring its cost).
"""

from __future__ import annotations

import torch

from swarm.compression import CodecConfig
from swarm.model.data import Batch, SampleSet
from swarm.model.gpt import ModelConfig, split_layers
from swarm.net.auth import CallSigner, CallVerifier, Identity
from swarm.net.connect import LocalNetwork
from swarm.peers.shaper import LinkShaping
from swarm.runtime.boundary import LinkEnds
from swarm.runtime.driver import PipelineDriver, StepResult
from swarm.runtime.host import StageHost, StageRole
from swarm.runtime.policy import Roster
from swarm.runtime.schedules import SCHEDULES
from swarm.runtime.service import StageServicer
from swarm.runtime.worker import StageConfig, StageWorker

__all__ = ["LocalPipeline"]


class LocalPipeline:
    """Stage hosts in this process, joined by in-process links, driven one optimizer step at a time.

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
    """

    def __init__(
        self,
        model: ModelConfig,
        n_stages: int,
        forward: CodecConfig | None = None,
        backward: CodecConfig | None = None,
        schedule: str = "1f1b",
        stage_cfg: StageConfig | None = None,
        shaping: LinkShaping | None = None,
        adaptive_zstd: bool = False,
        auth: bool = True,
    ):
        if n_stages < 1:
            raise ValueError(f"a pipeline needs at least one stage, got {n_stages}")
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r}; expected one of {sorted(SCHEDULES)}")
        self.model, self.schedule = model, schedule
        self.shaping, self.adaptive_zstd = shaping, adaptive_zstd
        self.network = LocalNetwork()
        self.addresses = [f"local:{s}" for s in range(n_stages)]
        self.hosts: list[StageHost] = []
        fw, bw = forward or CodecConfig("fp32"), backward or CodecConfig("fp32")
        # identities: one per host and one for the driver (the trainer), as separate peers would hold
        ids = [Identity.generate() for _ in range(n_stages + 1)] if auth else []
        peers = [i.peer_id for i in ids[:n_stages]] or [f"local{s}" for s in range(n_stages)]
        self.trainer = ids[-1] if ids else None
        trainers = frozenset(i.peer_id for i in ids[-1:])
        roster = Roster(tuple(peers), tuple(self.addresses), trainers, frozenset(peers))
        cfg = stage_cfg or StageConfig()
        for stage, (start, end) in enumerate(split_layers(model.n_layers, n_stages)):
            role = StageRole(stage, n_stages, start, end)
            connector = self.network.connector(CallSigner(ids[stage]) if ids else None)
            host = StageHost(role, model, cfg, self._links(fw, bw), peers[stage], connector)
            servicer = StageServicer(host, CallVerifier(peers[stage]), roster) if ids else StageServicer(host)
            self.network.register(self.addresses[stage], servicer, peers[stage])
            self.hosts.append(host)
        self._driver: PipelineDriver | None = None
        self._step = 0

    def _links(self, forward: CodecConfig, backward: CodecConfig) -> LinkEnds:
        return LinkEnds(forward, backward, self.shaping, adaptive_zstd=self.adaptive_zstd)

    @property
    def workers(self) -> list[StageWorker]:
        return [h.worker for h in self.hosts]

    def set_codecs(self, forward: CodecConfig, backward: CodecConfig) -> None:
        """Fresh boundary ends with these codecs on every stage (AQ-SGD buffers start empty), between steps."""
        for host in self.hosts:
            host.links = self._links(forward, backward)

    def driver(self, n_micro: int) -> PipelineDriver:
        """The driver for steps of `n_micro` micro-batches (its thread pool must hold one per micro-batch)."""
        if self._driver is None or self._driver.n_micro != n_micro:
            if self._driver is not None:
                self._driver.close()
            peers = [h.peer_id for h in self.hosts]
            connector = self.network.connector(CallSigner(self.trainer) if self.trainer else None)
            self._driver = PipelineDriver(self.addresses, peers, self.schedule, n_micro, connector=connector)
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
