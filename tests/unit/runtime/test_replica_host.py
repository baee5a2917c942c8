"""Replicas of one stage on an in-process network: the last stage weighs its loss by the call's share, a
retried Step applies nothing, and Status tells replicas, steps and weights apart.

`Replicas` is the tiny driver these tests (and test_average) use: R authenticated replicas of a one-stage
pipeline (first and last stage at once), each fed its own rows of a batch by hand as chain r.
"""

from __future__ import annotations

import threading

import grpc
import pytest
import torch

from swarm.compression import CodecConfig
from swarm.model.gpt import ModelConfig
from swarm.net.auth import CallSigner, CallVerifier, Identity
from swarm.net.connect import LocalNetwork, LocalRpcError
from swarm.net.stream import tokens_to_wire
from swarm.proto import stage_pb2
from swarm.runtime.boundary import LinkEnds
from swarm.runtime.host import StageHost, StageRole
from swarm.runtime.policy import Roster
from swarm.runtime.service import StageServicer
from swarm.runtime.worker import StageConfig

TINY = ModelConfig(vocab_size=64, seq_len_tokens=8, hidden_dim=32, n_layers=2, n_heads=2)
FP32 = CodecConfig("fp32")
GRADQ = CodecConfig("gradq", bits=4, zstd_level=0)


def batch(rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randint(
        0, TINY.vocab_size, (rows, TINY.seq_len_tokens + 1), generator=torch.Generator().manual_seed(seed)
    )
    return w[:, :-1], w[:, 1:]


class Replicas:
    """`n` replicas of a one-stage pipeline, authenticated, on one LocalNetwork; a trainer identity drives them."""

    def __init__(self, n: int, backward: CodecConfig = FP32):
        self.network = LocalNetwork()
        self.ids = ids = [Identity.generate() for _ in range(n + 1)]
        self.trainer = ids[-1]
        self.peers = [i.peer_id for i in ids[:n]]
        self.addresses = [f"local:r{r}" for r in range(n)]
        self.roster = Roster((tuple(self.peers),), (tuple(self.addresses),), frozenset({self.trainer.peer_id}), ())
        self.hosts: list[StageHost] = []
        for r in range(n):
            connector = self.network.connector(CallSigner(ids[r]))
            host = StageHost(
                StageRole(0, 1, 0, TINY.n_layers, replica=r),
                TINY,
                StageConfig(),
                LinkEnds(FP32, backward),
                self.peers[r],
                connector,
            )
            servicer = StageServicer(host, CallVerifier(self.peers[r]), self.roster)
            self.network.register(self.addresses[r], servicer, self.peers[r])
            self.hosts.append(host)

    def client(self, r: int, signer: Identity | None = None):
        return self.network.connector(CallSigner(signer or self.trainer)).stage(self.addresses[r])

    def info(self, r: int, step: int, mb: int = 0, n_micro: int = 1, loss_weight: float = 0.0) -> stage_pb2.CallInfo:
        return stage_pb2.CallInfo(
            step=step, micro_batch=mb, stage=0, num_micro_batches=n_micro, schedule="gpipe", chain=r,
            route=[self.addresses[r]], route_peers=[self.peers[r]], deadline_s=30, loss_weight=loss_weight,
        )  # fmt: skip

    def train(self, r: int, step: int, tokens: torch.Tensor, targets: torch.Tensor, loss_weight: float) -> float:
        """One micro-batch forward and backward on replica r (its chain): labels, tokens in, loss weight back."""
        client, info = self.client(r), self.info(r, step, loss_weight=loss_weight)
        ids = torch.arange(len(tokens))
        client.PutLabels(stage_pb2.LabelsRequest(info=info, labels=tokens_to_wire(targets)))
        first = stage_pb2.StreamItem(info=info, tokens=tokens_to_wire(tokens, ids)).SerializeToString()
        loss = client.Forward(iter([first])).loss
        client.Backward(iter([stage_pb2.StreamItem(info=info).SerializeToString()]))
        return loss

    def split_step(self, step: int, rows: int = 6, seed: int = 0) -> None:
        """A batch of `rows` split over the replicas, each weighted by its share of the rows."""
        tokens, targets = batch(rows, seed)
        parts = torch.arange(rows).tensor_split(len(self.hosts))
        for r, idx in enumerate(parts):
            self.train(r, step, tokens[idx], targets[idx], len(idx) / rows)

    def reduce(self, step: int, members=None, deadline_s: float = 10.0, attempt_id: int = 0) -> list:
        """Reduce on `members` (default: all) at once, as the trainer does; each result a reply or an error."""
        members = list(range(len(self.hosts))) if members is None else members
        request = stage_pb2.ReduceRequest(
            step=step, stage=0, group_peers=[self.peers[m] for m in range(len(self.hosts))],
            group_addresses=list(self.addresses), deadline_s=deadline_s, attempt_id=attempt_id,
        )  # fmt: skip
        results: list = [None] * len(members)

        def run(k: int) -> None:
            try:
                results[k] = self.client(members[k]).Reduce(request)
            except LocalRpcError as e:
                results[k] = e

        threads = [threading.Thread(target=run, args=(k,)) for k in range(len(members))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
        return results

    def step(self, r: int, step: int) -> stage_pb2.StepReply:
        return self.client(r).Step(stage_pb2.StepRequest(step=step, global_grad_norm=0.5))

    def grads(self, r: int) -> list[torch.Tensor]:
        return [p.grad.clone() for p in self.hosts[r].averager.params]


def test_last_stage_weighs_each_micro_batch_by_its_loss_weight():
    """Two replicas with 2 and 4 rows of a 6-row batch, weighted 2/6 and 4/6: their gradients sum to the
    gradient of one stage that saw the whole batch."""
    pair, single = Replicas(2), Replicas(1)
    pair.split_step(0, rows=6)
    tokens, targets = batch(6)
    single.train(0, 0, tokens, targets, 1.0)
    summed = [a + b for a, b in zip(pair.grads(0), pair.grads(1), strict=True)]
    for got, want in zip(summed, single.grads(0), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_loss_weight_zero_keeps_the_mean_over_micro_batches_and_out_of_range_is_refused():
    pipe = Replicas(1)
    tokens, targets = batch(2)
    pipe.train(0, 0, tokens, targets, 0.0)  # 0: 1 / num_micro_batches, today's behaviour
    before = pipe.grads(0)
    pipe.client(0).Step(stage_pb2.StepRequest(step=0, abandon=True))
    pipe.train(0, 1, tokens, targets, 1.0)
    for a, b in zip(before, pipe.grads(0), strict=True):
        torch.testing.assert_close(a, b)
    for bad in (1.5, -0.1, float("nan")):
        with pytest.raises(LocalRpcError, match="loss_weight") as e:
            pipe.client(0).PutLabels(stage_pb2.LabelsRequest(info=pipe.info(0, 2, loss_weight=bad)))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_retried_step_applies_nothing_and_status_reports_it():
    pipe = Replicas(2)
    pipe.split_step(0)
    pipe.reduce(0)
    lr = pipe.step(1, 0).lr
    after = pipe.client(1).Status(stage_pb2.Empty())
    assert pipe.step(1, 0).lr == lr  # the reply was lost, the trainer retries: same lr ...
    again = pipe.client(1).Status(stage_pb2.Empty())
    assert (again.steps_done, again.weights_digest, again.last_step) == (1, after.weights_digest, 0)  # ... no step
    assert again.replica == 1 and pipe.client(0).Status(stage_pb2.Empty()).replica == 0
    pipe.split_step(1)
    pipe.reduce(1)
    pipe.step(1, 1)
    assert pipe.client(1).Status(stage_pb2.Empty()).last_step == 1


def test_weights_digest_follows_the_weights():
    pipe = Replicas(2)
    s0, s1 = (pipe.client(r).Status(stage_pb2.Empty()) for r in (0, 1))
    assert s0.weights_digest == s1.weights_digest and len(s0.weights_digest) == 64
    with torch.no_grad():
        next(pipe.hosts[1].worker.module.parameters()).add_(1e-3)
    assert pipe.client(1).Status(stage_pb2.Empty()).weights_digest != s0.weights_digest


class _RecordingLock:
    """A lock that remembers whether it is held, so a test can see what a method does while holding it."""

    def __init__(self):
        self._lock, self.held, self.acquired = threading.Lock(), False, 0

    def __enter__(self):
        self._lock.acquire()
        self.held, self.acquired = True, self.acquired + 1
        return self

    def __exit__(self, *exc):
        self.held = False
        self._lock.release()


def test_grads_reads_the_gradients_under_the_compute_lock():
    # a Grads of an abandoned attempt may still run beside the next attempt's backward, Reduce or abandon on the
    # same host; reading the gradients outside the lock those hold crashed the process (a segfault in torch)
    pipe = Replicas(1)
    host = pipe.hosts[0]
    lock = host.compute_lock = _RecordingLock()
    seen = []
    params = host.worker.module.parameters

    def watched():
        seen.append(lock.held)
        return params()

    host.worker.module.parameters = watched
    host.grads()
    assert lock.acquired == 1 and seen and all(seen), "grads() read the parameters' gradients without the lock"


def test_a_step_is_refused_where_the_gate_holds_no_finished_program_of_that_step():
    """A gate reset by an abandon has an empty program, done in the sense that nothing is left: the step opened
    since (by the next attempt's first call, before its first action) has not run here, and its Step, like its
    Reduce, is refused rather than applying gradients no backward of it made."""
    pipe = Replicas(1)
    pipe.split_step(0)
    host = pipe.hosts[0]
    host.gate.reset()  # as an abandon leaves it; the ledger still holds step 0 open, as the next attempt reopens it
    assert host.open_step == 0 and host.gate.step_done
    with pytest.raises(LocalRpcError, match="before every backward ran") as e:
        pipe.step(0, 0)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert pipe.client(0).Status(stage_pb2.Empty()).steps_done == 0
