"""The gRPC stage service of a swarm-peer: decode, call the stage's pure compute, encode, pass it on.

Forward calls flow stage 0 -> last stage, each stage sending its activation straight to the next one and
returning the loss (from the last stage) back along the chain; backward calls flow last -> stage 0 the
same way. Every stage runs its calls in the order of its schedule program (`ScheduleGate`).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

import grpc
import torch

from swarm.compression import (
    BufferMissError,
    CodecConfig,
    LinkState,
    WireError,
    WireLimits,
    ZstdPolicy,
    make_codec,
)
from swarm.model.gpt import ModelConfig, build_stage
from swarm.net.stream import (
    BUFFER_MISS,
    PLAN_MISMATCH,
    Incoming,
    StageCallError,
    TensorStreams,
    name_failure,
    read_stream,
    tensor_items,
    tokens_from_wire,
)
from swarm.peers.shaper import LinkShaping
from swarm.peers.transport import Channels, TransportConfig
from swarm.proto import stage_pb2, stage_pb2_grpc, wire_pb2
from swarm.runtime.gate import GateError, ScheduleGate
from swarm.runtime.schedules import Kind
from swarm.runtime.worker import StageConfig, StageWorker

log = logging.getLogger("swarm.runtime.worker")

MAX_PENDING_LABELS = 1024
MAX_PROBE_BYTES = 16 << 20


@dataclass(frozen=True)
class StageRole:
    """Which slice of the model this peer serves, under which plan."""

    stage: int
    n_stages: int
    layer_start: int
    layer_end: int
    plan_version: int = 0

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.n_stages - 1


@dataclass
class LinkEnds:
    """This stage's ends of its two links: receiving activations / sending gradients to the previous stage,
    sending activations / receiving gradients from the next."""

    forward: CodecConfig
    backward: CodecConfig
    fw_recv: LinkState = field(init=False)
    fw_send: LinkState = field(init=False)
    bw_recv: LinkState = field(init=False)
    bw_send: LinkState = field(init=False)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.fw_recv, self.fw_send = LinkState(self.forward), LinkState(self.forward)
        self.bw_recv, self.bw_send = LinkState(self.backward), LinkState(self.backward)

    def end_step(self) -> None:
        for state in (self.fw_recv, self.fw_send, self.bw_recv, self.bw_send):
            state.end_step()

    def buffered_samples(self) -> int:
        return sum(len(s.buffers) for s in (self.fw_recv, self.fw_send) if s.buffers is not None)


class StageHost:
    """What one peer holds for its stage: the worker, its link ends, pending labels, the schedule gate."""

    def __init__(
        self,
        role: StageRole,
        model: ModelConfig,
        stage_cfg: StageConfig,
        links: LinkEnds,
        peer_id: str,
        transport: TransportConfig | None = None,
        shaping: LinkShaping | None = None,
        limits: WireLimits | None = None,
        device: str = "cpu",
    ):
        self.role, self.model, self.peer_id, self.device = role, model, peer_id, device
        module = build_stage(model, role.layer_start, role.layer_end, role.is_first, role.is_last)
        self.worker = StageWorker(module, stage_cfg)
        self.links = links
        self.fw_codec, self.bw_codec = make_codec(links.forward), make_codec(links.backward)
        self.gate = ScheduleGate(role.stage, role.n_stages)
        self.channels = Channels(transport or TransportConfig())
        self.shaping = shaping or LinkShaping()
        self.limits = limits or WireLimits()
        self.labels: dict[tuple[int, int], torch.Tensor] = {}
        self.compute_lock = threading.Lock()
        self.steps_done = 0
        self.open_step: int | None = None
        """The step this stage has taken calls for and not yet stepped or abandoned (None between steps)."""
        self.compute_layers_per_s = 0.0
        self.on_step = None  # callback(host) after every optimizer step, e.g. checkpointing
        self._zstd: dict[str, ZstdPolicy] = {}  # per destination: zstd only where it pays on that link
        self._policy_lock = threading.Lock()

    # ---- compute, called by the servicer ----------------------------------------------------------------

    def check_call(self, info: stage_pb2.CallInfo) -> None:
        if info.plan_version != self.role.plan_version:
            raise CallRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{PLAN_MISMATCH} the call follows plan {info.plan_version}, "
                f"this peer follows plan {self.role.plan_version}",
            )
        if self.open_step is not None and info.step != self.open_step:
            raise CallRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"step {info.step} arrived while step {self.open_step} is unfinished on this stage",
            )
        if info.stage != self.role.stage:
            raise CallRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this peer serves stage {self.role.stage}, not stage {info.stage}",
            )
        if len(info.route) != self.role.n_stages or len(info.route_peers) != self.role.n_stages:
            raise CallRefused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"route names {len(info.route)} stages, this pipeline has {self.role.n_stages}",
            )

    def activation_shape_ok(self, shape: list[int]) -> bool:
        return len(shape) == 3 and shape[1] <= self.model.seq_len_tokens and shape[2] == self.model.hidden_dim

    def forward(
        self, incoming: Incoming
    ) -> tuple[torch.Tensor | None, float | None, list[int], wire_pb2.TensorMessage | None]:
        """Runs this stage's forward of one micro-batch; returns (activation to send on, loss, sample ids, the
        activation encoded for the next stage)."""
        info, role = incoming.info, self.role
        if role.is_first:
            if incoming.tokens is None:
                raise CallRefused(grpc.StatusCode.INVALID_ARGUMENT, "stage 0 takes a token batch")
            inputs, id_tensor = tokens_from_wire(incoming.tokens, self.model.vocab_size, self.model.seq_len_tokens)
            ids = id_tensor.tolist()
        else:
            msg = _need_message(incoming)
            if not self.activation_shape_ok(list(msg.shape)):
                raise WireError(
                    "shape", f"{list(msg.shape)} is not an activation [batch, seq, {self.model.hidden_dim}]"
                )
            with self.links.lock:
                # the receiver computes on what the codec delivers (for AQ-SGD, its buffer m)
                inputs = self.fw_codec.decode(msg, state=self.links.fw_recv, limits=self.limits)
            ids = [int(i) for i in msg.sample_ids] or list(range(inputs.shape[0]))
        with self._turn(info, Kind.FORWARD):
            targets = None
            if role.is_last:
                targets = self.labels.pop((info.step, info.micro_batch), None)
                if targets is None:
                    raise CallRefused(
                        grpc.StatusCode.FAILED_PRECONDITION,
                        f"no labels for step {info.step} micro-batch {info.micro_batch}",
                    )
                if targets.shape != inputs.shape[:2]:
                    raise WireError("labels.shape", f"{list(targets.shape)} vs inputs {list(inputs.shape[:2])}")
            with self.compute_lock:
                out = self.worker.forward(info.micro_batch, inputs, torch.tensor(ids), targets)
            if role.is_last:
                return None, float(out), ids, None
            # encoded in schedule order, still holding the turn: the codec's state (stochastic rounding draws,
            # AQ-SGD buffers) must advance in the same order in every run, whatever the network's timing
            msg = self.encode_forward(out, ids)
        return out, None, ids, msg

    def backward(self, incoming: Incoming) -> tuple[torch.Tensor | None, wire_pb2.TensorMessage | None]:
        """Runs this stage's backward of one micro-batch; returns the gradient to send back and its encoding
        (None, None on stage 0)."""
        info = incoming.info
        if self.role.is_last:
            grad_out = torch.tensor(1.0 / max(1, info.num_micro_batches))
        else:
            msg = _need_message(incoming)
            if not self.activation_shape_ok(list(msg.shape)):
                raise WireError("shape", f"{list(msg.shape)} is not a gradient [batch, seq, {self.model.hidden_dim}]")
            with self.links.lock:
                grad_out = self.bw_codec.decode(msg, state=self.links.bw_recv, limits=self.limits)
        with self._turn(info, Kind.BACKWARD):
            with self.compute_lock:
                grad_in = self.worker.backward(info.micro_batch, grad_out)
            if grad_in is None:
                return None, None
            # in schedule order, as in forward(): gradq's error feedback and rounding draws follow the schedule
            msg = self.encode_backward(grad_in)
        return grad_in, msg

    def encode_forward(self, out: torch.Tensor, ids: list[int]) -> wire_pb2.TensorMessage:
        """The activation as the next stage receives it (advances this link's codec state)."""
        with self.links.lock:
            return self.fw_codec.encode(out, sample_ids=ids, state=self.links.fw_send)

    def encode_backward(self, grad: torch.Tensor) -> wire_pb2.TensorMessage:
        """The input gradient as the previous stage receives it (advances this link's codec state)."""
        with self.links.lock:
            return self.bw_codec.encode(grad, state=self.links.bw_send)

    def _turn(self, info: stage_pb2.CallInfo, kind: Kind):
        return self.gate.turn(
            info.step,
            kind,
            info.micro_batch,
            info.schedule or "1f1b",
            info.num_micro_batches or 1,
            timeout_s=info.deadline_s or 120.0,
        )

    def put_labels(self, info: stage_pb2.CallInfo, labels: stage_pb2.TokenBatch) -> None:
        if not self.role.is_last:
            raise CallRefused(grpc.StatusCode.FAILED_PRECONDITION, f"stage {self.role.stage} is not the last stage")
        if len(self.labels) >= MAX_PENDING_LABELS:
            raise CallRefused(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{MAX_PENDING_LABELS} label batches pending")
        targets, _ = tokens_from_wire(labels, self.model.vocab_size, self.model.seq_len_tokens)
        self.labels[(info.step, info.micro_batch)] = targets

    def grads(self) -> stage_pb2.GradReply:
        """This stage's tied-embedding gradient (if tied across stages) and its other gradients' squared norm."""
        tied = self.worker.module.tied_parameter() if self.role.n_stages > 1 else None
        sq = 0.0
        for p in self.worker.module.parameters():
            if p.grad is not None and p is not tied:
                sq += float(p.grad.detach().float().pow(2).sum())
        reply = stage_pb2.GradReply(grad_sq_norm=sq)
        if tied is not None:
            grad = self.worker.tied_grad()
            reply.tied_grad.CopyFrom(make_codec(CodecConfig("fp32")).encode(grad))
        return reply

    def step(self, request: stage_pb2.StepRequest) -> float:
        """Applies the summed tied gradient and steps the optimizer (or abandons the step's gradients)."""
        lr = 0.0
        with self.compute_lock:
            if request.abandon:
                self.worker.zero_grad()
            else:
                if request.plan_version != self.role.plan_version:
                    raise CallRefused(
                        grpc.StatusCode.FAILED_PRECONDITION,
                        f"{PLAN_MISMATCH} the step follows plan {request.plan_version}, "
                        f"this peer follows plan {self.role.plan_version}",
                    )
                if self.open_step != request.step:
                    raise CallRefused(
                        grpc.StatusCode.FAILED_PRECONDITION,
                        f"step {request.step} never ran on this stage (open step: {self.open_step})",
                    )
                if request.HasField("tied_grad_sum"):
                    tied = self.worker.module.tied_parameter()
                    if tied is None:
                        raise CallRefused(grpc.StatusCode.INVALID_ARGUMENT, "this stage holds no tied embedding")
                    grad = make_codec(CodecConfig("fp32")).decode(request.tied_grad_sum, limits=self.limits)
                    if grad.shape != tied.shape:
                        raise WireError("tied_grad_sum.shape", f"{list(grad.shape)}, expected {list(tied.shape)}")
                    self.worker.set_tied_grad(grad)
                if not self.gate.step_done:
                    raise CallRefused(grpc.StatusCode.FAILED_PRECONDITION, "step requested before every backward ran")
                lr = self.worker.step(request.global_grad_norm)
                self.steps_done += 1
            self.links.end_step()
            self.gate.reset()
            self.open_step = None
            self.labels = {k: v for k, v in self.labels.items() if k[0] > request.step}
        if self.on_step is not None and not request.abandon:
            self.on_step(self)
        return lr

    # ---- communication: the calls to the neighbouring stages -------------------------------------------

    def send_forward(
        self, info: stage_pb2.CallInfo, out: torch.Tensor, ids: list[int], msg: wire_pb2.TensorMessage
    ) -> stage_pb2.ForwardReply:
        """Sends the activation, encoded as `msg`, to the next stage; on a buffer miss there, re-sends the
        samples in full."""
        nxt = self.role.stage + 1
        next_info = _for_stage(info, nxt)
        stub = TensorStreams(self.channels.get(info.route[nxt]))
        for attempt in range(2):
            fp32 = 4 * out.numel()
            try:
                reply, sent = self._stream(stub.Forward, next_info, msg, self.links.forward.zstd_level, nxt)
            except grpc.RpcError as e:
                if (
                    attempt == 0
                    and e.code() == grpc.StatusCode.FAILED_PRECONDITION
                    and BUFFER_MISS in (e.details() or "")
                ):
                    log.info("stage %d lost AQ-SGD buffers; re-sending %d samples in full", nxt, len(ids))
                    with self.links.lock:
                        self.links.fw_send.buffers.forget(ids)
                    msg = self.encode_forward(out, ids)
                    continue
                raise name_failure(e, nxt, info.route_peers[nxt], info.route[nxt]) from e
            _count(reply.traffic, self.role.stage, sent, fp32)
            return reply
        raise AssertionError("unreachable")

    def send_backward(
        self, info: stage_pb2.CallInfo, grad: torch.Tensor, msg: wire_pb2.TensorMessage
    ) -> stage_pb2.BackwardReply:
        """Sends the input gradient, encoded as `msg`, to the previous stage."""
        prev = self.role.stage - 1
        stub = TensorStreams(self.channels.get(info.route[prev]))
        try:
            reply, sent = self._stream(stub.Backward, _for_stage(info, prev), msg, self.links.backward.zstd_level, prev)
        except grpc.RpcError as e:
            raise name_failure(e, prev, info.route_peers[prev], info.route[prev]) from e
        _count(reply.traffic, prev, sent, 4 * grad.numel())
        return reply

    def _stream(self, method, info, msg: wire_pb2.TensorMessage, zstd_level: int, dest: int):
        address = info.route[dest]
        shaper = self.shaping.for_destination(address)
        with self._policy_lock:
            policy = self._zstd.setdefault(address, ZstdPolicy(level=zstd_level))
        counted = _Counted(tensor_items(info, msg, zstd_level, shaper, policy))
        reply = method(iter(counted), timeout=info.deadline_s or 120.0)
        return reply, counted.nbytes

    def status(self) -> stage_pb2.StatusReply:
        return stage_pb2.StatusReply(
            peer_id=self.peer_id,
            stage=self.role.stage,
            layer_start=self.role.layer_start,
            layer_end=self.role.layer_end,
            plan_version=self.role.plan_version,
            steps_done=self.steps_done,
            compute_layers_per_s=self.compute_layers_per_s,
            buffered_samples=self.links.buffered_samples(),
            device=self.device,
        )

    def state_items(self):
        """The stage's parameters as named fp32 tensors, for handing the stage over to another peer."""
        codec = make_codec(CodecConfig("fp32"))
        from swarm.compression import frame

        for name, tensor in self.worker.state_dict().items():
            for chunk in frame(codec.encode(tensor.float()), zstd_level=0):
                yield stage_pb2.StateItem(name=name, chunk=chunk)


class CallRefused(Exception):
    """A call this stage refuses, with the gRPC status to answer."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details


class _Counted:
    """Counts the bytes of the serialized items a stream yields."""

    def __init__(self, items):
        self.items, self.nbytes = items, 0

    def __iter__(self):
        for item in self.items:
            self.nbytes += len(item)
            yield item


def _count(traffic: stage_pb2.Traffic, link: int, sent: int, fp32: int) -> None:
    traffic.wire_bytes += sent
    traffic.fp32_wire_bytes += fp32
    traffic.link_bytes[link] += sent


def _need_message(incoming: Incoming) -> wire_pb2.TensorMessage:
    if incoming.message is None:
        raise WireError("chunk", "the call carries no tensor")
    return incoming.message


def _for_stage(info: stage_pb2.CallInfo, stage: int) -> stage_pb2.CallInfo:
    out = stage_pb2.CallInfo()
    out.CopyFrom(info)
    out.stage = stage
    return out


class StageServicer(stage_pb2_grpc.StageServicer):
    """Thin gRPC handlers: read and check the call, run the host's compute, pass the result on."""

    def __init__(self, host: StageHost | None):
        self.host = host
        self.previous: StageHost | None = None
        """The host this peer served before its last plan change, kept to hand its state over."""
        self.standby_version: int | None = None
        """The plan that left this peer without a stage, if one did: calls meant for its old stage are
        refused as from another plan, so the trainer moves on to the new plan instead of failing."""
        self._admission = threading.Condition()

    def _not_serving(self) -> CallRefused:
        if self.standby_version is not None:
            return CallRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{PLAN_MISMATCH} this peer is on standby under plan {self.standby_version}",
            )
        return CallRefused(grpc.StatusCode.UNAVAILABLE, "this peer is not serving a stage yet")

    def _serving(self) -> StageHost:
        host = self.host
        if host is None:
            raise self._not_serving()
        return host

    def _limits(self) -> WireLimits:
        host = self.host
        return host.limits if host is not None else WireLimits()

    def _admit(self, info: stage_pb2.CallInfo) -> StageHost:
        """Checks a call against the current host and opens its step there, atomically with `swap`."""
        with self._admission:
            host = self.host
            if host is None:
                raise self._not_serving()
            host.check_call(info)
            host.open_step = info.step
            return host

    def when_idle(self, change, timeout_s: float) -> bool:
        """Runs `change(servicer)` between two steps, never while a step is open on this stage.

        Calls are admitted under the same lock, so no step can straddle the change: a call that arrives
        after it meets the new plan version and is refused, and the trainer retries the step on the new
        plan. Returns False if a step stayed open for `timeout_s` (a trainer gone mid-step); the change is
        then made anyway and that step is abandoned.
        """
        with self._admission:
            idle = self._admission.wait_for(lambda: self.host is None or self.host.open_step is None, timeout_s)
            if not idle:
                log.warning("stage %d: abandoning unfinished step %s", self.host.role.stage, self.host.open_step)
                self.host.step(stage_pb2.StepRequest(step=self.host.open_step or 0, abandon=True))
            change(self)
            self._admission.notify_all()
        return idle

    def swap(self, host: StageHost | None, timeout_s: float, plan_version: int = 0) -> bool:
        """Serves `host` (None: standby under `plan_version`) from the next step on, keeping the current
        one for state handover."""

        def change(servicer: StageServicer) -> None:
            if servicer.host is not None:
                servicer.host.channels.close()
                servicer.previous = servicer.host
            servicer.host = host
            servicer.standby_version = plan_version if host is None else None

        return self.when_idle(change, timeout_s)

    def _guard(self, context: grpc.ServicerContext, fn):
        """Runs `fn`, turning every failure into a gRPC error that names the problem; the peer keeps serving."""
        host = self.host
        if host is None:
            refused = self._not_serving()
            context.abort(refused.code, refused.details)
        try:
            return fn()
        except CallRefused as e:
            context.abort(e.code, e.details)
        except BufferMissError as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{BUFFER_MISS} {e}")
        except WireError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"invalid message: {e}")
        except GateError as e:
            context.abort(grpc.StatusCode.ABORTED, f"schedule: {e}")
        except StageCallError as e:
            context.abort(e.code, str(e))
        except ValueError as e:  # e.g. NaN in a tensor to encode
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"stage {host.role.stage}: {e}")
        except Exception as e:
            log.exception("stage %d: unexpected failure", host.role.stage)
            context.abort(grpc.StatusCode.INTERNAL, f"stage {host.role.stage} failed: {type(e).__name__}: {e}")

    def Forward(self, request_iterator, context):
        def run():
            incoming = read_stream(request_iterator, self._limits())
            host = self._admit(incoming.info)
            out, loss, ids, msg = host.forward(incoming)
            if out is None:
                return stage_pb2.ForwardReply(has_loss=True, loss=loss)
            # communication: the activation goes straight to the next stage
            return host.send_forward(incoming.info, out, ids, msg)

        return self._guard(context, run)

    def Backward(self, request_iterator, context):
        def run():
            incoming = read_stream(request_iterator, self._limits())
            host = self._admit(incoming.info)
            grad, msg = host.backward(incoming)
            if grad is None:
                return stage_pb2.BackwardReply()
            # communication: the input gradient goes straight back to the previous stage
            return host.send_backward(incoming.info, grad, msg)

        return self._guard(context, run)

    def PutLabels(self, request, context):
        def run():
            self._admit(request.info).put_labels(request.info, request.labels)
            return stage_pb2.Empty()

        return self._guard(context, run)

    def Grads(self, request, context):
        return self._guard(context, lambda: self._serving().grads())

    def Step(self, request, context):
        def run():
            lr = self._serving().step(request)
            with self._admission:
                self._admission.notify_all()  # a plan change may be waiting for the step to end
            return stage_pb2.StepReply(step=request.step, lr=lr)

        return self._guard(context, run)

    def Probe(self, request, context):  # answered before a stage is assigned too: links are measured early
        if request.reply_bytes > MAX_PROBE_BYTES:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"reply_bytes exceeds {MAX_PROBE_BYTES}")
        return stage_pb2.ProbeReply(payload=bytes(request.reply_bytes))

    def Sink(self, request_iterator, context):  # no stage needed: links are measured before assignment
        limits = self.host.limits if self.host is not None else WireLimits()
        try:
            incoming = read_stream(request_iterator, limits)
        except WireError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"invalid message: {e}")
        return stage_pb2.Traffic(wire_bytes=incoming.wire_bytes)

    def Status(self, request, context):
        return self._guard(context, lambda: self._serving().status())

    def GetState(self, request, context):
        hosts = [h for h in (self.host, self.previous) if h is not None]
        if not hosts:
            context.abort(grpc.StatusCode.UNAVAILABLE, "this peer is not serving a stage yet")
        wanted = [
            h for h in hosts if h.role.stage == request.stage and request.plan_version in (0, h.role.plan_version)
        ]
        if not wanted:
            held = ", ".join(f"stage {h.role.stage} of plan {h.role.plan_version}" for h in hosts)
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this peer holds {held}, not stage {request.stage} of plan {request.plan_version or 'now'}",
            )
        host = wanted[0]
        with host.compute_lock:
            items = list(host.state_items())
        yield from items
