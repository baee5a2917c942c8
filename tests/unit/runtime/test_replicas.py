"""Replicated pipelines in one process: 2 stages x 2 replicas train like 2 stages x 1, replicas stay equal,
samples stay on their chain."""

from __future__ import annotations

import pytest
import torch

from swarm.compression import CodecConfig
from swarm.model.data import Batch
from swarm.model.gpt import ModelConfig
from swarm.proto import stage_pb2_grpc
from swarm.runtime.inprocess import LocalPipeline
from swarm.runtime.service import StageServicer

torch.set_num_threads(1)

CFG = ModelConfig(vocab_size=64, seq_len_tokens=16, hidden_dim=32, n_layers=4, n_heads=4, init_seed=1)
FP32 = CodecConfig("fp32")
needs_r1 = pytest.mark.xfail(
    StageServicer.Reduce is stage_pb2_grpc.StageServicer.Reduce, reason="needs R1 (Reduce)", strict=True
)


def batch(n: int = 16, seed: int = 0, first_id: int = 0) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    windows = torch.randint(0, CFG.vocab_size, (n, CFG.seq_len_tokens + 1), generator=gen)
    return Batch(torch.arange(first_id, first_id + n), windows[:, :-1], windows[:, 1:])


def weights(pipe: LocalPipeline, replica: int = 0) -> dict[str, torch.Tensor]:
    return {
        n: p.detach().clone() for row in pipe.replica_hosts for n, p in row[replica].worker.module.named_parameters()
    }


def digests(pipe: LocalPipeline) -> list[set[str]]:
    """Each stage's set of weights digests over its replicas (one element: the replicas agree)."""
    return [{r.weights_digest for r in row if r is not None} for row in pipe.driver(4).replica_status()]


def hits(pipe: LocalPipeline, replica: int) -> float:
    """AQ-SGD buffer hits counted by the hosts of chain `replica`."""
    snaps = (row[replica].metrics.snapshot() for row in pipe.replica_hosts)
    return sum(v for s in snaps for k, v in s.items() if k.startswith("swarm_aqsgd_buffer_hits_total"))


@needs_r1
def test_two_replicas_train_like_one():
    one, two = LocalPipeline(CFG, 2, FP32, FP32), LocalPipeline(CFG, 2, FP32, FP32, replicas=2)
    try:
        for step in range(3):
            b = batch(seed=step)
            a, r = one.train_step(b, n_micro=4), two.train_step(b, n_micro=4)
            assert r.routes == 2 and r.attempts == 1 and r.dead_peers == ()
            assert sorted(r.sample_ids) == b.sample_ids.tolist()
            assert r.loss == pytest.approx(a.loss, abs=1e-5)
            assert r.grad_norm == pytest.approx(a.grad_norm, rel=1e-4)
            assert r.reduce_bytes > 0 and r.traffic.direction_bytes("average") == r.reduce_bytes
            assert r.wire_bytes == r.forward_bytes + r.backward_bytes + r.reduce_bytes
            assert all(len(d) == 1 for d in digests(two)), f"replicas differ after step {step}"
        ref = weights(one)
        for replica in range(2):
            for name, w in weights(two, replica).items():
                torch.testing.assert_close(w, ref[name], atol=1e-5, rtol=0, msg=name)
        last = [row for row in two.driver(4).replica_status()]
        assert all(s.last_step == 2 and s.steps_done == 3 for row in last for s in row)
    finally:
        one.close()
        two.close()


@needs_r1
def test_replicas_stay_equal_with_compressed_codecs():
    pipe = LocalPipeline(CFG, 2, CodecConfig("aqsgd", bits=4), CodecConfig("gradq", bits=8), replicas=2)
    try:
        for step in range(3):
            pipe.train_step(batch(seed=step), n_micro=4)
            assert all(len(d) == 1 for d in digests(pipe)), f"replicas differ after step {step}"
    finally:
        pipe.close()


@needs_r1
def test_samples_stay_on_their_chain_so_aqsgd_buffers_hit_on_both():
    pipe = LocalPipeline(CFG, 2, CodecConfig("aqsgd", bits=4), CodecConfig("fp32"), replicas=2)
    data = batch(n=32, seed=5)
    try:
        for epoch in range(2):
            chains_of = []
            for half in range(2):
                rows = torch.arange(16) + 16 * half
                result = pipe.train_step(data.select(rows), n_micro=4)
                assert result.routes == 2
                chains_of.append(result.sample_ids)
            if epoch == 0:
                first = chains_of
                before = [hits(pipe, r) for r in range(2)]
        assert chains_of == first  # same samples, same chain, same order
        after = [hits(pipe, r) for r in range(2)]
        assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)
    finally:
        pipe.close()


def test_every_replica_s_status_is_asked_at_once_and_a_failed_one_names_itself(monkeypatch):
    """`replica_status` (the summary's state count, the journal's checks) asks all replicas together: four calls
    that each wait for the other three pass a barrier of four only if all are in flight at once (one after another,
    the first would break it). A failed call raises its error; a dead peer is None, never asked."""
    import threading

    two = LocalPipeline(CFG, 2, FP32, FP32, replicas=2)
    try:
        driver = two.driver(4)
        call, barrier, asked = driver._call, threading.Barrier(4, timeout=10), []

        def together(stage, replica, method, request, timeout=None):
            asked.append((stage, replica))
            barrier.wait()  # BrokenBarrierError unless all four are waiting at once
            return call(stage, replica, method, request, timeout=timeout)

        monkeypatch.setattr(driver, "_call", together)
        rows = driver.replica_status(timeout_s=5.0)
        assert [[s.steps_done for s in row] for row in rows] == [[0, 0], [0, 0]] and len(asked) == 4

        driver.dead.add(driver.replica_peers[1][1])

        def failing(stage, replica, method, request, timeout=None):
            if (stage, replica) == (0, 1):
                raise RuntimeError("stage 0 replica 1 refused Status")
            return call(stage, replica, method, request, timeout=timeout)

        monkeypatch.setattr(driver, "_call", failing)
        with pytest.raises(RuntimeError, match="replica 1 refused"):
            driver.replica_status(timeout_s=5.0)
        monkeypatch.setattr(driver, "_call", call)
        assert driver.replica_status(timeout_s=5.0)[1][1] is None  # the dead peer is not asked
    finally:
        two.close()
