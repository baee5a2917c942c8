"""Audit records on the wire: a stage's records and a sibling's recomputation, in fp32 or compact (fp16 after a
power-of-two scale), read back within bounds.

An audit moves, per stage of the audited route, the record's tensors (input, output, received and sent gradient)
to the trainer, the input and received gradient on to a sibling, and the sibling's output and input gradient back:
about eight [rows, seq, hidden] tensors for a middle stage. In fp32 that was about 1 MB a step in the churn
experiment, more than every compressed tensor of the step. Compact records carry each tensor as fp16 times
2^scale, the scale a power of two chosen from the tensor's largest magnitude, so the cast is the only rounding
(relative error at most 2^-11 an element, for gradients far below fp16's normal range too): half the bytes,
and an error (measured 2e-4 relative on the churn model's stages) five times below the own check's `rtol` 1e-3.
The trainer (`swarm.runtime.verify`) asks for the exact fp32 records wherever a check on the compact ones fails,
so every verdict is still reached on fp32 records, as before. Direct sketched audits send the trainer sketches of
the input and received gradient too, and the digests of their compact messages, which the sibling fetches from the
audited stage and checks (`audit_inputs_reply`, `fill_fetched`): they cross the wire once instead of twice.

Nothing here is trusted: every tensor is decoded within the receiver's `WireLimits`, by its message's own codec
(fp32, or fp16 with a bounded scale; nothing else), and refused when it is not finite.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import torch
from google.protobuf.message import DecodeError

from swarm.compression import DEFAULT_LIMITS, CodecConfig, WireError, WireLimits, make_codec
from swarm.compression.codecs import decoder_for
from swarm.compression.framing import decompress_at_most, zstd_compressor
from swarm.net.stream import tokens_from_wire, tokens_to_wire
from swarm.proto import stage_pb2, wire_pb2
from swarm.runtime.audit import stateless

__all__ = [
    "MAX_SCALE_EXP",
    "RECORD_CODECS",
    "audit_inputs_reply",
    "audit_reply",
    "committed_mismatch",
    "compact_equal",
    "decode_tensor",
    "digest",
    "encode_tensor",
    "fetched_sketch",
    "fill_fetched",
    "pack_reply",
    "read_record",
    "recompute_inputs",
    "recompute_reply",
    "recompute_request",
    "reply_tensor",
    "same_sketch",
    "sketch",
    "sketch_digest",
    "unpack_reply",
]

RECORD_CODECS = ("fp32", "fp16", "sketch")
"""How audit records travel (`VerifyConfig.records`): exact fp32; fp16 after a power-of-two scale; or "sketch":
fp16 for what a sibling recomputes from (a stage's input and received gradient), count sketches for the rest."""
MAX_SKETCH_SIZE = 1 << 16
"""Most buckets a stage sketches into (a trainer asking for more is refused)."""
MAX_SCALE_EXP = 160
"""Largest |scale| a compact tensor may carry: fp32's whole range (2^-149 .. 2^128) with fp16's 2^-24 .. 2^16."""
_FP16_HEADROOM_EXP = 15
"""A compact tensor's largest magnitude is scaled into [2^14, 2^15): below fp16's largest finite 65504."""

_FP32, _FP16 = make_codec(CodecConfig("fp32")), make_codec(CodecConfig("fp16"))


def _scale_exp(t: torch.Tensor) -> int:
    peak = float(t.abs().max()) if t.numel() else 0.0
    if peak == 0.0 or not math.isfinite(peak):
        return 0  # zeros need no scale; a NaN/Inf is refused by the codec's encode
    return math.frexp(peak)[1] - _FP16_HEADROOM_EXP


def encode_tensor(t: torch.Tensor, compact: bool) -> tuple[wire_pb2.TensorMessage, int]:
    """`t` (any float dtype, any device) as an audit tensor: its fp32 message and scale 0, or (compact) the fp16
    message of t / 2^scale and the scale. The scale is a power of two, so the one rounding is fp16's; computed in
    fp64, so no intermediate over- or underflows."""
    t = t.detach().float().cpu()
    if not compact:
        return _FP32.encode(t), 0
    scale = _scale_exp(t)
    return _FP16.encode(torch.ldexp(t.double(), torch.tensor(-scale)).half()), scale


def decode_tensor(
    msg: wire_pb2.TensorMessage, scale: int, field: str, limits: WireLimits = DEFAULT_LIMITS
) -> torch.Tensor:
    """An audit tensor as fp32, within `limits`: an fp32 message (scale 0) or an fp16 one times 2^scale. Raises
    WireError naming `field` for another codec, a scale out of bounds, a value that is not finite."""
    try:
        if msg.codec == wire_pb2.FP32:
            if scale:
                raise WireError("scale", f"{scale} given for an fp32 tensor")
            return _FP32.decode(msg, limits=limits)
        if msg.codec != wire_pb2.FP16:
            raise WireError("codec", "an audit tensor is fp32 or fp16")
        if not -MAX_SCALE_EXP <= scale <= MAX_SCALE_EXP:
            raise WireError("scale", f"{scale} is outside +-{MAX_SCALE_EXP}")
        out = torch.ldexp(_FP16.decode(msg, limits=limits).double(), torch.tensor(scale)).float()
        if out.numel() and not bool(torch.isfinite(out).all()):
            raise WireError("scale", f"2^{scale} takes the tensor past fp32's range")
        return out
    except WireError as e:
        raise WireError(field, str(e)) from None


DIGEST_BYTES = 32


def digest(msg: wire_pb2.TensorMessage, scale: int) -> bytes:
    """What a stage commits to for a compact tensor a sibling fetches from it (a direct audit): a hash of the
    message's deterministic serialization and its scale. The encoding is deterministic, so the stage's Audit reply
    and its AuditInputs reply for the same record give the same digest."""
    h = hashlib.blake2b(msg.SerializeToString(deterministic=True), digest_size=DIGEST_BYTES)
    h.update(int(scale).to_bytes(4, "little", signed=True))
    return h.digest()


def compact_equal(exact: torch.Tensor, compact: torch.Tensor) -> bool:
    """Whether `compact` is what `encode_tensor(exact, True)` decodes to: the compact record a stage reported is
    the rounding of the fp32 record it reports when asked again (the rounding is deterministic)."""
    if exact.shape != compact.shape:
        return False
    msg, scale = encode_tensor(exact, True)
    return bool(torch.equal(decode_tensor(msg, scale, "compact"), compact.float()))


_MIX = (np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))


def sketch(t: torch.Tensor, seed: int, size: int) -> torch.Tensor:
    """The count sketch of `t` into `size` buckets under `seed`: element i, with the sign and bucket a
    splitmix64 hash of (seed, i) gives it, added to its bucket (fp64 sums). Linear, so the sketch of a
    difference is the difference of sketches, and its norm estimates the difference's norm: E|S d|^2 = |d|^2, with
    a relative variance of at most 2 / size (3% of the norm at 1024 buckets). The hash is integer arithmetic
    (numpy's wrapping uint64), the same bits on every machine and version: a stage's sketch of its record and the
    trainer's of the same tensor agree to fp64 rounding."""
    flat = t.detach().reshape(-1).double().cpu().numpy()
    with np.errstate(over="ignore"):
        h = (np.arange(flat.size, dtype=np.uint64) + np.uint64(seed & (2**64 - 1))) * _MIX[0]
        h = (h ^ (h >> np.uint64(30))) * _MIX[1]
        h = (h ^ (h >> np.uint64(27))) * _MIX[2]
        h ^= h >> np.uint64(31)
    signs = np.where((h >> np.uint64(63)) == 1, -1.0, 1.0)
    buckets = (h % np.uint64(size)).astype(np.int64)
    return torch.from_numpy(np.bincount(buckets, weights=flat * signs, minlength=size).astype(np.float64))


def same_sketch(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two sketches are of the same values: equal to fp64 summation order and the wire's fp32."""
    return a.shape == b.shape and bool(torch.allclose(a, b, 1e-5, 1e-9 * float(b.abs().max()) if b.numel() else 0))


def _pays(t: torch.Tensor, size: int) -> bool:
    """Whether a sketch (4 bytes a bucket) is smaller than the tensor in fp16 (2 bytes an element): where it is not,
    the tensor goes as compact values, which the trainer sketches itself."""
    return t.numel() > 2 * size


def _sketch_size(size: int) -> int:
    if not 0 <= size <= MAX_SKETCH_SIZE:
        raise WireError("sketch_size", f"{size} is outside 0..{MAX_SKETCH_SIZE}")
    return size


# ---- the stage's side -------------------------------------------------------------------------------------------


def audit_reply(
    record, is_first: bool, is_last: bool, backward: bool, compact: bool = False, sketch_seed: int = 0,
    sketch_size: int = 0, direct: bool = False,
) -> stage_pb2.AuditReply:  # fmt: skip
    """An `AuditRecord` on the wire (the trainer compares it with a recomputation): fp32 tensors, or compact; with
    `sketch_size` (and compact), sketches of what no sibling recomputes from: the output, the sent gradient and
    stage 0's received gradient; with `direct` too, sketches of the input and received gradient as well, and the
    digests of their compact messages, which a sibling fetches from this stage (`audit_inputs_reply`)."""
    reply = stage_pb2.AuditReply()
    sketched = {"output", "grad_sent"} | ({"grad_received"} if is_first else set())
    size = _sketch_size(sketch_size) if compact else 0
    fetched = {"input", "grad_received"} - sketched if size and direct else set()

    def put(name: str, t: torch.Tensor) -> None:
        if size and name in fetched and _pays(t, size):  # the values the sibling will fetch: their sketch, digest
            if name == "grad_received" and record.grad_message is not None:  # served as it came: decoded alike
                msg, scale, committed = record.grad_message, 0, t.float()
            else:
                msg, scale = encode_tensor(t, True)
                committed = decode_tensor(msg, scale, name)
            getattr(reply, f"{name}_sketch").extend(sketch(committed, sketch_seed, size).tolist())
            setattr(reply, f"{name}_digest", digest(msg, scale))
            return
        if size and name in sketched and _pays(t, size):
            getattr(reply, f"{name}_sketch").extend(sketch(t.float(), sketch_seed, size).tolist())
            return
        msg, scale = encode_tensor(t, compact)
        getattr(reply, name).CopyFrom(msg)
        setattr(reply, f"{name}_scale", scale)

    if is_first:
        reply.tokens.CopyFrom(tokens_to_wire(record.inputs.cpu()))
    else:
        put("input", record.inputs)
    if is_last:
        reply.loss = float(record.output)
    else:
        put("output", record.output)
    if backward and record.grad_received is not None:
        if not is_last:
            put("grad_received", record.grad_received)
        if record.grad_sent is not None:
            put("grad_sent", record.grad_sent)
    return reply


def audit_inputs_reply(record, is_last: bool, backward: bool) -> stage_pb2.AuditReply:
    """What a sibling fetches for a direct audit (`AuditInputs`): the record's input and (backward, not the last
    stage) received gradient, compact, as `audit_reply` digested them."""
    reply = stage_pb2.AuditReply()
    tensors = [("input", record.inputs)]
    if backward and not is_last and record.grad_message is not None:
        reply.grad_received_wire.CopyFrom(record.grad_message)
    elif backward and not is_last and record.grad_received is not None:
        tensors.append(("grad_received", record.grad_received))
    for name, t in tensors:
        msg, scale = encode_tensor(t, True)
        getattr(reply, name).CopyFrom(msg)
        setattr(reply, f"{name}_scale", scale)
    return reply


AUDIT_ZSTD_LEVEL = 1
"""zstd level of an AuditInputs reply (`pack_reply`): fp16 activations shrink about 9% (measured on the churn
model's stage inputs; level 3 gains nothing more)."""


def pack_reply(reply: stage_pb2.AuditReply) -> stage_pb2.AuditReply:
    """An AuditInputs reply as it goes on the wire: zstd-compressed into `zstd_body` where that is smaller."""
    body = reply.SerializeToString()
    packed = zstd_compressor(AUDIT_ZSTD_LEVEL).compress(body)
    return stage_pb2.AuditReply(zstd_body=packed) if len(packed) < len(body) else reply


def unpack_reply(reply: stage_pb2.AuditReply, limits: WireLimits = DEFAULT_LIMITS) -> stage_pb2.AuditReply:
    """`pack_reply` undone within `limits` (a body that expands past their zstd ratio or message size, is corrupt,
    or comes beside other fields is refused, WireError naming `zstd_body`)."""
    if not reply.zstd_body:
        return reply
    body = reply.zstd_body
    if reply.ByteSize() != stage_pb2.AuditReply(zstd_body=body).ByteSize():
        raise WireError("zstd_body", "comes with other fields")
    most = min(limits.max_message_bytes, limits.max_raw_bytes(len(body)))
    raw = decompress_at_most(body, most, "zstd_body")  # the frame's stated size checked before a byte is decompressed
    try:
        inner = stage_pb2.AuditReply.FromString(raw)
    except DecodeError as e:
        raise WireError("zstd_body", f"is not an AuditReply: {e}") from None
    if inner.zstd_body:
        raise WireError("zstd_body", "is packed twice")
    return inner


def fill_fetched(
    request: stage_pb2.RecomputeRequest, fetched: stage_pb2.AuditReply, limits: WireLimits = DEFAULT_LIMITS
) -> str | None:
    """Puts a direct Recompute's fetched input and gradient into `request`, where they match the digests the
    trainer passed on (the ones the audited stage committed to); a gradient that came as its wire message is
    decoded here within `limits` (and passed on in fp32). What does not match or decode, or None."""
    wanted = (("input", "input", "input_digest"), ("grad", "grad_received", "grad_digest"))
    for name, field, want in wanted:
        expected = getattr(request, want)
        if not expected:
            continue
        if name == "grad" and fetched.HasField("grad_received_wire"):
            msg = fetched.grad_received_wire
            if digest(msg, 0) != expected:
                return "its grad_received_wire is not the one it committed to"
            if not stateless(msg):
                return "its grad_received_wire needs a receiver's state to decode"
            try:
                grad = decoder_for(msg).decode(msg, limits=limits)
            except WireError as e:
                return f"its grad_received_wire does not decode: {e}"
            request.grad.CopyFrom(encode_tensor(grad, False)[0])
            request.grad_scale = 0
            continue
        if not fetched.HasField(field):
            return f"it sent no {field}"
        msg, scale = getattr(fetched, field), getattr(fetched, f"{field}_scale")
        if digest(msg, scale) != expected:
            return f"its {field} is not the one it committed to"
        getattr(request, name).CopyFrom(msg)
        setattr(request, f"{name}_scale", scale)
    return None


def sketch_digest(values) -> bytes:
    """A hash of a sketch as the wire carries it (fp32 buckets): a direct Recompute reports the one of each tensor
    it fetched (`fetched_sketch`) instead of the sketch, 16 bytes instead of 4 KB."""
    return hashlib.blake2b(np.asarray(values, dtype=np.float32).tobytes(), digest_size=16).digest()


def digest_of_sketch(t: torch.Tensor, seed: int, size: int) -> bytes:
    """The `sketch_digest` of `t`'s sketch under `seed` and `size` (what a sibling reports instead of the sketch:
    the same values give the same bits, the same code on the same decoded values)."""
    return sketch_digest(sketch(t.float(), seed, size).numpy())


def fetched_sketch(t: torch.Tensor, request: stage_pb2.RecomputeRequest) -> bytes:
    """A direct Recompute's `digest_of_sketch` of a fetched tensor, under the request's seed and size."""
    return digest_of_sketch(t, request.sketch_seed, _sketch_size(request.sketch_size))


def recompute_inputs(request: stage_pb2.RecomputeRequest, host):
    """A Recompute's (inputs, targets, output gradient), read within the stage's bounds (shapes: the host's
    `check_recompute`)."""
    role, model, limits = host.role, host.model, host.limits
    if role.is_first:
        if not request.HasField("tokens"):
            raise WireError("tokens", "stage 0 recomputes from token ids")
        inputs = tokens_from_wire(request.tokens, model.vocab_size, model.seq_len_tokens)[0]
    else:
        inputs = decode_tensor(request.input, request.input_scale, "input", limits)
    targets = None
    if role.is_last and request.HasField("targets"):
        targets = tokens_from_wire(request.targets, model.vocab_size, model.seq_len_tokens)[0]
    grad = None
    if request.backward and not role.is_first:
        if role.is_last:
            if not 0 < request.loss_weight <= 1:
                raise WireError("loss_weight", f"{request.loss_weight} is not in (0, 1]")
            grad = torch.tensor(request.loss_weight)
        else:
            grad = decode_tensor(request.grad, request.grad_scale, "grad", limits)
    return inputs, targets, grad


def recompute_reply(
    done, compact: bool = False, sketch_seed: int = 0, sketch_size: int = 0, digests_only: bool = False
) -> stage_pb2.RecomputeReply:
    """A `Recomputed` on the wire: fp32 tensors, or compact, or (compact with `sketch_size`) their sketches, or
    (`digests_only`) those sketches' `sketch_digest`s."""
    reply = stage_pb2.RecomputeReply(loss=done.loss)
    size = _sketch_size(sketch_size) if compact else 0
    for name, t in (("output", done.output), ("grad_in", done.grad_in)):
        if t is not None and size and _pays(t, size) and digests_only:
            setattr(reply, f"{name}_sketch_digest", digest_of_sketch(t, sketch_seed, size))
        elif t is not None and size and _pays(t, size):
            getattr(reply, f"{name}_sketch").extend(sketch(t.float(), sketch_seed, size).tolist())
        elif t is not None:
            msg, scale = encode_tensor(t, compact)
            getattr(reply, name).CopyFrom(msg)
            setattr(reply, f"{name}_scale", scale)
    return reply


# ---- the trainer's side ------------------------------------------------------------------------------------------

_RECORD_FIELDS = (("inputs", "input"), ("output", "output"), ("grad_received", "grad_received"),
                  ("grad_sent", "grad_sent"))  # fmt: skip
"""(evidence attribute, AuditReply field) of a record's tensors"""


def reply_tensor(message, name: str, e=None) -> torch.Tensor | None:
    """Field `name` of an Audit or Recompute reply (fp32, or compact with its `name`_scale, or its `name`_sketch),
    None where absent; with `e` (a `swarm.runtime.verify.Evidence`), kept as it came in `e.wire`, a sketch named in
    `e.sketched`."""
    sketched = getattr(message, f"{name}_sketch", None)
    if sketched:
        if e is not None:
            e.sketched.add(name)
        return torch.tensor(list(sketched), dtype=torch.float64)
    if not message.HasField(name):
        return None
    msg, scale = getattr(message, name), getattr(message, f"{name}_scale")
    if e is not None:
        e.wire[name] = (msg, scale)
    return decode_tensor(msg, scale, name)


def read_record(e, reply, first: bool, last: bool, micro, sketch_size: int) -> str | None:
    """Fills `e` (an `Evidence`) from a stage's AuditReply for the micro-batch `micro`; what is wrong with the
    record (a lie: malformed, missing its input, another shape, a sketch of another size), or None."""
    try:
        if first:
            shape = micro.tokens.shape
            e.inputs = tokens_from_wire(reply.tokens, 1 << 31, shape[1])[0] if reply.HasField("tokens") else None
        else:
            e.inputs = reply_tensor(reply, "input", e)
        e.output = reply.loss if last else reply_tensor(reply, "output", e)
        e.grad_received = None if last else reply_tensor(reply, "grad_received", e)
        e.grad_sent = None if first else reply_tensor(reply, "grad_sent", e)
    except WireError as error:
        return f"its audit record is malformed: {error}"
    if e.inputs is None:
        return "its audit record has no input"
    rows_seq = list(micro.tokens.shape)
    if first and list(e.inputs.shape) != rows_seq:
        return f"its audit record's tokens are shaped {list(e.inputs.shape)}, the trainer sent {rows_seq}"
    named = (("input", None if first else e.inputs), ("output", None if last else e.output))
    tensors = [(name, t) for name, t in (*named, ("grad_received", e.grad_received), ("grad_sent", e.grad_sent))]
    for name, t in tensors:
        if name in e.sketched and t.numel() != sketch_size:
            return f"its audit record's {name} sketch has {t.numel()} buckets, not {sketch_size}"
    for name in ("input", "grad_received") if not first else ():  # a direct audit's: a sibling fetches them
        committed = getattr(reply, f"{name}_digest")
        if name in e.sketched and len(committed) != DIGEST_BYTES:
            return f"its audit record sketches its {name} but commits to no digest of it for a sibling"
        if committed:
            e.digests[name] = bytes(committed)
    tensors = [(name, t) for name, t in tensors if t is not None and name not in e.sketched]
    hidden = {t.shape[-1] for _, t in tensors if t.dim()}
    for name, t in tensors:  # every tensor of the record is [rows, seq, hidden] of this micro-batch, one hidden
        if t.dim() != 3 or list(t.shape[:2]) != rows_seq or len(hidden) > 1:
            return f"its audit record's {name} is shaped {list(t.shape)} for {rows_seq} tokens"
    return None


def committed_mismatch(e, first) -> str | None:
    """A stage's fp32 record `e` against the compact one `first` it reported before for the same micro-batch:
    rounding (or sketching) the one must give the other, or the stage reported two records. What differs, or
    None."""
    if not isinstance(first.output, torch.Tensor) and first.output is not None and e.output != first.output:
        return f"its loss record is {e.output} in fp32 and was {first.output} first"
    for attr, name in _RECORD_FIELDS:
        exact, shown = getattr(e, attr), getattr(first, attr)
        if name in first.sketched:
            candidates = [] if exact is None else [exact]
            if exact is not None and name in first.digests:  # a direct audit's: of the compact values, or (a
                # gradient served as its wire message) of the values as decoded
                candidates.append(decode_tensor(*encode_tensor(exact, True), name))
            if not any(same_sketch(sketch(t, first.sketch_seed, shown.numel()), shown) for t in candidates):
                return f"its fp32 {name} record does not sketch to the one it reported first"
        elif name in first.wire:
            compact = first.wire[name][0].codec == wire_pb2.FP16
            if exact is None or not (compact_equal(exact, shown) if compact else bool(torch.equal(exact, shown))):
                return f"its fp32 {name} record does not round to the compact one it reported first"
    return None


def recompute_request(
    step, plan_version, s, n, e, micro, loss_weight, backward: bool, compact: bool = False, local_mb: int = 0
):
    """What a sibling recomputes: stage `s`'s reported input (and received gradient; `e`), passed on as they came
    when compact (the same bits on both replicas), else in fp32; where `e` holds only a sketch and a digest (a
    direct audit), the sibling fetches it from the audited replica (`e.peer`, its local micro-batch `local_mb`)."""
    request = stage_pb2.RecomputeRequest(step=step, plan_version=plan_version, stage=s, compact=compact)

    def put(name: str, attr: str, t: torch.Tensor) -> None:
        if compact and attr in e.digests and attr in e.sketched:
            request.fetch_peer, request.micro_batch = e.peer, local_mb
            setattr(request, f"{name}_digest", e.digests[attr])
            return
        msg, scale = e.wire[attr] if compact and attr in e.wire else encode_tensor(t, False)
        getattr(request, name).CopyFrom(msg)
        setattr(request, f"{name}_scale", scale)

    if s == 0:
        request.tokens.CopyFrom(tokens_to_wire(micro.tokens))
    else:
        put("input", "input", e.inputs)
    if s == n - 1:
        request.targets.CopyFrom(tokens_to_wire(micro.targets))
    if backward and s > 0:
        request.backward = True
        if s == n - 1:
            request.loss_weight = loss_weight
        elif e.grad_received is not None:
            put("grad", "grad_received", e.grad_received)
        else:
            request.backward = False
    return request
