"""Direct audits (`VerifyConfig.direct`, with sketched records): the sibling that recomputes fetches the audited
stage's input and received gradient from that stage itself (`Stage.AuditInputs`), checked against the digests the
stage committed to in its Audit reply, instead of the trainer relaying them. A clean run passes at fewer bytes,
every attack is caught as with relayed records, a stage that serves other bytes than it committed to (or none) only
makes the audit ask again in fp32, and only another replica of the stage may fetch."""

from __future__ import annotations

import math
from dataclasses import replace

import grpc
import pytest
import torch

import swarm.runtime.service as service
from swarm.compression import DEFAULT_BACKWARD_CODEC, DEFAULT_FORWARD_CODEC, CodecConfig, make_codec
from swarm.model.data import Batch
from swarm.model.gpt import ModelConfig
from swarm.net.stream import CallRefused, StageCallError
from swarm.proto import stage_pb2, wire_pb2
from swarm.runtime.audit import AuditRecord
from swarm.runtime.audit_wire import audit_inputs_reply, audit_reply, decode_tensor, digest, encode_tensor, fill_fetched
from swarm.runtime.inprocess import LocalPipeline
from swarm.runtime.policy import CallPolicy, Roster
from swarm.runtime.verify import VerifyConfig
from tests.unit.runtime.test_verify import ATTACKS, FP32, HEARTBEAT_S

torch.set_num_threads(1)

WIDE3 = ModelConfig(vocab_size=64, seq_len_tokens=64, hidden_dim=64, n_layers=3, n_heads=4, init_seed=1)
"""boundary tensors of 2 x 64 x 64, past a sketch's 1024 buckets (so sketched and fetched); a middle stage, whose
received gradient is fetched too"""
SKETCH = {"records": "sketch", "fraction": 1.0, "seed": 3}


def batch(step: int, n: int = 8) -> Batch:
    gen = torch.Generator().manual_seed(step)
    windows = torch.randint(0, WIDE3.vocab_size, (n, WIDE3.seq_len_tokens + 1), generator=gen)
    return Batch(torch.arange(n), windows[:, :-1], windows[:, 1:])


def _by_method(result) -> dict[str, int]:
    prefix = 'swarm_control_call_bytes_total{method="'
    return {k[len(prefix) : -2]: v for k, v in result.counters.items() if k.startswith(prefix)}


@pytest.fixture
def pipe():
    pipe = LocalPipeline(WIDE3, 3, FP32, FP32, replicas=2)
    yield pipe
    pipe.close()


def test_a_clean_run_passes_direct_audits_and_the_inputs_cross_the_wire_once():
    forward, backward = CodecConfig.parse(DEFAULT_FORWARD_CODEC), CodecConfig.parse(DEFAULT_BACKWARD_CODEC)
    audit_bytes = {}
    for direct in (False, True):
        pipe = LocalPipeline(WIDE3, 3, forward, backward, replicas=2)
        try:
            driver = pipe.driver(4, heartbeat_s=HEARTBEAT_S, verify=VerifyConfig(direct=direct, **SKETCH))
            methods: dict[str, int] = {}
            for step in range(2):
                result = driver.train_step(step, batch(step))
                assert math.isfinite(result.loss)
                for k, v in _by_method(result).items():
                    methods[k] = methods.get(k, 0) + v
            stats = driver.verifier.stats
            assert driver.liars == [] and stats.disputes == 0 and stats.escalations == 0 and stats.audits >= 4
            assert stats.worst_own < VerifyConfig().rtol * 0.5
            assert ("AuditInputs" in methods) == direct, methods  # the siblings' fetches, in the control bytes
            audit_bytes[direct] = sum(methods.get(m, 0) for m in ("Audit", "Recompute", "AuditInputs"))
        finally:
            pipe.close()
    # relayed, each fp16 input (16 KB here) crosses twice, stage -> trainer -> sibling; fetched, once, and the trainer
    # gets a 4 KB sketch of it: 0.73 of the bytes at this width (0.57 at the churn experiment's, 2 x 128 x 128)
    assert audit_bytes[True] < 0.8 * audit_bytes[False], audit_bytes


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_direct_audits_catch_each_liar_before_its_probation_ends(attack):
    pipe = LocalPipeline(WIDE3, 3, FP32, FP32, replicas=2)
    try:
        lie, stage = ATTACKS[attack]
        liar = pipe.replica_hosts[stage][1]
        lie(liar.worker)
        driver = pipe.driver(4, heartbeat_s=HEARTBEAT_S, verify=VerifyConfig(seed=11, records="sketch"))
        caught = None
        for step in range(VerifyConfig().probation_steps):
            driver.train_step(step, batch(step))
            if driver.liars:
                caught = step
                break
        assert caught is not None, f"{attack}: not caught during probation"
        assert [p for p, _ in driver.liars] == [liar.peer_id]
    finally:
        pipe.close()


def _served(how: str):
    """An `audit_inputs_reply` that serves other bytes than the Audit reply committed to, or fails."""
    honest = service.audit_inputs_reply

    def serve(record, is_last, backward):
        if how == "fails":
            raise RuntimeError("the disk is gone")
        reply = honest(record, is_last, backward)
        reply.input_scale += 1  # the same fp16 bits, twice the value
        return reply

    return serve


@pytest.mark.parametrize("how", ["other bytes", "fails"])
def test_a_fetch_that_does_not_match_or_fails_asks_again_in_fp32_and_evicts_nobody(pipe, monkeypatch, how):
    """The sibling cannot tell a stage that serves other bytes from one that is honest while it lies itself, so a
    failed fetch is no verdict: the audit is asked again through the trainer, in fp32, and judged there."""
    monkeypatch.setattr(service, "audit_inputs_reply", _served(how))
    driver = pipe.driver(4, heartbeat_s=HEARTBEAT_S, verify=VerifyConfig(**SKETCH))
    result = driver.train_step(0, batch(0))
    stats = driver.verifier.stats
    assert math.isfinite(result.loss) and driver.liars == [] and stats.disputes == 0
    assert stats.audits >= 1 and stats.escalations == stats.audits
    assert "AuditInputs" not in _by_method(result)  # nothing fetched is counted: no fetch succeeded


def test_a_stage_that_sketches_its_input_but_commits_to_no_digest_is_a_liar(pipe, monkeypatch):
    honest = service.audit_reply
    liar = pipe.replica_hosts[2][0]

    def no_digest(record, *args):
        reply = honest(record, *args)
        if record.inputs is liar_records.get(id(record)):
            reply.ClearField("input_digest")
        return reply

    liar_records: dict[int, torch.Tensor] = {}
    honest_record = liar.audit_record

    def mark(*args):
        record = honest_record(*args)
        liar_records[id(record)] = record.inputs
        return record

    liar.audit_record = mark
    monkeypatch.setattr(service, "audit_reply", no_digest)
    driver = pipe.driver(4, heartbeat_s=HEARTBEAT_S, verify=VerifyConfig(**SKETCH))
    driver.train_step(0, batch(0))
    assert [p for p, _ in driver.liars] == [liar.peer_id], driver.liars
    assert "commits to no digest" in driver.liars[0][1]


def test_only_another_replica_of_the_stage_may_fetch_its_audit_inputs():
    roster = Roster((("a0", "a1"), ("b0", "b1")), (("x:1", "x:2"), ("y:1", "y:2")), frozenset({"t"}),
                    frozenset({"a0", "a1", "b0", "b1"}))  # fmt: skip
    policy = CallPolicy(roster)
    policy.check_audit_inputs(0, "a1", "a0")
    for stage, caller in ((0, "t"), (0, "b0"), (0, "a0"), (2, "a1"), (0, "stranger")):
        with pytest.raises(Exception, match="only to another replica"):
            policy.check_audit_inputs(stage, caller, "a0")


def test_the_trainer_itself_may_not_fetch_audit_inputs_and_may_not_point_a_sibling_elsewhere(pipe):
    driver = pipe.driver(4, heartbeat_s=HEARTBEAT_S, verify=VerifyConfig(**SKETCH))
    driver.train_step(0, batch(0))
    ask = stage_pb2.AuditRequest(step=0, plan_version=driver.plan_version, stage=1, micro_batch=0, compact=True)
    with pytest.raises(StageCallError) as refused:
        driver._call(1, 0, "AuditInputs", ask)
    assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED
    for elsewhere in (pipe.replica_peers[0][0], pipe.replica_peers[1][0]):  # another stage's replica; itself
        request = stage_pb2.RecomputeRequest(
            step=0, plan_version=driver.plan_version, stage=1, fetch_peer=elsewhere, sketch_size=1024
        )
        with pytest.raises(StageCallError) as refused:
            driver._call(1, 0, "Recompute", request)
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "is not another replica of stage 1" in str(refused.value)


def test_a_stage_that_computes_on_other_values_than_it_sketched_for_the_trainer_is_caught(pipe, monkeypatch):
    """The attack the siblings' sketch digests close: the last stage computes its loss on 1.5 x its input, shows
    the trainer the sketch of the input it received (so the link check passes) and serves the sibling, under a
    matching digest, the scaled input it computed on (so the recomputation agrees with its loss). The sibling's
    sketch of what it fetched is not the stage's: asked again in fp32, where the stage's record contradicts it."""
    liar = pipe.replica_hosts[2][1]
    forward = liar.worker.forward
    liar.worker.forward = lambda mb, inputs, *a, **k: forward(mb, inputs * 1.5, *a, **k)
    marked: set[int] = set()
    honest_record, honest_reply, honest_inputs = liar.audit_record, service.audit_reply, service.audit_inputs_reply

    def mark(*args):
        record = replace(honest_record(*args))
        marked.add(id(record))
        return record

    def reply(record, *args):
        out = honest_reply(record, *args)
        if id(record) in marked and out.input_digest:
            out.input_digest = digest(*encode_tensor(record.inputs * 1.5, True))
        return out

    def inputs(record, *args):
        return honest_inputs(replace(record, inputs=record.inputs * 1.5) if id(record) in marked else record, *args)

    liar.audit_record = mark
    monkeypatch.setattr(service, "audit_reply", reply)
    monkeypatch.setattr(service, "audit_inputs_reply", inputs)
    driver = pipe.driver(4, heartbeat_s=HEARTBEAT_S, verify=VerifyConfig(**SKETCH))
    for step in range(3):
        driver.train_step(step, batch(step))
        if driver.liars:
            break
    assert [p for p, _ in driver.liars] == [liar.peer_id], driver.liars
    assert driver.verifier.stats.escalations >= 1


def test_a_gradient_without_receiver_state_is_served_as_it_came_and_decodes_to_the_recorded_values():
    codec = make_codec(CodecConfig.parse(DEFAULT_BACKWARD_CODEC))
    message = codec.encode(torch.randn(2, 64, 64))
    grad = codec.decode(message)
    record = AuditRecord(torch.randn(2, 64, 64), torch.randn(2, 64, 64), grad, torch.randn(2, 64, 64), message)
    shown = audit_reply(record, False, False, True, True, 7, 1024, True)
    assert shown.grad_received_digest == digest(message, 0) and len(shown.grad_received_sketch) == 1024
    served = audit_inputs_reply(record, False, True)
    assert served.HasField("grad_received_wire") and not served.HasField("grad_received")
    assert served.grad_received_wire.ByteSize() < grad.numel() // 2  # 2-bit codes and scales, not fp16
    request = stage_pb2.RecomputeRequest(input_digest=shown.input_digest, grad_digest=shown.grad_received_digest)
    assert fill_fetched(request, served) is None
    assert torch.equal(decode_tensor(request.grad, request.grad_scale, "grad"), grad.float())
    tampered = stage_pb2.AuditReply()
    tampered.CopyFrom(served)
    tampered.grad_received_wire.quantized.payload = bytes(len(served.grad_received_wire.quantized.payload))
    assert "not the one it committed to" in fill_fetched(stage_pb2.RecomputeRequest(grad_digest=digest(message, 0)),
                                                         tampered)  # fmt: skip
    buffered = wire_pb2.TensorMessage(codec=make_codec(CodecConfig.parse("acsgd2")).wire)  # decodes against buffers
    tampered.grad_received_wire.CopyFrom(buffered)
    why = fill_fetched(stage_pb2.RecomputeRequest(grad_digest=digest(buffered, 0)), tampered)
    assert "needs a receiver's state" in why


def test_audit_inputs_go_zstd_packed_and_a_packed_body_is_read_within_the_wire_limits():
    import zstandard

    from swarm.compression import WireError, WireLimits
    from swarm.runtime.audit_wire import pack_reply, unpack_reply

    record = AuditRecord(torch.randn(2, 64, 64).half().float(), None, torch.randn(2, 64, 64), None)
    reply = audit_inputs_reply(record, False, True)
    packed = pack_reply(reply)
    assert packed.zstd_body and packed.ByteSize() < reply.ByteSize()
    assert unpack_reply(packed) == reply and unpack_reply(reply) == reply  # an unpacked reply passes as it is
    bomb = stage_pb2.AuditReply(zstd_body=zstandard.ZstdCompressor().compress(bytes(64 << 20)))
    cases = {
        "stating 67108864 bytes, more than": bomb,  # refused from the frame's header, before decompressing
        "not a zstd frame": stage_pb2.AuditReply(zstd_body=packed.zstd_body[: len(packed.zstd_body) // 2]),
        "other fields": stage_pb2.AuditReply(zstd_body=packed.zstd_body, input_scale=3),
        "packed twice": stage_pb2.AuditReply(zstd_body=zstandard.ZstdCompressor().compress(packed.SerializeToString())),
    }
    for why, message in cases.items():
        with pytest.raises(WireError, match=why):
            unpack_reply(message, WireLimits(max_message_bytes=8 << 20))


def test_a_sibling_that_recomputes_honestly_but_not_bit_for_bit_costs_one_escalation_then_sketches():
    """Direct audits ask a sibling for its sketches' digests only while its recomputations of that stage have
    matched the records bit for bit; a sibling on another device reorders floats (here: a relative 1e-6 on every
    recomputed output), which the first audit asks again in fp32 (and passes), and the stage's later audits get
    the sketches themselves and pass as sketched audits do. (The default codecs: AQ-SGD's fp16 buffers are the
    stages' inputs, which the fetch carries exactly; an fp32 boundary's input goes rounded to fp16, so its stage
    takes the same one escalation.)"""
    forward, backward = CodecConfig.parse(DEFAULT_FORWARD_CODEC), CodecConfig.parse(DEFAULT_BACKWARD_CODEC)
    pipe = LocalPipeline(WIDE3, 3, forward, backward, replicas=2)
    for host in pipe.replica_hosts[2]:
        exact = host.recompute

        def reordered(*args, exact=exact):
            done = exact(*args)
            return replace(done, loss=done.loss * (1 + 1e-6), grad_in=done.grad_in * (1 + 1e-6))

        host.recompute = reordered
    try:
        driver = pipe.driver(4, heartbeat_s=HEARTBEAT_S, verify=VerifyConfig(**SKETCH))
        for step in range(3):
            driver.train_step(step, batch(step))
    finally:
        pipe.close()
    stats = driver.verifier.stats
    assert driver.liars == [] and stats.disputes == 0
    assert 1 <= stats.escalations < stats.audits // 2, (stats.escalations, stats.audits)
    assert driver.verifier._exact == {2: False}  # stages 0 and 1 still match bit for bit


def test_a_sibling_that_predates_direct_audits_costs_an_fp32_audit_not_a_dispute(pipe, monkeypatch):
    """An older sibling ignores `fetch_peer` and finds no input in the request (INVALID_ARGUMENT): the audit is asked
    again through the trainer in fp32, as any failed fetch, and the step goes on."""
    monkeypatch.setattr(service.StageServicer, "_fetch_audit_inputs", lambda self, request, host: 0)
    driver = pipe.driver(4, heartbeat_s=HEARTBEAT_S, verify=VerifyConfig(**SKETCH))
    result = driver.train_step(0, batch(0))
    stats = driver.verifier.stats
    assert math.isfinite(result.loss) and result.attempts == 1
    assert driver.liars == [] and stats.disputes == 0 and stats.escalations == stats.audits >= 1


# ---- AuditInputs twice, late, and a side that dies halfway -------------------------------------------------------


@pytest.fixture
def default_pipe():
    """The default codecs: the stages' inputs are AQ-SGD's fp16 buffers, which a fetch carries exactly."""
    forward, backward = CodecConfig.parse(DEFAULT_FORWARD_CODEC), CodecConfig.parse(DEFAULT_BACKWARD_CODEC)
    pipe = LocalPipeline(WIDE3, 3, forward, backward, replicas=2)
    yield pipe
    pipe.close()


def _located(pipe, peer: str) -> tuple[int, int]:
    return next((s, r) for s, row in enumerate(pipe.replica_peers) for r, p in enumerate(row) if p == peer)


def test_audit_inputs_asked_twice_give_the_same_bytes_and_change_nothing(default_pipe, monkeypatch):
    """A sibling's fetch repeated (a retry, a duplicate): the stage serves the same bytes, so the same digests, and
    the audit passes as with one fetch."""
    pipe = default_pipe
    fetch, replies = service.StageServicer._fetch_audit_inputs, []

    def twice(self, request, host):
        s, r = _located(pipe, request.fetch_peer)
        ask = stage_pb2.AuditRequest(
            step=request.step, plan_version=request.plan_version, stage=s, micro_batch=request.micro_batch,
            backward=bool(request.grad_digest), compact=True,
        )  # fmt: skip
        client = host.outbox.connector.stage(pipe.replica_addresses[s][r], request.fetch_peer)
        replies.append((client.AuditInputs(ask, timeout=30), client.AuditInputs(ask, timeout=30)))
        return fetch(self, request, host)

    monkeypatch.setattr(service.StageServicer, "_fetch_audit_inputs", twice)
    driver = pipe.driver(4, heartbeat_s=HEARTBEAT_S, verify=VerifyConfig(**SKETCH))
    result = driver.train_step(0, batch(0))
    stats = driver.verifier.stats
    assert replies and all(first == second for first, second in replies)
    assert math.isfinite(result.loss) and driver.liars == [] and stats.escalations == 0 and stats.disputes == 0


def test_audit_inputs_asked_after_the_step_ended_are_refused(default_pipe):
    """A late fetch (the trainer's Step came first): the records are gone with the step; refused, nothing served."""
    pipe = default_pipe
    driver = pipe.driver(4, heartbeat_s=HEARTBEAT_S, verify=VerifyConfig(**SKETCH))
    driver.train_step(0, batch(0))
    sibling = pipe.replica_hosts[2][1]
    client = sibling.outbox.connector.stage(pipe.replica_addresses[2][0], pipe.replica_peers[2][0])
    ask = stage_pb2.AuditRequest(step=0, plan_version=driver.plan_version, stage=2, micro_batch=0, compact=True)
    with pytest.raises(grpc.RpcError) as late:
        client.AuditInputs(ask, timeout=30)
    assert late.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "not open" in late.value.details()


@pytest.mark.parametrize("who", ["the audited stage", "the sibling"])
def test_a_side_of_the_fetch_that_dies_halfway_is_routed_around_and_nobody_is_called_a_liar(
    default_pipe, monkeypatch, who
):
    """The audited stage dies while its sibling fetches from it (the fetch fails, the audit asks again in fp32, which
    finds it dead), or the sibling dies inside its Recompute (the trainer's call fails as a dead peer's): either way
    the step runs again without the dead peer, every sample trained once, no liar named."""
    pipe = default_pipe
    fetch, died = service.StageServicer._fetch_audit_inputs, []

    def dying(self, request, host):
        if not died:
            dead = _located(pipe, request.fetch_peer if who == "the audited stage" else host.peer_id)
            died.append(pipe.replica_peers[dead[0]][dead[1]])
            pipe.switches[dead[0]][dead[1]].killed = True
            if who == "the sibling":
                raise CallRefused(grpc.StatusCode.UNAVAILABLE, "connection reset (the sibling died)")
        return fetch(self, request, host)

    monkeypatch.setattr(service.StageServicer, "_fetch_audit_inputs", dying)
    driver = pipe.driver(4, heartbeat_s=HEARTBEAT_S, verify=VerifyConfig(**SKETCH))
    b = batch(0)
    result = driver.train_step(0, b)
    # the step runs again (twice where the dead peer's first failure, in the audit, comes before its death is
    # confirmed, as on a loaded machine: the rerun's Forward finds it dead then)
    assert died and result.dead_peers == tuple(died) and result.attempts >= 2
    assert sorted(result.sample_ids) == b.sample_ids.tolist() and math.isfinite(result.loss)
    assert driver.liars == [] and driver.verifier.stats.disputes == 0
