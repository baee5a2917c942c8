"""The replicas' gradient sum of one stage: flatten, encode with error feedback, exchange, decode, sum.

After a step's last backward the trainer calls `Reduce` on every live replica of a stage. Each replica
flattens its accumulated gradients (every parameter but the tied embedding/head weight, which the trainer
sums through `Grads`), encodes them once with the stage's backward codec (gradq with error feedback in a swarm;
fp32 in exact tests) and streams that one message to every other member with `Average`, framed, chunked and
paced like any activation. It then waits for the other members' messages of the same step and sets its
gradients to the sum of the DECODED messages of all members in group order, its own decoded message
included: every replica adds the same tensors in the same order, so all hold bit-identical gradients and,
after the same optimizer step, identical weights.

The error-feedback residual is per stage. A Reduce computes the next one; it is committed only when `Step`
applies the step, and dropped when the step is abandoned, so a failed attempt leaves no trace.
"""

from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import replace
from typing import TYPE_CHECKING

import grpc
import torch

from swarm.compression import CodecConfig, WireLimits, codec_class, make_codec
from swarm.compression.state import LinkState
from swarm.net.stream import PLAN_MISMATCH, CallRefused, Incoming, name_failure, tensor_items
from swarm.proto import stage_pb2, wire_pb2

if TYPE_CHECKING:
    from swarm.runtime.host import StageHost

__all__ = ["MAX_GROUP", "GradientAverager", "flatten_grads", "parameters_digest", "unflatten_into"]

MAX_GROUP = 64
"""Most replicas of one stage in a Reduce group (the roster bounds it further where calls are authorized)."""


def parameters_digest(named: list[tuple[str, torch.Tensor]]) -> str:
    """SHA-256 (hex) over the bytes of each tensor, in the order given (name order)."""
    h = hashlib.sha256()
    for _, p in named:
        h.update(p.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def flatten_grads(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """The parameters' gradients as one fp32 vector (zeros for a parameter without one)."""
    parts = [torch.zeros(p.numel()) if p.grad is None else p.grad.detach().float().reshape(-1) for p in params]
    return torch.cat(parts) if parts else torch.zeros(0)


def unflatten_into(params: list[torch.nn.Parameter], flat: torch.Tensor) -> None:
    """Sets each parameter's gradient to its slice of `flat`."""
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset : offset + n].view(p.shape).to(p.dtype).clone()
        offset += n


class GradientAverager:
    """One stage's side of the replicas' gradient sums: the residual, and the open step's received messages.

    Args:
        host: the stage host whose gradients, step, lock, links and metrics it works with.
    """

    min_bits = 8
    """Fewest bits per weight-gradient element in a sum, whatever the backward codec's: what the planner's cost
    model assumes (`ModelSpec.gradient_bits`); with 4 the replicas' sum trained measurably worse (see
    docs/ARCHITECTURE.md). A class attribute, so a measurement can set it lower."""

    def __init__(self, host: StageHost):
        self.host = host
        module = host.worker.module
        tied = module.tied_parameter() if host.role.n_stages > 1 else None
        self.params = [p for _, p in sorted(module.named_parameters()) if p is not tied]
        self.numel = sum(p.numel() for p in self.params)
        self.limits = WireLimits(max_dims=1, max_numel=max(1, self.numel), max_message_bytes=4 * self.numel + (1 << 20))
        """What one replica's message may be: the stage's flat gradient, at most fp32."""
        self.residual: torch.Tensor | None = None
        """Error feedback carried into the next step's message (committed)."""
        self._pending: torch.Tensor | None = None
        self._inbox: dict[str, wire_pb2.TensorMessage] = {}
        """The open step's messages from the other members, by sender (peer id, or `#index` without auth)."""
        self._inbox_step: int | None = None
        self._reduced: int | None = None
        """The step whose gradients are the group's sum already (a second Reduce is refused)."""
        self._arrived = threading.Condition()

    # ---- the step's end ---------------------------------------------------------------------------------

    def commit(self) -> None:
        """The step was applied: its residual carries into the next step's message."""
        if self._pending is not None:
            self.residual, self._pending = self._pending, None

    def end_step(self) -> None:
        """The step ended (applied or abandoned): what it received and an uncommitted residual go."""
        with self._arrived:
            self._pending, self._inbox, self._inbox_step, self._reduced = None, {}, None, None
            self._arrived.notify_all()

    # ---- receiving: Average ------------------------------------------------------------------------------

    def _check_role(self, what: str, plan_version: int, stage: int) -> None:
        """Refuses `what` unless it is for this peer's plan and stage."""
        role = self.host.role
        if plan_version != role.plan_version:
            raise CallRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{PLAN_MISMATCH} the {what} follows plan {plan_version}, this peer plan {role.plan_version}",
            )
        if stage != role.stage:
            raise CallRefused(grpc.StatusCode.FAILED_PRECONDITION, f"this peer serves stage {role.stage}, not {stage}")

    def check_average(self, info: stage_pb2.CallInfo, sender: str) -> None:
        """Refuses, from its call info alone, an Average that is not for this stage's open step, or a second
        one from the same sender; changes nothing."""
        host = self.host
        self._check_role("gradients", info.plan_version, info.stage)
        if not 1 <= info.num_micro_batches <= MAX_GROUP or info.micro_batch >= info.num_micro_batches:
            raise CallRefused(
                grpc.StatusCode.INVALID_ARGUMENT, f"group index {info.micro_batch} of {info.num_micro_batches}"
            )
        if host.open_step is None or info.step != host.open_step:
            raise CallRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"gradients for step {info.step}, but the open step here is {host.open_step}",
            )
        with self._arrived:
            if self._reduced == info.step:
                raise CallRefused(grpc.StatusCode.FAILED_PRECONDITION, f"step {info.step} is reduced already")
            if self._inbox_step == info.step and sender in self._inbox:
                raise CallRefused(grpc.StatusCode.ALREADY_EXISTS, f"{sender} sent its gradients for step {info.step}")

    def receive(self, call: Incoming, sender: str) -> None:
        """Holds a checked message for the open step's Reduce: one per sender, the stage's size at most."""
        msg = call.message
        if msg is None or list(msg.shape) != [self.numel]:
            shape = None if msg is None else list(msg.shape)
            raise CallRefused(grpc.StatusCode.INVALID_ARGUMENT, f"shape: {shape}, this stage sums [{self.numel}]")
        with self._arrived:
            self.check_average(call.info, sender)  # again, atomically: the step may have ended meanwhile
            if self._inbox_step != call.info.step:
                self._inbox, self._inbox_step = {}, call.info.step
            if len(self._inbox) >= MAX_GROUP:
                raise CallRefused(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many replicas' gradients held")
            self._inbox[sender] = msg
            self._arrived.notify_all()

    # ---- Reduce ------------------------------------------------------------------------------------------

    def reduce(self, request: stage_pb2.ReduceRequest, keyed_by_peer: bool) -> stage_pb2.ReduceReply:
        """Sums the step's gradients with the group's (see the module docstring); returns what was sent.

        Args:
            request: the step and the group (checked against the plan by the caller where calls are authorized).
            keyed_by_peer: received messages are keyed by their sender's authenticated peer id (else by index).
        """
        host = self.host
        peers, addresses = list(request.group_peers), list(request.group_addresses)
        me = self._check_reduce(request, peers, addresses)
        if len(peers) == 1:
            with self._arrived:
                self._reduced = request.step
            return stage_pb2.ReduceReply(group_size=1)
        config = self._config(request.step, me)
        codec = make_codec(config)
        with host.compute_lock:
            flat = flatten_grads(self.params)
            state = LinkState(config)
            state.residual = self.residual
            msg = codec.encode(flat, state=state)
        pending = state.residual if config.error_feedback else None
        info = stage_pb2.CallInfo(
            step=request.step,
            stage=request.stage,
            plan_version=request.plan_version,
            micro_batch=me,
            num_micro_batches=len(peers),
            route=addresses,
            route_peers=peers,
        )
        deadline_s = min(request.deadline_s or host.budget.max_wait_s, host.budget.max_wait_s)
        sent = self._send_all(info, msg, config, peers, addresses, me, deadline_s)
        keys = [(p if keyed_by_peer else f"#{i}") for i, p in enumerate(peers)]
        received = self._wait(request.step, keys, peers, me, deadline_s)
        # every member adds the same decoded messages in the same (group) order: bit-identical sums
        total = torch.zeros(self.numel)
        for i in range(len(peers)):
            total += codec.decode(msg if i == me else received[keys[i]], limits=self.limits).float()
        with host.compute_lock, self._arrived:
            if host.open_step != request.step or self._reduced is not None:
                raise CallRefused(grpc.StatusCode.ABORTED, f"step {request.step} ended while it was being reduced")
            unflatten_into(self.params, total)
            self._pending, self._reduced = pending, request.step
        fp32 = 4 * self.numel * (len(peers) - 1)
        host.metrics.fp32_bytes.labels("average", "average").inc(fp32)
        return stage_pb2.ReduceReply(wire_bytes=sent, fp32_wire_bytes=fp32, group_size=len(peers))

    def _check_reduce(self, request: stage_pb2.ReduceRequest, peers: list[str], addresses: list[str]) -> int:
        """This peer's index in the group, once the request is known to be for its open, finished step."""
        host = self.host
        self._check_role("Reduce", request.plan_version, request.stage)
        if not 1 <= len(peers) <= MAX_GROUP or len(addresses) != len(peers) or host.peer_id not in peers:
            raise CallRefused(
                grpc.StatusCode.INVALID_ARGUMENT, f"group: {peers[:8]} must name this peer, 1..{MAX_GROUP}"
            )
        with host.compute_lock:
            if host.open_step != request.step or not host.gate.step_done:
                raise CallRefused(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"Reduce of step {request.step} before its every backward ran here (open step: {host.open_step})",
                )
            if self._reduced == request.step:
                raise CallRefused(grpc.StatusCode.FAILED_PRECONDITION, f"step {request.step} is already reduced")
        return peers.index(host.peer_id)

    def _config(self, step: int, index: int) -> CodecConfig:
        """The backward codec, with error feedback where it has it (fp32 for a codec that needs sample buffers),
        its rounding draws seeded by step and member so no two messages share them."""
        cfg = self.host.links.bw_recv.config
        cls = codec_class(cfg.name)
        if cls.uses_buffers:
            return CodecConfig("fp32", zstd_level=cfg.zstd_level)
        seed = (cfg.seed * 1_000_003 + step * 257 + index) % (1 << 31)
        bits = max(cfg.bits, self.min_bits) if cls.quantized else cfg.bits
        return replace(cfg, bits=bits, error_feedback=cls.error_feedback, seed=seed)

    def _send_all(self, info, msg, config: CodecConfig, peers, addresses, me: int, deadline_s: float) -> int:
        """Streams `msg` to every other member at once, each through the shaper towards it; the bytes sent."""
        host = self.host
        errors: list[Exception] = []
        counts = [0] * len(peers)

        def send(i: int) -> None:
            shaper = host.links.shaping.for_destination(addresses[i])
            items = tensor_items(info, msg, config.zstd_level, shaper)

            def counted():
                for item in items:
                    counts[i] += len(item)
                    yield item

            try:
                # communication: this replica's gradients to replica i of the stage
                host.connector.stage(addresses[i], peers[i]).Average(counted(), timeout=deadline_s)
            except grpc.RpcError as e:
                errors.append(name_failure(e, info.stage, peers[i], addresses[i]))
            except Exception as e:  # noqa: BLE001 - reported to the caller, naming the peer
                errors.append(RuntimeError(f"replica {peers[i]} at {addresses[i]}: {e}"))

        threads = [threading.Thread(target=send, args=(i,), daemon=True) for i in range(len(peers)) if i != me]
        for t in threads:
            t.start()
        end = time.monotonic() + deadline_s
        for t in threads:  # all sends share the one deadline, not one each
            t.join(max(0.0, end - time.monotonic()))
        sent = sum(counts)
        host.metrics.wire_bytes.labels("average", "average").inc(sent)
        if errors:
            raise errors[0]
        if any(t.is_alive() for t in threads):
            late = [peers[i] for i in range(len(peers)) if i != me and counts[i] == 0]
            raise CallRefused(grpc.StatusCode.DEADLINE_EXCEEDED, f"sending gradients to {late} took over {deadline_s}s")
        return sent

    def _wait(self, step: int, keys: list[str], peers: list[str], me: int, deadline_s: float):
        """The other members' messages of `step`, once all are in; DEADLINE_EXCEEDED naming those missing."""
        end = time.monotonic() + deadline_s
        with self._arrived:
            while True:
                have = self._inbox if self._inbox_step == step else {}
                missing = [peers[i] for i, k in enumerate(keys) if i != me and k not in have]
                if not missing:
                    return dict(have)
                left = end - time.monotonic()
                if left <= 0 or self.host.open_step != step:
                    raise CallRefused(
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"stage {self.host.role.stage}: replica(s) {', '.join(missing)} sent no gradients for step "
                        f"{step} within {deadline_s:.1f}s; nothing was summed",
                    )
                self._arrived.wait(left)
