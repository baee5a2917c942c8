"""A loopback pipeline of gRPC stage servers: same losses as the in-process pipeline, identical AQ-SGD
buffers on both ends, and clear errors (while the peer keeps serving) on every kind of bad input."""

from __future__ import annotations

import csv
import threading
import time

import grpc
import pytest
import torch

from swarm.compression import CodecConfig, WireLimits, frame, make_codec
from swarm.model.data import Batch
from swarm.net.auth import CallSigner
from swarm.net.stream import StageCallError, tokens_to_wire
from swarm.peers.routes import PlanRoutes
from swarm.proto import stage_pb2, stage_pb2_grpc, wire_pb2
from swarm.runtime.inprocess import LocalPipeline
from swarm.train.trainer import TrainConfig, train
from tests.integration.swarm_fixtures import TINY, loopback_stages, remote, trainer_of

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

FP32 = CodecConfig("fp32")


def batches(n: int, batch: int = 4, seq: int = 16, seed: int = 0) -> list[Batch]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        w = torch.randint(0, 256, (batch, seq + 1), generator=gen)
        out.append(Batch(torch.arange(batch) + i * batch % 8, w[:, :-1], w[:, 1:]))
    return out


@pytest.mark.parametrize("schedule,n_stages", [("1f1b", 2), ("gpipe", 3)])
def test_fp32_loopback_matches_in_process_pipeline(schedule, n_stages):
    data = batches(3)
    local = LocalPipeline(TINY, n_stages, FP32, FP32, schedule)
    workers = local.workers
    expected = [local.train_step(b, 2).loss for b in data]
    with loopback_stages(n_stages, FP32, FP32) as (hosts, _, addresses):
        pipe = remote(addresses, schedule, n_micro=2)
        got = [pipe.train_step(step, b).loss for step, b in enumerate(data)]
        pipe.close()
        for host, worker in zip(hosts, workers, strict=True):
            for (name, a), b in zip(
                host.worker.module.state_dict().items(), worker.module.state_dict().values(), strict=True
            ):
                torch.testing.assert_close(a, b, msg=lambda m, n=name: f"{n}: {m}")
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=1e-6)


def test_aqsgd_loopback_trains_and_buffers_match_on_both_ends():
    fw, bw = CodecConfig("aqsgd", bits=2), CodecConfig("gradq", bits=4)
    data = [b for _ in range(3) for b in batches(2, seed=1)]  # every sample comes back
    with loopback_stages(2, fw, bw) as (hosts, _, addresses):
        pipe = remote(addresses)
        results = [pipe.train_step(step, b) for step, b in enumerate(data)]
        pipe.close()
        [send_end] = hosts[0].links.send_ends("fw")  # one destination: the plan's next stage
        send, recv = send_end.buffers, hosts[1].links.forward_recv.buffers
        assert sorted(send.ids()) == sorted(recv.ids()) and len(send.ids()) == 8
        for sample in send.ids():
            assert torch.equal(send.get(sample), recv.get(sample))
        # the registry saw it all: what stage 0's Status reports is what the driver was told in replies
        first = remote(addresses).status()[0].metrics
        sent = sum(r.traffic.sent.get((0, "forward"), 0) for r in results)
        assert first['swarm_wire_bytes_total{direction="forward",link="0"}'] == sent
        assert first["swarm_steps_total"] == len(data)
        assert first['swarm_aqsgd_buffer_misses_total{link="0"}'] == 8  # first sights only
        assert first['swarm_aqsgd_buffer_hits_total{link="0"}'] == 4 * len(data) - 8
        assert first['swarm_phase_seconds_count{phase="encode",stage="0"}'] == 2 * len(data)  # forward only
    assert all(r.wire_bytes < r.fp32_wire_bytes for r in results[2:])
    assert results[-1].wire_bytes * 5 < results[-1].fp32_wire_bytes


def _stream(info, msg=None, tokens=None, limits_chunk=1 << 20):
    if tokens is not None:
        return iter([stage_pb2.StreamItem(info=info, tokens=tokens)])
    chunks = list(frame(msg, zstd_level=0, chunk_bytes=limits_chunk))
    return iter(
        [stage_pb2.StreamItem(info=info, chunk=chunks[0])] + [stage_pb2.StreamItem(chunk=c) for c in chunks[1:]]
    )


def test_bad_input_gets_a_named_error_and_the_peer_keeps_serving():
    # anonymous raw stubs reach the validation past authentication (tests/integration/test_auth.py covers that)
    with loopback_stages(2, FP32, FP32, auth=False) as (hosts, _, addresses):
        hosts[1].limits = WireLimits(max_message_bytes=64 * 1024)
        stub = stage_pb2_grpc.StageStub(grpc.insecure_channel(addresses[1]))
        info = stage_pb2.CallInfo(
            step=0,
            micro_batch=0,
            stage=1,
            num_micro_batches=1,
            schedule="gpipe",
            route=addresses,
            route_peers=["peer0", "peer1"],
            deadline_s=10,
        )
        good = make_codec(FP32).encode(torch.randn(2, 16, 32), sample_ids=[0, 1])

        def expect(items, code, words):
            with pytest.raises(grpc.RpcError) as err:
                stub.Forward(items, timeout=10)
            assert err.value.code() == code, err.value.details()
            assert all(w in err.value.details() for w in words), err.value.details()

        malformed = stage_pb2.StreamItem(info=info, chunk=wire_pb2.Chunk(data=b"\x01\x02"))
        expect(iter([malformed]), grpc.StatusCode.INVALID_ARGUMENT, ["chunk.header"])
        oversized = make_codec(FP32).encode(torch.randn(40, 16, 32))  # 80 KiB against a 64 KiB limit
        expect(_stream(info, oversized), grpc.StatusCode.INVALID_ARGUMENT, ["body_bytes", "limit"])
        wrong_shape = make_codec(FP32).encode(torch.randn(2, 16, 31))
        expect(_stream(info, wrong_shape), grpc.StatusCode.INVALID_ARGUMENT, ["shape"])
        unknown = wire_pb2.TensorMessage()
        unknown.CopyFrom(good)
        unknown.codec = 77
        expect(_stream(info, unknown), grpc.StatusCode.INVALID_ARGUMENT, ["codec"])
        nan = wire_pb2.TensorMessage()
        nan.CopyFrom(good)
        values = torch.randn(2, 16, 32)
        values[1, 2, 3] = float("nan")
        nan.raw = values.numpy().tobytes()
        stub.PutLabels(stage_pb2.LabelsRequest(info=info, labels=tokens_to_wire(torch.zeros(2, 16))), timeout=10)
        expect(_stream(info, nan), grpc.StatusCode.INVALID_ARGUMENT, ["NaN"])
        wrong_stage = stage_pb2.CallInfo()
        wrong_stage.CopyFrom(info)
        wrong_stage.stage = 0
        expect(_stream(wrong_stage, good), grpc.StatusCode.FAILED_PRECONDITION, ["serves stage 1"])
        bad_tokens = tokens_to_wire(torch.full((2, 16), 999))
        info0 = stage_pb2.CallInfo()
        info0.CopyFrom(info)
        info0.stage = 0
        with pytest.raises(grpc.RpcError) as err:
            stage_pb2_grpc.StageStub(grpc.insecure_channel(addresses[0])).Forward(
                _stream(info0, tokens=bad_tokens), timeout=10
            )
        assert "token ids" in err.value.details()
        # still serving: a whole valid step goes through
        pipe = remote(addresses, "gpipe", n_micro=1)
        assert pipe.train_step(0, batches(1)[0]).loss > 0
        pipe.close()


def test_a_vanished_stage_is_named_and_nothing_hangs():
    with loopback_stages(2, FP32, FP32, auth=False) as (_, servers, addresses):
        pipe = remote(addresses, deadline_s=10)
        pipe.train_step(0, batches(1)[0])
        servers[1].stop(grace=None).wait(5)
        with pytest.raises(StageCallError) as err:
            pipe.train_step(1, batches(1)[0])
        pipe.close()
    assert "stage 1 (peer peer1" in str(err.value)


def test_a_stopped_trainer_resumes_where_it_was_with_the_same_data_order(tmp_path):
    """`train(resume=True)` continues from trainer_state.json: the same batches, in the same order, as a run
    that never stopped, the stages' step numbers go on from there, and steps.csv is appended to."""
    cfg = dict(model=TINY, train_samples=16, batch_size=4, micro_batches=2, epochs=2, checkpoint_every=1)
    losses = {}
    for name in ("whole", "stopped"):
        stop = threading.Event()

        def stop_after_three(host, stop=stop) -> None:  # of the 8 steps
            if host.role.stage == 0 and host.steps_done == 3:
                stop.set()

        with loopback_stages(2, FP32, FP32, on_step=stop_after_three) as (hosts, _, addresses):
            peers, trainer = trainer_of(addresses)
            route, signer = PlanRoutes(addresses, peers), CallSigner(trainer)
            out = str(tmp_path / name)
            if name == "whole":
                losses[name] = _steps_csv_losses(train(TrainConfig(**cfg, out=out), route, quiet=True, signer=signer))
                continue
            first = train(TrainConfig(**cfg, out=out), route, quiet=True, signer=signer, stop=stop)
            assert first.steps == 3 and len(_steps_csv_losses(first)) == 3
            rest = train(TrainConfig(**cfg, out=out, resume=True), route, quiet=True, signer=signer)
            assert rest.steps == 8 and hosts[0].steps_done == 8  # steps.csv (and the summary) go on from the first
            losses[name] = _steps_csv_losses(rest)
    assert losses["stopped"] == losses["whole"]


def _steps_csv_losses(summary) -> list[float]:
    with open(summary.csv) as f:
        return [float(r["train_loss"]) for r in csv.DictReader(f)]


def test_one_item_calls_reach_the_stages_as_unary_twins(monkeypatch):
    """Over gRPC every call of a step whose stream holds one item (token batches, Backward starts, the small
    activations and gradients) reaches the stage as ForwardItem / BackwardItem, signed and checked as the streams
    are, and the step trains as the in-process pipeline (whose calls stay streams) does."""
    from swarm.runtime.service import StageServicer

    reached = []
    for name in ("Forward", "Backward", "ForwardItem", "BackwardItem"):
        method = getattr(StageServicer, name)
        monkeypatch.setattr(
            StageServicer, name, lambda self, r, c, m=method, n=name: reached.append(n) or m(self, r, c)
        )
    data = batches(2)
    local = LocalPipeline(TINY, 2, FP32, FP32)
    expected = [local.train_step(b, 2).loss for b in data]
    assert sorted(set(reached)) == ["Backward", "Forward"], "in process the calls stay streams"
    reached.clear()
    with loopback_stages(2, FP32, FP32) as (_, _, addresses):
        pipe = remote(addresses, n_micro=2)
        got = [pipe.train_step(step, b).loss for step, b in enumerate(data)]
        pipe.close()
    assert sorted(set(reached)) == ["BackwardItem", "ForwardItem"], reached
    assert len(reached) == 2 * 2 * 4  # 2 steps x 2 micro-batches x (trainer -> 0, 0 -> 1, trainer -> 1, 1 -> 0)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=1e-6)


def test_a_twin_sent_twice_late_or_given_up_changes_nothing_and_the_stage_serves_on():
    """The one-item twins under the failures every call meets (anonymous raw stubs: the proofs' part, a twin's
    proof replayed or a stranger's twin, is `swarm bench hostile`'s): the same item twice runs once, an item of an
    abandoned attempt is refused, and an item whose caller gives up while it waits for its turn runs nothing and
    leaves no step open. A whole step trains after all three."""
    with loopback_stages(2, FP32, FP32, auth=False) as (hosts, _, addresses):
        last = stage_pb2_grpc.StageStub(grpc.insecure_channel(addresses[1]))
        info = stage_pb2.CallInfo(
            step=0, micro_batch=0, stage=1, num_micro_batches=1, schedule="gpipe", route=addresses,
            route_peers=["peer0", "peer1"], deadline_s=10, attempt_id=5,
        )  # fmt: skip
        last.PutLabels(stage_pb2.LabelsRequest(info=info, labels=tokens_to_wire(torch.zeros(2, 16))), timeout=10)
        [item] = list(_stream(info, make_codec(FP32).encode(torch.randn(2, 16, 32), sample_ids=[0, 1])))
        assert last.ForwardItem(item, timeout=10).loss > 0
        with pytest.raises(grpc.RpcError) as twice:  # the same item again (a retry whose first reply was lost)
            last.ForwardItem(item, timeout=10)
        assert twice.value.code() == grpc.StatusCode.ABORTED and "ran already" in twice.value.details()
        assert hosts[1].worker.saved_shape(0) is not None, "the first one's forward stands"
        last.Step(stage_pb2.StepRequest(step=0, abandon=True, attempt_id=5), timeout=10)
        with pytest.raises(grpc.RpcError) as late:  # arriving after its attempt was abandoned
            last.ForwardItem(item, timeout=10)
        assert "abandoned" in late.value.details(), late.value.details()
        assert hosts[1].open_step is None
        # given up: micro-batch 1 of 2 into stage 0, whose GPipe turn (after micro-batch 0) never comes; the caller's
        # deadline passes long before the call's own 30 s wait at the stage
        first = stage_pb2_grpc.StageStub(grpc.insecure_channel(addresses[0]))
        waiting = stage_pb2.CallInfo()
        waiting.CopyFrom(info)
        waiting.stage, waiting.step, waiting.micro_batch, waiting.num_micro_batches = 0, 1, 1, 2
        waiting.deadline_s, waiting.attempt_id = 30, 6
        tokens = stage_pb2.StreamItem(info=waiting, tokens=tokens_to_wire(torch.zeros(2, 16, dtype=torch.long)))
        with pytest.raises(grpc.RpcError) as gone:
            first.ForwardItem(tokens, timeout=1.0)
        assert gone.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, gone.value.details()
        deadline = time.monotonic() + 20.0  # the stage notices the caller left and stops waiting for the turn
        while hosts[0].open_step is not None and time.monotonic() < deadline:
            threading.Event().wait(0.05)
        assert hosts[0].open_step is None, "a given-up call still holds its step open"
        assert hosts[0].worker.saved_shape(1) is None, "the given-up micro-batch ran"
        pipe = remote(addresses, "gpipe", n_micro=1)
        assert pipe.train_step(2, batches(1)[0]).loss > 0
        pipe.close()
