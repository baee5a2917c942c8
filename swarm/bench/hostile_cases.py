"""The cases of `swarm bench hostile`: each a small function sending one hostile call (or a burst) to a stage.

Stage 0 takes tokens, stage 1 (the middle) takes activations and gradients, stage 2 (the last) takes labels.
`stranger` cases come from a key outside the plan, `trainer` cases from the plan's own trainer misbehaving,
`none` cases carry no or a broken token. Every case returns an `Outcome`; the harness runs a legitimate step
after it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import torch

from swarm.bench.hostile import CALL_TIMEOUT_S, Harness, Outcome, rpc_error
from swarm.bench.hostile_wire import (
    MIB,
    Foreign,
    activation,
    all_refused,
    bomb_items,
    burst,
    forward_to_middle,
    fresh_ids,
    header,
    huge_stream,
    message_items,
    put_labels,
    stream,
    tokens_item,
    zstd_bomb,
)
from swarm.compression import CodecConfig, make_codec
from swarm.net.stream import serialize_chunk_item, tokens_to_wire
from swarm.proto import stage_pb2, wire_pb2

__all__ = ["CASES", "Case"]

STEP_2_62 = 1 << 62


@dataclass(frozen=True)
class Case:
    name: str
    caller: str
    """stranger (a key outside the plan), trainer (the plan's trainer, misbehaving) or none (no valid token)"""
    doc: str
    run: Callable[[Harness], Outcome]
    heavy: bool = False
    """slow or memory-hungry on today's code (hundreds of MiB, or waits out a deadline): skipped by --quick"""


CASES: list[Case] = []


def case(caller: str, doc: str, heavy: bool = False):
    def register(fn: Callable[[Harness], Outcome]) -> Callable[[Harness], Outcome]:
        CASES.append(Case(fn.__name__, caller, doc, fn, heavy))
        return fn

    return register


# ---- out of plan: a stranger's key on every RPC ----------------------------------------------------------------


@case("stranger", "Forward of a valid token batch into stage 0")
def stranger_forward(h):
    put_labels(h)
    return h.expect_refusal(0, "Forward", tokens_item(h), "stranger")


@case("stranger", "ForwardItem (a one-item Forward, unary) of a valid token batch into stage 0")
def stranger_forward_item(h):
    put_labels(h)
    return h.expect_refusal(0, "ForwardItem", tokens_item(h)[0], "stranger")


@case("stranger", "Forward of a valid activation into the middle stage")
def stranger_forward_middle(h):
    put_labels(h)
    return forward_to_middle(h, activation(h, 2), "stranger")


@case("stranger", "Backward start into the last stage", heavy=True)
def stranger_backward(h):

    return h.expect_refusal(2, "Backward", [stage_pb2.StreamItem(info=h.info(2)).SerializeToString()], "stranger")


@case("stranger", "PutLabels for the current step")
def stranger_put_labels(h):

    labels = tokens_to_wire(torch.randint(0, 256, (2, 16)))
    return h.expect_refusal(2, "PutLabels", stage_pb2.LabelsRequest(info=h.info(2), labels=labels), "stranger")


@case("stranger", "Grads of the middle stage")
def stranger_grads(h):

    return h.expect_refusal(1, "Grads", stage_pb2.StepRequest(step=h.step), "stranger")


@case("stranger", "Step (apply) on the middle stage")
def stranger_step(h):

    return h.expect_refusal(1, "Step", stage_pb2.StepRequest(step=h.step, global_grad_norm=1.0), "stranger")


@case("stranger", "Step(abandon) on every stage, as if dropping a running step")
def stranger_step_abandon(h):

    request = stage_pb2.StepRequest(step=h.step, abandon=True)
    return all_refused([h.expect_refusal(s, "Step", request, "stranger") for s in range(3)])


@case("stranger", "GetState: every weight of the middle stage")
def stranger_get_state(h):

    return h.expect_refusal(1, "GetState", stage_pb2.StateRequest(stage=1), "stranger")


@case("stranger", "Sink flood: 16 calls of a 4 MiB tensor, 8 at a time")
def stranger_sink_flood(h):

    items = message_items(h.info(1), make_codec(CodecConfig("fp32")).encode(torch.randn(MIB)))
    return all_refused(burst(lambda _: h.expect_refusal(1, "Sink", items, "stranger"), 16))


@case("stranger", "Sink of one 256 MiB message, streamed", heavy=True)
def stranger_sink_256mib(h):
    return h.expect_refusal(1, "Sink", huge_stream(h.info(1), [64 * MIB]), "stranger", timeout=120)


@case("stranger", "Probe asking for an 8 MB reply to a 5-byte request")
def stranger_probe_reply_huge(h):

    return h.expect_refusal(1, "Probe", stage_pb2.ProbeRequest(payload=b"hello", reply_bytes=8_000_000), "stranger")


# ---- tokens: missing, expired, for someone else, tampered -----------------------------------------------------


def _token_key(h: Harness) -> str:
    return h.keys.auth.TOKEN_KEY if h.keys.auth is not None else "swarm-token-bin"


@case("none", "Forward into stage 0 with no token")
def no_token(h):
    put_labels(h)
    return h.expect_refusal(0, "Forward", tokens_item(h), metadata=None)


@case("none", "Forward into stage 0 with a token that expired")
def expired_token(h):
    put_labels(h)
    return h.expect_refusal(0, "Forward", tokens_item(h), metadata=h.keys.token("trainer", 0, issued_ago_s=3600.0))


@case("none", "Forward into stage 0 with the trainer's token for stage 1 (wrong audience)")
def wrong_audience_token(h):
    put_labels(h)
    return h.expect_refusal(0, "Forward", tokens_item(h), metadata=h.keys.metadata("trainer", 1))


@case("none", "Forward into stage 0 with the trainer's token, one byte flipped")
def tampered_token(h):
    put_labels(h)
    metadata = h.keys.metadata("trainer", 0)
    if metadata:
        key, value = metadata[0]
        flipped = bytearray(value)
        flipped[len(flipped) // 2] ^= 0x01
        metadata = ((key, bytes(flipped)), *metadata[1:])
    return h.expect_refusal(0, "Forward", tokens_item(h), metadata=metadata)


@case("none", "Forward into stage 0 with 64 bytes of garbage as the token")
def garbage_token(h):
    put_labels(h)
    return h.expect_refusal(0, "Forward", tokens_item(h), metadata=((_token_key(h), bytes(64)),))


# ---- replay: a call captured on the way (an on-path observer, a relay) sent again or turned into another -------


def _captured(h: Harness, stage: int, method: str, fields, now: float | None = None):
    """The metadata of the trainer's call of `method` to `stage` over `fields` (its request, or its stream's first
    item), as an on-path observer or a relay sees it: the token and that call's proof."""
    return h.keys.metadata("trainer", stage, method, fields, signed=True, now=now)


@case("none", "a served Status call sent again as captured, token and proof (replay)")
def replayed_call(h):
    request = stage_pb2.Empty()
    metadata = _captured(h, 1, "Status", request)
    h.call(1, "Status", request, metadata=metadata)  # the trainer's own call: served
    return h.expect_refusal(1, "Status", request, metadata=metadata)


@case("none", "a captured Forward's token and proof on a Step(abandon) (another method)")
def replayed_as_abandon(h):
    items = tokens_item(h)
    return h.expect_refusal(
        0, "Step", stage_pb2.StepRequest(step=h.step + 1, abandon=True), metadata=_captured(h, 0, "Forward", items[0])
    )


@case("none", "a captured Forward's token and proof on a ForwardItem of the same item (its unary twin)")
def replayed_as_twin(h):
    put_labels(h)
    item = tokens_item(h)[0]
    return h.expect_refusal(0, "ForwardItem", item, metadata=_captured(h, 0, "Forward", item))


@case("none", "a captured Step's token and proof with another request (Step(abandon) of another step)")
def replayed_other_fields(h):
    metadata = _captured(h, 0, "Step", stage_pb2.StepRequest(step=h.step + 1000))
    return h.expect_refusal(0, "Step", stage_pb2.StepRequest(step=h.step + 1, abandon=True), metadata=metadata)


@case("none", "a captured Forward's proof on another first item (other tokens, same call info)")
def replayed_other_item(h):
    put_labels(h)
    metadata = _captured(h, 0, "Forward", tokens_item(h)[0])
    return h.expect_refusal(0, "Forward", tokens_item(h), metadata=metadata)


@case("none", "Forward into stage 0 with the trainer's token alone, no call proof (a token seen on a relay)")
def token_without_proof(h):
    put_labels(h)
    return h.expect_refusal(0, "Forward", tokens_item(h), metadata=h.keys.metadata("trainer", 0))


@case("none", "Forward into stage 0 whose proof is dated 10 minutes ago (a call held back, then sent)")
def stale_proof(h):
    put_labels(h)
    items = tokens_item(h)
    return h.expect_refusal(0, "Forward", items, metadata=_captured(h, 0, "Forward", items[0], now=time.time() - 600))


@case("none", "Forward into stage 0 whose proof is dated 10 minutes ahead")
def future_proof(h):
    put_labels(h)
    items = tokens_item(h)
    return h.expect_refusal(0, "Forward", items, metadata=_captured(h, 0, "Forward", items[0], now=time.time() + 600))


# ---- in plan, malicious: the call info ------------------------------------------------------------------------


@case("trainer", "forged route: stage 0 told to send its activation to a foreign address")
def forged_route(h):
    put_labels(h)
    with Foreign() as foreign:
        route = [h.addresses[0], foreign.address, h.addresses[2]]
        outcome = h.expect_refusal(0, "Forward", tokens_item(h, h.info(0, route=route)))
    outcome.extra["bytes_to_foreign"] = foreign.received
    return outcome


@case("trainer", "a call following plan 7 while the stage follows plan 0")
def wrong_plan_version(h):
    return forward_to_middle(h, activation(h, 2), plan_version=7)


@case("trainer", "a call for stage 2 sent to the stage 1 server")
def stage_mismatch(h):
    return forward_to_middle(h, activation(h, 2), stage=2)


@case("trainer", "a route naming one stage for a 3-stage pipeline")
def route_too_short(h):
    return forward_to_middle(h, activation(h, 2), route=h.addresses[:1], route_peers=h.keys.stage_ids[:1])


@case("trainer", "step 2^62 opened on stage 0")
def step_2_62(h):
    labels = stage_pb2.LabelsRequest(info=h.info(2, step=STEP_2_62), labels=tokens_to_wire(torch.zeros(2, 16)))
    refused_labels = h.expect_refusal(2, "PutLabels", labels)
    if not refused_labels.refused:
        return refused_labels
    return h.expect_refusal(0, "Forward", tokens_item(h, h.info(0, step=STEP_2_62)))


@case("trainer", "labels for step 2^62, 1100 micro-batches (past the pending-labels table)")
def labels_future_steps(h):

    labels = tokens_to_wire(torch.randint(0, 256, (2, 16)))

    def put(mb: int) -> Outcome:
        request = stage_pb2.LabelsRequest(info=h.info(2, step=STEP_2_62, micro_batch=mb), labels=labels)
        return h.expect_refusal(2, "PutLabels", request)

    outcomes = [put(mb) for mb in range(1100)]
    return all_refused(outcomes, {"labels_accepted": sum(not o.refused for o in outcomes)})


@case("trainer", "micro_batch 1000 of 2")
def micro_batch_out_of_range(h):
    return h.expect_refusal(0, "Forward", tokens_item(h, h.info(0, micro_batch=1000)))


@case("trainer", "num_micro_batches 2^32-1")
def num_micro_batches_huge(h):
    return h.expect_refusal(0, "Forward", tokens_item(h, h.info(0, num_micro_batches=2**32 - 1)))


@case("trainer", "schedule 'zigzag'")
def unknown_schedule(h):
    return h.expect_refusal(0, "Forward", tokens_item(h, h.info(0, schedule="zigzag")))


@case("trainer", "duplicate micro-batch: micro-batch 0 forwarded twice in one step")
def duplicate_micro_batch(h):

    labels = stage_pb2.LabelsRequest(info=h.info(2), labels=tokens_to_wire(torch.randint(0, 256, (2, 16))))
    h.call(2, "PutLabels", labels)
    h.call(0, "Forward", tokens_item(h))
    return h.expect_refusal(0, "Forward", tokens_item(h))


def _parked_burst(h, n_micro: int, micro_batch) -> Outcome:
    """40 Forward calls into the middle stage with deadline_s 1e6, all at once, then Status and Probe: refused
    only if every call was and both control calls answered meanwhile."""

    def parked(i: int) -> Outcome:
        return forward_to_middle(
            h, activation(h, 1), micro_batch=micro_batch(i), num_micro_batches=n_micro, deadline_s=1e6
        )

    outcomes = burst(parked, 40, threads=40)
    extra = {}
    for method, request in (("Status", stage_pb2.Empty()), ("Probe", stage_pb2.ProbeRequest(reply_bytes=16))):
        try:
            h.call(1, method, request, timeout=5)
            extra[f"{method.lower()}_answered"] = True
        except grpc.RpcError as e:
            extra[f"{method.lower()}_answered"] = False
            extra[f"{method.lower()}_error"] = rpc_error(e)
    result = all_refused(outcomes, extra)
    result.refused = result.refused and all(v for k, v in extra.items() if k.endswith("_answered"))
    return result


@case("trainer", "deadline_s 1e6 on 40 calls parked in the schedule of a legal 16-micro-batch step", heavy=True)
def deadline_huge_parked_x40(h):
    """Every call's micro-batch is in the program, so the calls wait for their turns (forward 0 never comes):
    the stage must end each wait at its own cap (`max_wait_s`, whatever deadline_s says) or refuse calls past
    its data slots, answer Status and Probe meanwhile, and serve the next step."""
    return _parked_burst(h, 16, lambda i: i % 15 + 1)


@case("trainer", "deadline_s 1e6 on 40 concurrent calls parked in the schedule; then Status and Probe", heavy=True)
def deadline_huge_x40(h):
    return _parked_burst(h, 64, lambda i: i + 1)


# ---- in plan, malicious: sizes and streams --------------------------------------------------------------------


@case("trainer", "a 65536-sample activation batch into the middle stage", heavy=True)
def oversized_batch(h):
    return h.expect_refusal(1, "Forward", message_items(h.info(1), activation(h, 65536)), timeout=60)


@case("trainer", "163840 first sights in 10 calls the schedule refuses (micro_batch out of range)", heavy=True)
def first_sights_163840(h):

    outcomes = []
    for _ in range(10):
        items = message_items(h.info(1, micro_batch=1000), activation(h, 16384))
        outcomes.append(h.expect_refusal(1, "Forward", items, timeout=60))
    buffered = h.call(1, "Status", stage_pb2.Empty()).buffered_samples
    return all_refused(outcomes, {"buffered_samples_after": buffered})


@case("trainer", "zstd bomb: a small frame expanding to 257 MiB, sizes declared truthfully", heavy=True)
def zstd_bomb_257mib(h):
    outcome = h.expect_refusal(1, "Forward", bomb_items(h), timeout=60)
    outcome.extra["frame_bytes"] = len(zstd_bomb(257)[0])
    return outcome


@case("trainer", "four zstd bombs at once", heavy=True)
def zstd_bomb_x4(h):
    items = bomb_items(h)
    return all_refused(burst(lambda _: h.expect_refusal(1, "Forward", items, timeout=60), 4, threads=4))


@case("trainer", "first sights split by byte significance whose top-byte plane is a zstd bomb of 64 MiB")
def split_top_bomb(h):
    import zstandard

    from swarm.compression.framing import split_float_bytes
    from swarm.proto import wire_pb2

    msg = activation(h, 8)  # 16-bit first sights: a float payload the framing splits (ZSTD_SPLIT)
    split = split_float_bytes(msg, 1)
    split.raw_split.top = zstandard.ZstdCompressor(level=3).compress(bytes(64 * MIB))
    body = split.SerializeToString()
    head = header(list(msg.shape), len(body), len(msg.SerializeToString()), codec=msg.codec, dtype=msg.dtype)
    head.compression = wire_pb2.ZSTD_SPLIT
    return h.expect_refusal(1, "Forward", list(stream(h.info(1), head, iter([body]))))


@case("trainer", "a 9 KB zstd frame stating 256 MiB, under a header whose raw size passes the ratio check")
def zstd_frame_states_more(h):
    import zstandard

    frame = zstandard.ZstdCompressor(level=3).compress(bytes(256 * MIB))
    shape = [2, h.model.seq_len_tokens, h.model.boundary_dim]
    head = header(shape, len(frame), 64 * len(frame), zstd=True)
    return h.expect_refusal(1, "Forward", list(stream(h.info(1), head, iter([frame]))))


@case("trainer", "zstd frame whose header claims 1 KiB raw but expands to 257 MiB")
def zstd_header_lies(h):
    return h.expect_refusal(1, "Forward", bomb_items(h, claimed_raw=1024), timeout=60)


@case("trainer", "a 512 MiB stream declared under the wrong plan (the plan check must come before reading)", heavy=True)
def stream_512mib_wrong_plan(h):
    info = h.info(1, plan_version=7)
    return h.expect_refusal(1, "Forward", huge_stream(info, [512 * MIB // 4 - 64]), timeout=120)


@case("trainer", "header says body_bytes 10, the chunk carries 100")
def header_body_bytes_short(h):
    shape = [1, 16, 32]
    return h.expect_refusal(1, "Forward", list(stream(h.info(1), header(shape, 10), iter([bytes(100)]))))


@case("trainer", "truncated stream: half the declared body, then the end")
def truncated_stream(h):
    items = message_items(h.info(1), activation(h, 2))

    first = stage_pb2.StreamItem.FromString(items[0])
    first.chunk.data = first.chunk.data[: len(first.chunk.data) // 2]
    return h.expect_refusal(1, "Forward", [first.SerializeToString()])


@case("trainer", "a chunk after the end of the message")
def chunk_after_end(h):

    items = message_items(h.info(1), activation(h, 2)) + [serialize_chunk_item(bytes(16))]
    return h.expect_refusal(1, "Forward", items)


@case("trainer", "the call info repeated in a later item")
def repeated_call_info(h):

    items = message_items(h.info(1), activation(h, 2)) + [stage_pb2.StreamItem(info=h.info(1)).SerializeToString()]
    return h.expect_refusal(1, "Forward", items)


@case("trainer", "an empty stream")
def empty_stream(h):
    return h.expect_refusal(1, "Forward", [])


@case("trainer", "a stream whose first item has no call info")
def first_item_without_info(h):

    return h.expect_refusal(1, "Forward", [serialize_chunk_item(bytes(16), None, header([1, 16, 32], 16))])


@case("trainer", "header naming codec enum 99")
def unknown_codec_enum(h):
    return h.expect_refusal(1, "Forward", list(stream(h.info(1), header([1, 16, 32], 16, codec=99), iter([bytes(16)]))))


@case("trainer", "header shape with 9 dimensions")
def too_many_dims(h):
    return h.expect_refusal(1, "Forward", list(stream(h.info(1), header([1] * 9, 16), iter([bytes(16)]))))


@case("trainer", "one 5 MiB chunk (over the 4 MiB chunk limit)")
def chunk_over_limit(h):
    return h.expect_refusal(1, "Forward", list(stream(h.info(1), header([1, 16, 32], 5 * MIB), iter([bytes(5 * MIB)]))))


# ---- in plan, malicious: tensor contents ----------------------------------------------------------------------


@case("trainer", "activation of shape [2, 16, 31] (hidden is 32)")
def wrong_shape(h):
    return forward_to_middle(h, make_codec(CodecConfig("fp32")).encode(torch.randn(2, 16, 31)))


@case("trainer", "activation with dtype enum 99")
def wrong_dtype(h):
    msg = activation(h, 2)
    msg.dtype = 99
    return forward_to_middle(h, msg)


@case("trainer", "first sights carrying NaN")
def nan_values(h):
    return forward_to_middle(h, activation(h, 2, fill=float("nan")))


@case("trainer", "first sights carrying Inf")
def inf_values(h):
    return forward_to_middle(h, activation(h, 2, fill=float("inf")))


@case("trainer", "an AQ-SGD delta for live samples 0 and 1 with scales 1e30 (overflows the fp16 buffer)")
def scale_1e30(h):

    msg = activation(h, 2, ids=[0, 1], delta=True)
    groups = len(msg.quantized.scales) // 4 if msg.quantized.scale_dtype == wire_pb2.FLOAT32 else None
    groups = groups or len(msg.quantized.scales) // 2
    msg.quantized.scale_dtype = wire_pb2.FLOAT32
    msg.quantized.scales = torch.full((groups,), 1e30).numpy().tobytes()
    msg.quantized.mins = torch.zeros(groups).numpy().tobytes()
    return forward_to_middle(h, msg)


@case("trainer", "an AQ-SGD delta quantized with 7 bits")
def quantized_bits_7(h):
    msg = activation(h, 2, ids=[0, 1], delta=True)
    msg.quantized.bits = 7
    return forward_to_middle(h, msg)


@case("trainer", "an AQ-SGD delta whose payload is 3 bytes short")
def quantized_payload_short(h):
    msg = activation(h, 2, ids=[0, 1], delta=True)
    msg.quantized.payload = msg.quantized.payload[:-3]
    return forward_to_middle(h, msg)


@case("trainer", "an AQ-SGD delta for sample ids the stage never saw")
def delta_unknown_ids(h):
    return forward_to_middle(h, activation(h, 2, ids=fresh_ids(2), delta=True))


@case("trainer", "buffer-miss storm: 200 deltas for unknown ids, 8 at a time")
def buffer_miss_storm(h):
    return all_refused(burst(lambda _: delta_unknown_ids(h), 200))


@case("trainer", "a valid-looking delta for live samples 0 and 1 computed against a drifted buffer")
def drifted_buffer(h):
    put_labels(h)
    return forward_to_middle(h, activation(h, 2, ids=[0, 1], delta=True))


@case("trainer", "a delta for live samples with a forged buffer digest (where the wire carries one)")
def forged_buffer_digest(h):
    msg, info = activation(h, 2, ids=[0, 1], delta=True), h.info(1)
    forged = []
    for target in (msg, info):
        for f in target.DESCRIPTOR.fields:
            if any(word in f.name for word in ("digest", "checksum")) and not f.is_repeated:
                setattr(target, f.name, b"\x5a" * 8 if f.type == f.TYPE_BYTES else 0x5A5A)
                forged.append(f.name)
    if not forged:
        return Outcome(False, "no buffer digest field on this tree's wire messages: nothing to forge")
    outcome = h.expect_refusal(1, "Forward", message_items(info, msg))
    outcome.extra["forged_fields"] = forged
    return outcome


@case("trainer", "tokens with id 300 (vocabulary is 256) after the step opened")
def tokens_out_of_vocab(h):
    return h.expect_refusal(0, "Forward", tokens_item(h, values=torch.full((2, 16), 300)))


@case("trainer", "tokens with id -1")
def tokens_negative(h):
    return h.expect_refusal(0, "Forward", tokens_item(h, values=torch.full((2, 16), -1)))


@case("trainer", "tokens of shape [2, 17] (sequence length is 16)")
def tokens_shape_wrong(h):
    return h.expect_refusal(0, "Forward", tokens_item(h, values=torch.zeros(2, 17, dtype=torch.long)))


@case("trainer", "a token batch whose bytes do not fill its shape: fails validation after the step opened")
def tokens_bytes_mismatch(h):
    return h.expect_refusal(0, "Forward", tokens_item(h, tokens=b"\x00" * 3))


@case("trainer", "labels of shape [2, 17]")
def labels_wrong_shape(h):

    request = stage_pb2.LabelsRequest(info=h.info(2), labels=tokens_to_wire(torch.zeros(2, 17, dtype=torch.long)))
    return h.expect_refusal(2, "PutLabels", request)


@case("trainer", "labels sent to the middle stage")
def labels_to_middle(h):

    request = stage_pb2.LabelsRequest(info=h.info(1), labels=tokens_to_wire(torch.zeros(2, 16, dtype=torch.long)))
    return h.expect_refusal(1, "PutLabels", request)


@case("trainer", "Step for a step that never ran on the stage")
def step_never_ran(h):

    return h.expect_refusal(1, "Step", stage_pb2.StepRequest(step=h.step + 5, global_grad_norm=1.0))


# ---- verified stage work: Audit and Recompute (trainers only; swarm.runtime.verify) -------------------------------


def _recompute(h, rows: int = 2, seq: int = 16, hidden: int = 32, **fields) -> stage_pb2.RecomputeRequest:
    x = make_codec(CodecConfig("fp32")).encode(torch.randn(rows, seq, hidden))
    return stage_pb2.RecomputeRequest(step=h.step, stage=1, input=x, **fields)


@case("stranger", "Audit: the middle stage's records of micro-batch 0 (its activations)")
def stranger_audit(h):
    return h.expect_refusal(1, "Audit", stage_pb2.AuditRequest(step=h.step, stage=1), "stranger")


@case("stranger", "Recompute: a forward of the middle stage on the stranger's activation (compute for free)")
def stranger_recompute(h):
    return h.expect_refusal(1, "Recompute", _recompute(h), "stranger")


@case("trainer", "Audit of a step that is not open on the stage")
def audit_not_open(h):
    return h.expect_refusal(1, "Audit", stage_pb2.AuditRequest(step=h.step + 5, stage=1))


@case("trainer", "Recompute of an activation of the wrong hidden size")
def recompute_wrong_shape(h):
    return h.expect_refusal(1, "Recompute", _recompute(h, hidden=31))


@case("trainer", "Recompute of 4096 rows, past the stage's batch budget")
def recompute_too_many_rows(h):
    return h.expect_refusal(1, "Recompute", _recompute(h, rows=4096, seq=1))


@case("trainer", "Recompute under another plan version")
def recompute_other_plan(h):
    return h.expect_refusal(1, "Recompute", _recompute(h, plan_version=7))


@case("trainer", "Recompute with a backward whose output gradient is missing")
def recompute_backward_no_grad(h):
    return h.expect_refusal(1, "Recompute", _recompute(h, backward=True))


@case("stranger", "AuditInputs: the middle stage's input of micro-batch 0, asked as if a sibling replica")
def stranger_audit_inputs(h):
    return h.expect_refusal(1, "AuditInputs", stage_pb2.AuditRequest(step=h.step, stage=1, compact=True), "stranger")


@case("trainer", "AuditInputs asked by the trainer itself (only another replica of the stage fetches them)")
def trainer_audit_inputs(h):
    return h.expect_refusal(1, "AuditInputs", stage_pb2.AuditRequest(step=h.step, stage=1, compact=True))


@case("trainer", "a direct Recompute pointing the stage at a peer outside its stage (fetch from anywhere)")
def recompute_fetch_elsewhere(h):
    request = stage_pb2.RecomputeRequest(
        step=h.step, stage=1, fetch_peer=h.keys.stage_ids[0], input_digest=bytes(32), sketch_size=1024
    )
    return h.expect_refusal(1, "Recompute", request)


@case("stranger", "Probe asking for 2^32-1 reply bytes")
def probe_reply_max(h):

    return h.expect_refusal(1, "Probe", stage_pb2.ProbeRequest(reply_bytes=2**32 - 1), "stranger")


# ---- in plan, malicious: what a caller holds (the server's bounds) ---------------------------------------------


def _held_stream(h: Harness, stage: int, release: threading.Event) -> Outcome:
    """A Forward into `stage` that sends its first item, then nothing until `release` (or the client's deadline)."""
    first = tokens_item(h)

    def items():
        yield from first
        release.wait(CALL_TIMEOUT_S)

    return h.expect_refusal(stage, "Forward", items())


@case("trainer", "24 data streams into stage 0 that send only their first item (every data slot, held)")
def held_streams_x24(h):
    """The server's read deadline cancels each within its item deadline, long before the client's deadline;
    the trainer's own share of the slots refuses the ones past it at once."""
    put_labels(h)
    release, started = threading.Event(), time.monotonic()
    try:
        outcomes = burst(lambda _: _held_stream(h, 0, release), 24, threads=24)
    finally:
        release.set()
    result = all_refused(outcomes, {"held_s": round(time.monotonic() - started, 2)})
    result.refused = result.refused and result.extra["held_s"] < CALL_TIMEOUT_S
    return result


@case("trainer", "sample ids 2^62 and -2^63 in an AQ-SGD activation into the middle stage")
def sample_ids_out_of_range(h):
    outcomes = [forward_to_middle(h, activation(h, 2, ids=[5, bad])) for bad in (1 << 62, -(1 << 63))]
    return all_refused(outcomes)


@case("trainer", "sample id -2^63 in a token batch into stage 0")
def token_sample_id_negative(h):
    put_labels(h)
    item = tokens_item(h)
    batch = stage_pb2.StreamItem.FromString(item[0])
    batch.tokens.sample_ids[1] = -(1 << 63)
    return h.expect_refusal(0, "Forward", [batch.SerializeToString()])


@case(
    "trainer",
    "14 rounds of 24 concurrent 256-row first sights, each admitted then refused (its turn never comes)",
    heavy=True,
)
def first_sights_256_x24_rounds(h):
    """The stage decodes each call's first sights, then the call waits for a turn that never comes and is refused
    at max_wait_s: the server's RSS must not grow round after round (`rss_mib_by_round`)."""

    def parked(i: int) -> Outcome:
        return forward_to_middle(h, activation(h, 256), micro_batch=i % 15 + 1, num_micro_batches=16)

    outcomes, rss = [], []
    for _ in range(14):
        outcomes += burst(parked, 24, threads=24)
        rss.append(round(h.servers.stats().get("rss_mib", 0.0), 1))
    return all_refused(outcomes, {"rss_mib_by_round": rss, "received_mib": round(14 * 24 * 256 * 16 * 32 * 2 / 2**20)})


assert len({c.name for c in CASES}) == len(CASES), "case names must be unique"
