"""The replicas' gradient sum of one stage: flatten, encode with error feedback, exchange, decode, sum.

After a step's last backward the trainer calls `Reduce` on every live replica of a stage. Each replica
flattens its accumulated gradients (every parameter but the tied embedding/head weight, which the trainer
sums through `Grads`), encodes them once with the stage's backward codec (gradq with error feedback in a swarm;
fp32 in exact tests) and streams that one message to every other member with `Average`, framed, chunked and
paced like any activation. It then waits for the other members' messages of the same step and sets its
gradients to the sum of the DECODED messages of all members in group order, its own decoded message
included: every replica adds the same tensors in the same order, so all hold bit-identical gradients and,
after the same optimizer step, identical weights.

Frozen parameters (no `requires_grad`, `swarm.runtime.freeze`) leave the summed vector: it is the trained
parameters' gradients only, so a frozen prefix costs no averaging bytes. The layout changes only when a Step
freezes more layers, and every replica applies that same Step before its next step opens, so the members of
a sum agree on its size; a member whose frozen prefix differs sends a message of another size, which is refused
by name (INVALID_ARGUMENT) before anything is summed. The residual keeps the trained parameters' slices.

The error-feedback residual is per stage, kept in gradient units (sent in the step's AdamW units where the sum is
preconditioned: a residual left in one step's units and reused in the next's grew with the second moment, the decoded
sum's norm 1.2x, 3.8x, 17x, 32x the exact one over four unclipped steps). A Reduce computes the next one; it is
committed only when `Step` applies the step, and dropped when the step is abandoned, so a failed attempt leaves
no trace.

The tied embedding / LM head weight (pipelines of 2+ stages) is summed the same way by the *tied group*: every
distinct replica of the first and the last stage. Their Reduce (which the trainer sends every end-stage replica,
alone in its stage group or not) also encodes the stage's tied gradient once, with its own error-feedback
residual, streams it to every other member (`Average` with `CallInfo.tied`, authorized only from the plan's
end-stage replicas) and sets the tied gradient to the decoded messages' sum in group order (stage 0's
replicas, then the last stage's), so every copy of the weight gets the same bits without a trainer hop.
"""

from __future__ import annotations

import hashlib
import math
import threading
import time
from concurrent.futures import wait
from dataclasses import replace
from typing import TYPE_CHECKING

import grpc
import torch

from swarm.compression import CodecConfig, WireError, WireLimits, codec_class, decoder_for, make_codec
from swarm.compression.codec_mlowrank import layout_of
from swarm.compression.state import LinkState
from swarm.net.stream import PLAN_MISMATCH, CallRefused, name_failure, tensor_items
from swarm.runtime.callinfo import info_to_wire
from swarm.runtime.messages import CallInfo, ReduceOrder, ReduceReport, StageCall
from swarm.runtime.routing import spawn
from swarm.runtime.suspects import proportion_tag

if TYPE_CHECKING:
    from swarm.runtime.host import StageHost

__all__ = [
    "EARLY_REDUCE",
    "MAX_GROUP",
    "QUANTIZED_SUM_CODEC",
    "SUM_CODEC",
    "TIED_CODEC",
    "GradientAverager",
    "flatten_grads",
    "group_config",
    "parameters_digest",
    "sampled_digest",
    "unflatten_into",
]

MAX_GROUP = 64
"""Most replicas of one stage in a Reduce group (the roster bounds it further where calls are authorized)."""
SUM_CODEC = "mlowrank16+ef+f4"
"""The replicas' sum over compressed links unless a plan names another (`GradientAverager.sum_codec`), and the
floor of the planner's ladder for it (`swarm.scheduler.bits.AVERAGE_LADDER`): each weight matrix of the stage as
rank-16 PowerSGD factors in 4-bit codes, every other parameter whole in 4-bit codes, each column with its fp32 step,
error feedback over the whole sum (`swarm.compression.codec_mlowrank`), coded in AdamW's units
(`GradientAverager.precondition_ranked`). With 2 replicas (docs/reports/replicas.md, s58): over 8 epochs, seeds 0-4,
+0.41 / +0.54 / -0.50 / +0.74 / -0.38% held-out vs fp32 (mean +0.16%) at 34.1x fewer total bytes after epoch 1; in a
single pass of 6,144 samples +1.46 / +1.42% (seeds 0 / 1) at 31.4x, where an fp32 sum ends +0.26%. s57's sum, rank 12
in 4 bits as they are, was +0.27% on the 8-epoch mean at 39.0x but +3.00 / +2.76% in the single pass; in AdamW's
units rank 12 ended +1.03% on 8-epoch seed 0, past the issue's 1%, and rank 24 +0.88 / +1.13% in the single pass at
26.2x, its sums 1.5x the boundaries' bytes in the churn experiment."""
QUANTIZED_SUM_CODEC = "gradq2+ef+rot+nr+cs+g1024"
"""The replicas' sum before s55, off the planner's ladder since (a plan may name it): 2 bits with error feedback,
Hadamard rotation, round to nearest, 16-bit scales, groups of 1024, quantized in AdamW's units
(`precondition_max_bits`). Fewer bytes than `SUM_CODEC` where the matrices are narrow (hidden 32: `codec_mlowrank`)."""


TIED_CODEC = "lowrank16+ef+f8"
"""The tied embedding's sum over compressed links unless a plan names another (`GradientAverager.tied_codec`), and
the floor of the planner's ladder for it (`swarm.scheduler.bits.TIED_LADDER`): the tied weight's gradient as rank-16
PowerSGD factors in int8 with error feedback, one power iteration a step from the last step's Q
(`swarm.compression.codec_lowrank`). In the convergence experiment with the default codecs (docs/reports/single-pass.md,
s50): the single pass's tied sum 3.2 MB at +0.79% held-out where the 4-bit sum sent 8.1 MB at +0.96%, over 8 epochs
1.6 MB at +0.14% where it sent 4.0 MB at +0.17%; rank 8 sent half that but missed 1% in the single pass (+1.11%, with
1-bit deltas, s49)."""


def parameters_digest(named: list[tuple[str, torch.Tensor]]) -> str:
    """SHA-256 (hex) over the bytes of each tensor, in the order given (name order)."""
    h = hashlib.sha256()
    for _, p in named:
        h.update(p.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def sampled_digest(named: list[tuple[str, torch.Tensor]], stride: int, seed: int) -> str:
    """SHA-256 (hex) of every `stride`-th element of each tensor from an offset drawn from `seed` (a stride of
    0 or 1: `parameters_digest`). Replicas hold the same bits, so they agree on it; a stage that does not know the
    seed in advance cannot keep just the sampled elements right, and an optimizer step moves nearly every element,
    so a stale replica differs. Costs about 1/stride of the full digest."""
    if stride <= 1:
        return parameters_digest(named)
    h = hashlib.sha256()
    h.update(stride.to_bytes(4, "little") + seed.to_bytes(8, "little"))
    for i, (_, p) in enumerate(named):
        flat = p.detach().reshape(-1)
        offset = (seed + 7919 * i) % min(stride, max(1, flat.numel()))
        part = flat[offset::stride]
        part = torch.empty(part.shape, dtype=part.dtype).copy_(part)  # one dense copy (a 1-element slice keeps
        h.update(part.view(torch.uint8).numpy().tobytes())  # its stride under .contiguous(): no byte view)
    return h.hexdigest()


def flatten_grads(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """The parameters' gradients as one fp32 vector (zeros for a parameter without one); the averager passes
    only the trained ones (`GradientAverager.trained`)."""
    parts = [torch.zeros(p.numel()) if p.grad is None else p.grad.detach().float().reshape(-1).cpu() for p in params]
    return torch.cat(parts) if parts else torch.zeros(0)


def unflatten_into(params: list[torch.nn.Parameter], flat: torch.Tensor) -> None:
    """Sets each parameter's gradient to its slice of `flat`. The averager passes only the trained ones, so a
    frozen parameter gets no gradient and the optimizer leaves it where it is (a zero gradient would still move
    it through momentum and decay)."""
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset : offset + n].view(p.shape).to(p.device, p.dtype, copy=True)
        offset += n


def group_config(
    planned: CodecConfig | None, backward: CodecConfig, tied: bool = False, floors=None, tied_cols: int | None = None
) -> CodecConfig:
    """The codec a group sums with, before `GradientAverager._config` seeds each message: the plan's epilogue codec
    `planned`, else the links' `backward` codec (a 1-bit codec's sums are gradq's), with error feedback where it has
    it (fp32 for a codec that needs sample buffers), never below the group's floor of bits (`floors`' `min_bits` and
    `tied_min_bits`: an averager, whose own may be set, or the class's); without a plan, behind a quantized backward
    codec, the stage group sums with `floors.sum_codec` as it is and the tied group with `floors.tied_codec` as a
    plan's would be taken; a low-rank tied codec without a group size factors the tied weight in rows of `tied_cols`
    (its hidden size). What the cost model prices the sums and the tied sync at too (`swarm.scheduler.sizes`)."""
    floors = GradientAverager if floors is None else floors
    cfg = codec_class(backward.name).sum_config(backward)
    if tied and planned is None and floors.tied_codec is not None:
        links = codec_class(cfg.name)
        if links.quantized and not links.uses_buffers:  # compressed links; fp32 and bf16 ones sum as they are
            planned = CodecConfig.parse(floors.tied_codec, zstd_level=backward.zstd_level)
    if planned is not None:
        cfg = codec_class(planned.name).sum_config(planned)
    kind = codec_class(cfg.name)
    if kind.uses_buffers:
        return CodecConfig("fp32", zstd_level=cfg.zstd_level)
    # a plan's stage codec is taken as it is: the planner's ladder (`AVERAGE_LADDER`) is its floor
    floor = floors.tied_min_bits if tied else 0 if planned is not None else floors.min_bits
    if not tied and planned is None and kind.quantized and floors.sum_codec is not None:
        cfg = CodecConfig.parse(floors.sum_codec, zstd_level=cfg.zstd_level, seed=cfg.seed)  # compressed links
        kind, floor = codec_class(cfg.name), 0  # the measured sum codec, as it is
    bits = max(cfg.bits, floor) if kind.quantized and not kind.sparse else cfg.bits  # topk: its own bits
    if tied and tied_cols and kind.ranked and cfg.group_size is None:  # the tied weight as it is shaped
        cfg = replace(cfg, group_size=tied_cols)
    return replace(cfg, bits=bits, error_feedback=kind.error_feedback)


def _most(tied: bool) -> int:
    """Most members of a group: a stage's replicas, or (tied) those of the first and the last stage."""
    return 2 * MAX_GROUP if tied else MAX_GROUP


OWN_NORMS = 16
"""Steps of a member's own message norms its out-of-proportion rule takes the largest of."""


class _Group:
    """One kind of sum a host takes part in (its stage's replicas, or the tied group): the committed residual,
    the open step's pending one, the messages received for the open step and the step already summed."""

    def __init__(self, numel: int):
        self.numel = numel
        self.residual: torch.Tensor | None = None
        self.pending: torch.Tensor | None = None
        self.inbox: dict[str, object] = {}
        """sender -> its tensor message for the open step (the codec's wire format, decoded at the Reduce)"""
        self.inbox_step: int | None = None
        self.reduced: int | None = None
        self.warm: torch.Tensor | tuple | None = None
        """a lowrank encoder's warm start (mlowrank's: one a parameter): any value is valid"""
        self.pending_warm: torch.Tensor | tuple | None = None
        """the open step's warm start: kept at commit, so a retry starts alike"""
        self.own_norms: dict[int, float] = {}
        """step -> the norm of this member's own message for it, for the last `OWN_NORMS` steps it summed (a rerun of
        a step replaces its entry): the reference of the out-of-proportion rule (`GradientAverager.reference_norm`)"""

    def drop(self) -> None:
        self.pending, self.inbox, self.inbox_step, self.reduced = None, {}, None, None
        self.pending_warm = None


BUSY_RETRY_S = 0.005
"""First pause before an Average refused for want of a data slot is sent again (doubling to 0.1 s, within the
Reduce's deadline)."""
EARLY_REDUCE = "before its every backward ran"
"""What a stage's refusal of a Reduce says when the step's work is not done there (a trainer that sends its Reduce
with the pipeline asks such a stage again after it: `PipelineDriver.reduce_with_pipeline`)."""


class GradientAverager:
    """One stage's side of the replicas' gradient sums: the residual, and the open step's received messages.

    Args:
        host: the stage host whose gradients, step, lock, links and metrics it works with.
    """

    min_bits = 8
    """Fewest bits per weight-gradient element in a sum of the backward codec's sum config (`sum_codec` None): with
    4 bits, stochastic rounding and no rotation or preconditioning, the replicas' sum trained measurably worse
    (docs/reports/replicas.md). A class attribute, so a measurement can set it lower."""
    sum_codec: str | None = SUM_CODEC
    """The stage group's codec when the backward codec is compressed and the plan names none, a codec label taken as
    it is (no `min_bits` floor); None: the backward codec's sum config at `min_bits`. Measured in the 8-epoch
    convergence run with 2 replicas (one seed each): `SUM_CODEC` ended +0.05% held-out vs fp32 preconditioned,
    +0.31% not, at 18.0x fewer total bytes after epoch 1; the sparsified `codec_topk.SPARSE_SUM_CODEC` +31.8%
    (docs/REPLICAS.md). A class attribute (scripts/measure_sum_codecs.py sets it)."""
    precondition_max_bits = 2
    """The stage group's lossy sums of at most this many wire bits an element are quantized in AdamW's units
    (`_preconditioner`; 0: none, 32: every quantized one). With the dense 2-bit sum: +0.05% held-out against +0.31%
    without (one seed each, docs/REPLICAS.md); 8-bit sums were never measured with it, so they stay as they were. A
    class attribute."""
    precondition_ranked = True
    """Whether the stage group's factored sums (`mlowrank`, `lowrank`) are coded in AdamW's units too (the same
    `_preconditioner`, the residual kept in gradient units), on since s58: in a single pass of 6,144 samples with 2
    replicas rank 12 in 4 bits ended +1.27% / +1.68% held-out vs fp32 (seeds 0 / 1) with it, +3.00% / +2.76%
    without; over 1,536 steps of 24,576 samples the default boundaries with rank 16 in 4 bits ended +5.31% with
    it, and with rank 12 without it +8.54%, where an fp32 sum ends +3.26% (docs/REPLICAS.md). Every replica
    holds the same optimizer state, so the same scale. A class attribute (scripts/measure_sum_codecs.py sets it as
    its label says: `pre:` or not)."""
    max_norm_ratio = 64.0
    """A member's decoded message may be at most this many times this member's reference norm (`reference_norm`:
    the largest of its own messages' norms over its last `OWN_NORMS` sums): a larger one (a liar's huge residual,
    a corrupted sender) is refused by name before anything is summed. Honest replicas' messages differ by their
    share of the batch and their residuals' ages; once a model has memorized its data they differ by 100x from
    one step to the next (a micro-batch the model already fits has a near-zero gradient), which is why the
    reference is this member's recent largest and not its message of the step."""
    tied_min_bits = 4
    """The same floor for the tied embedding's gradient, whose error feedback carries across steps: in the
    convergence run (acsgd2+ch forward, gradq2+ef+rot+nr+cs backward) 4 bits gave +0.76% held-out vs fp32 at
    20 KB per step, 8 bits no better (+1.38% with groups of 256, 43 KB), 2 bits +2.66%. It floors a quantized
    tied codec: the backward codec's sum config where `tied_codec` is None, or a plan's."""
    tied_codec: str | None = TIED_CODEC
    """The tied group's codec when the backward codec is compressed and the plan names none, a codec label taken as
    a plan's would be; None: the backward codec's sum config at `tied_min_bits` (what `@tN` in the convergence
    experiment sets). A class attribute."""

    def __init__(self, host: StageHost):
        self.host = host
        module = host.worker.module
        tied = module.tied_parameter() if host.role.n_stages > 1 else None
        self.params = [p for _, p in sorted(module.named_parameters()) if p is not tied]
        """Every parameter the stage group sums, frozen or not (`trained` is what a sum carries)."""
        self._layout = self._layout_now()
        numel = self._numel_of(self._layout)
        self.tied_numel = 0 if tied is None else tied.numel()
        """Elements of the tied weight this stage sums with the tied group (0: not an end stage of 2+)."""
        self.groups = {False: _Group(numel), True: _Group(self.tied_numel)}
        """The stage group's state (False) and the tied group's (True): keyed by `CallInfo.tied`."""
        most = max(1, sum(p.numel() for p in self.params), self.tied_numel)
        self.limits = WireLimits(max_dims=1, max_numel=most, max_message_bytes=4 * most + (1 << 20))
        """What one member's message may be: the larger of the stage's flat gradient and the tied weight's, at
        most fp32 (`receive` then holds each message to its own group's exact size)."""
        self._arrived = threading.Condition()
        self.codecs: dict[bool, CodecConfig | None] = {False: None, True: None}
        """The plan's epilogue codecs (`swarm.peers.plan.PlanDocument.epilogue_configs`) for the stage group (False) and
        the tied group (True); None: the stage's backward codec, as without a plan."""

    def set_codecs(self, average: CodecConfig | None, tied: CodecConfig | None) -> None:
        """Sums with these codecs from the next step on (between steps: a plan switch). A group whose codec
        changes drops its committed residual: it was the old codec's error, and a codec without error feedback
        would carry it stale into a later switch back."""
        with self._arrived:
            for key, config in ((False, average), (True, tied)):
                if config != self.codecs[key]:
                    self.codecs[key], self.groups[key].residual = config, None
                    self.groups[key].own_norms.clear()  # norms in another codec's units (preconditioned or not)

    numel = property(lambda self: self.groups[False].numel, doc="Elements of the stage sum: trained parameters'.")
    residual = property(lambda self: self.groups[False].residual, doc="Stage error feedback (committed).")

    def _layout_now(self) -> tuple[bool, ...]:
        """Which parameters are trained now (frozen ones are not)."""
        return tuple(p.requires_grad for p in self.params)

    def _numel_of(self, layout: tuple[bool, ...]) -> int:
        return sum(p.numel() for p, on in zip(self.params, layout, strict=True) if on)

    @property
    def trained(self) -> list[torch.nn.Parameter]:
        """The parameters the stage sum carries: those still trained (frozen ones leave it)."""
        return [p for p in self.params if p.requires_grad]

    def relayout(self) -> None:
        """Follows a grown frozen prefix (call between steps; `apply_frozen` does, `receive` and `_sum` check):
        the sum's size becomes the trained parameters', and the committed residual keeps their slices."""
        with self._arrived:
            layout = self._layout_now()
            if layout == self._layout:
                return
            group, old = self.groups[False], self._layout
            if group.residual is not None:
                parts, offset = [], 0
                for p, was, now in zip(self.params, old, layout, strict=True):
                    n = p.numel() if was else 0
                    if now:
                        parts.append(group.residual[offset : offset + n] if was else torch.zeros(p.numel()))
                    offset += n
                group.residual = torch.cat(parts) if parts else torch.zeros(0)
            self._layout = layout
            group.numel = self._numel_of(layout)
            group.drop()

    tied_residual = property(lambda self: self.groups[True].residual, doc="Tied error feedback (committed).")

    def tied_done(self, step: int) -> bool:
        """Whether this stage's tied gradient is the tied group's sum for `step` (always, off the end stages and
        once the tied pair is frozen)."""
        return not self.tied_trained or self.groups[True].reduced == step

    @property
    def tied_trained(self) -> bool:
        """Whether this stage holds a tied weight that still trains (a frozen prefix freezes the tied pair,
        `swarm.runtime.freeze.set_frozen`: both end stages at the same step, so neither sums it any more)."""
        param = self.host.worker.module.tied_parameter() if self.tied_numel else None
        return param is not None and param.requires_grad

    # ---- the step's end ---------------------------------------------------------------------------------

    def commit(self) -> None:
        """The step was applied: its residuals carry into the next step's messages."""
        for group in self.groups.values():
            if group.pending is not None:
                group.residual, group.pending = group.pending, None
            if group.pending_warm is not None:
                group.warm, group.pending_warm = group.pending_warm, None

    def end_step(self) -> None:
        """The step ended (applied or abandoned): what it received and an uncommitted residual go."""
        with self._arrived:
            for group in self.groups.values():
                group.drop()
            self._arrived.notify_all()

    # ---- receiving: Average ------------------------------------------------------------------------------

    def _check_role(self, what: str, plan_version: int, stage: int, tied: bool = False) -> None:
        """Refuses `what` unless it is for this peer's plan and stage (for the tied group: from an end stage, to
        an end stage that holds the tied weight)."""
        role = self.host.role
        if plan_version != role.plan_version:
            raise CallRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{PLAN_MISMATCH} the {what} follows plan {plan_version}, this peer plan {role.plan_version}",
            )
        if tied:
            if not self.tied_trained or stage not in (0, role.n_stages - 1):
                raise CallRefused(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"the tied group joins the first and last stage; this is stage {role.stage}, the sender's {stage}",
                )
        elif stage != role.stage:
            raise CallRefused(grpc.StatusCode.FAILED_PRECONDITION, f"this peer serves stage {role.stage}, not {stage}")

    def check_average(self, info: CallInfo, sender: str) -> None:
        """Refuses, from its call info alone, an Average that is not for this stage's open step, or a second
        one from the same sender for the same group; changes nothing."""
        host = self.host
        self._check_role("tied gradient" if info.tied else "gradients", info.plan_version, info.stage, info.tied)
        most = _most(info.tied)
        if not 1 <= info.num_micro_batches <= most or info.micro_batch >= info.num_micro_batches:
            raise CallRefused(
                grpc.StatusCode.INVALID_ARGUMENT, f"group index {info.micro_batch} of {info.num_micro_batches}"
            )
        if host.open_step is None or info.step != host.open_step:
            raise CallRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"gradients for step {info.step}, but the open step here is {host.open_step}",
            )
        host.ledger.check_attempt(info.step, info.attempt_id)  # a late Average of an abandoned attempt of the step
        group = self.groups[info.tied]
        with self._arrived:
            if group.reduced == info.step:
                raise CallRefused(grpc.StatusCode.FAILED_PRECONDITION, f"step {info.step} is reduced already")
            if group.inbox_step == info.step and sender in group.inbox:
                raise CallRefused(grpc.StatusCode.ALREADY_EXISTS, f"{sender} sent its gradients for step {info.step}")

    def receive(self, call: StageCall, sender: str) -> None:
        """Holds a checked message for the open step's Reduce: one per sender and group, the group's size."""
        msg, group = call.message, self.groups[call.info.tied]
        self.relayout()
        if msg is None or list(msg.shape) != [group.numel]:
            shape = None if msg is None else list(msg.shape)
            frozen = self.host.worker.frozen_layers
            what = "the tied weight has" if call.info.tied else f"this stage ({frozen} layers frozen) sums"
            raise CallRefused(grpc.StatusCode.INVALID_ARGUMENT, f"shape: {shape}, {what} [{group.numel}]")
        with self._arrived:
            self.check_average(call.info, sender)  # again, atomically: the step may have ended meanwhile
            if group.inbox_step != call.info.step:
                group.inbox, group.inbox_step = {}, call.info.step
            if len(group.inbox) >= _most(call.info.tied):
                raise CallRefused(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many replicas' gradients held")
            group.inbox[sender] = msg
            self._arrived.notify_all()

    # ---- Reduce ------------------------------------------------------------------------------------------

    def reduce(self, request: ReduceOrder, keyed_by_peer: bool) -> ReduceReport:
        """Sums the step's gradients with the stage group's, then the tied gradient with the tied group's (see
        the module docstring); returns what was sent.

        Args:
            request: the step and the groups (checked against the plan by the caller where calls are authorized).
            keyed_by_peer: received messages are keyed by their sender's authenticated peer id (else by index).
        """
        host = self.host
        peers, addresses = list(request.group_peers), list(request.group_addresses)
        tied_peers, tied_addresses = list(request.tied_peers), list(request.tied_addresses)
        me = self._check_reduce(request, peers, addresses)
        tied_me = self._check_tied(tied_peers, tied_addresses)
        end = time.monotonic() + min(request.deadline_s or host.budget.max_wait_s, host.budget.max_wait_s)
        sent = fp32 = tied_sent = tied_fp32 = 0
        if len(peers) == 1:
            with host.compute_lock, self._arrived:
                self._check_still_open(request, self.groups[False])
                self.groups[False].reduced = request.step
        else:
            sent, fp32 = self._sum(request, False, peers, addresses, me, end, keyed_by_peer)
        if tied_me is not None and self.tied_trained:  # a frozen tied pair: nothing to sum (the other end's too)
            tied_sent, tied_fp32 = self._sum(request, True, tied_peers, tied_addresses, tied_me, end, keyed_by_peer)
        return ReduceReport(sent, fp32, len(peers), tied_sent, tied_fp32)

    def _sum(self, request, tied: bool, peers, addresses, me: int, end: float, keyed_by_peer: bool):
        """One group's exchange: encode this member's gradient, send it to the others, wait for theirs, set the
        gradient to the decoded sum in group order. (bytes sent, their fp32 cost)."""
        host, group = self.host, self.groups[tied]
        config = self._config(request.step, me, tied)
        codec = make_codec(config)
        with host.compute_lock:
            self.relayout()
            own = host.worker.tied_grad().reshape(-1).float().cpu() if tied else flatten_grads(self.trained)
            scale = self._preconditioner() if self._preconditioned(config, tied) else None
            if scale is not None:  # quantized where AdamW moves the weights: every element at the same scale
                own = own * scale
            state = LinkState(config)
            state.residual, state.warm = group.residual, group.warm
            if scale is not None and group.residual is not None:  # kept in gradient units, sent in this step's
                state.residual = group.residual * scale  # AdamW units (not those of the step that left it)
            msg = codec.encode(own, state=state)
            group.pending_warm = state.warm
        pending = state.residual if config.error_feedback else None
        if pending is not None and scale is not None:
            pending = pending / scale
        info = CallInfo(
            step=request.step,
            stage=host.role.stage if tied else request.stage,
            plan_version=request.plan_version,
            micro_batch=me,
            num_micro_batches=len(peers),
            route=tuple(addresses),
            route_peers=tuple(peers),
            tied=tied,
            attempt_id=request.attempt_id,
        )
        sent, unsent = self._send_all(info, msg, config, peers, addresses, me, end)
        keys = [(p if keyed_by_peer else f"#{i}") for i, p in enumerate(peers)]
        received = self._wait(request.step, tied, keys, peers, me, end, unsent, request.attempt_id)
        parts = self._decode_all(request.step, tied, msg, received, keys, peers, me, config)
        # every member adds the same decoded messages in the same (group) order: bit-identical sums
        total = torch.zeros(group.numel)
        for part in parts:
            total += part
        if scale is not None:  # the same scale on every replica (their optimizer states are equal): the same bits
            total = total / scale
        with host.compute_lock, self._arrived:
            # the attempt's step may have ended and a rerun opened it again meanwhile: its open step is the same
            # number, but committing this sum there would refuse the rerun's own ("reduced already")
            self._check_still_open(request, group)
            if tied:
                host.worker.set_tied_grad(total.view(host.worker.module.tied_parameter().shape))
            elif self._layout != self._layout_now():
                raise CallRefused(grpc.StatusCode.ABORTED, f"step {request.step}: the frozen prefix changed meanwhile")
            else:
                unflatten_into(self.trained, total)
            group.pending, group.reduced = pending, request.step
        fp32 = 4 * group.numel * (len(peers) - 1)
        link = "tied" if tied else "average"
        host.metrics.fp32_bytes.labels(link, link).inc(fp32)
        return sent, fp32

    def _preconditioned(self, config: CodecConfig, tied: bool) -> bool:
        """Whether the group's sum under `config` is coded in AdamW's units: a lossy stage sum of at most
        `precondition_max_bits`, or a factored one where `precondition_ranked` (the tied group's two ends have
        optimizer states of their own: never)."""
        if tied:
            return False
        kind = codec_class(config.name)
        return (kind.quantized and config.wire_bits <= self.precondition_max_bits) or (
            kind.ranked and self.precondition_ranked
        )

    def _preconditioner(self) -> torch.Tensor | None:
        """Per trained element, 1 / (sqrt(AdamW's bias-corrected second moment) + a floor): the sum is quantized
        after multiplying by it and divided by it after decoding, so its error is even in the units AdamW steps in
        (a plain group quantizer zeroes a group's small elements, which AdamW then moves as far as its large ones:
        why dense 4-bit sums trained worse). Every replica holds the same optimizer state, so the same scale.
        None (no scaling) before the first step or where the optimizer is not Adam's."""
        optimizer = self.host.worker.optimizer
        beta2 = optimizer.param_groups[0].get("betas", (0.0, 0.0))[1]
        parts = []
        for p in self.trained:
            state = optimizer.state.get(p, {})
            if "exp_avg_sq" not in state or not float(state.get("step", 0)):
                return None
            correction = 1 - beta2 ** float(state["step"])
            parts.append((state["exp_avg_sq"].detach().float().cpu().reshape(-1) / correction).sqrt())
        if not parts:
            return None
        root = torch.cat(parts)
        return 1.0 / (root + max(1e-8, 0.1 * float(root.mean())))  # at most ~10x the typical element's scale

    def _decode_all(self, step: int, tied: bool, msg, received, keys, peers, me: int, config) -> list[torch.Tensor]:
        """Every member's decoded message in group order, once each is known to be well formed, of the group's
        size, and (stage group) no larger than `max_norm_ratio` times this member's own: a bad one fails the Reduce
        naming its sender before anything is summed (this member's error feedback never holds another's message)."""
        what = "tied gradient" if tied else "gradients"
        parts = []
        for i in range(len(peers)):
            message = msg if i == me else received[keys[i]]
            try:
                part = decoder_for(message, config).decode(message, limits=self.limits).float()
            except WireError as e:
                raise CallRefused(
                    grpc.StatusCode.INVALID_ARGUMENT, f"member {peers[i]}'s {what} for step {step}: {e}; nothing summed"
                ) from None
            if part.shape != (self.groups[tied].numel,):  # never sum two layouts (received ones were checked already)
                raise CallRefused(grpc.StatusCode.INVALID_ARGUMENT, f"member {peers[i]} sent {list(part.shape)}")
            parts.append(part)
        own = float(parts[me].norm())
        reference = self.reference_norm(tied, step, own)
        for i, part in enumerate(parts if not tied else ()):  # the tied group's ends differ by nature (embedding, head)
            norm = float(part.norm())
            if reference > 0 and not norm <= self.max_norm_ratio * reference:
                raise CallRefused(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"member {peers[i]}'s {what} for step {step} have norm {norm:.3g}, more than "
                    f"{self.max_norm_ratio:g}x this member's {reference:.3g} (its largest over its last "
                    f"{len(self.groups[tied].own_norms)} sums; {own:.3g} now): refused, nothing summed "
                    f"{proportion_tag(peers[i])}",
                )
        return parts

    def reference_norm(self, tied: bool, step: int, own: float) -> float:
        """Records `own`, the norm of this member's message for `step`, and returns the largest of its last
        `OWN_NORMS` (this one included): what another member's message is held to. Its own messages only, so no
        other member moves it (a liar accepted at 64x it every step would otherwise ramp it up); the largest, so an
        honest sibling's gradients are not refused because this member's micro-batches of the step happened to
        be ones the model fits already (two honest peers were evicted so in a suite run, 0.289 against 0.00282)."""
        norms = self.groups[tied].own_norms
        norms.pop(step, None)
        norms[step] = own if math.isfinite(own) else 0.0  # never a reference that admits anything
        while len(norms) > OWN_NORMS:
            del norms[next(iter(norms))]
        return max(norms.values())

    def _check_still_open(self, request: ReduceOrder, group: _Group) -> None:
        """Refuses to commit a sum (compute lock and `_arrived` held) unless its attempt of the step is still the
        open one: the step may have ended meanwhile, and a rerun opened the same step number again, whose own sum
        this one would refuse as "reduced already"."""
        host = self.host
        if (
            host.open_step != request.step
            or group.reduced is not None
            or host.ledger.was_abandoned(request.step, request.attempt_id)
        ):
            raise CallRefused(grpc.StatusCode.ABORTED, f"step {request.step} ended while it was being reduced")

    def _check_reduce(self, request: ReduceOrder, peers: list[str], addresses: list[str]) -> int:
        """This peer's index in the group, once the request is known to be for its open, finished step."""
        host = self.host
        self._check_role("Reduce", request.plan_version, request.stage)
        if not 1 <= len(peers) <= MAX_GROUP or len(addresses) != len(peers) or host.peer_id not in peers:
            raise CallRefused(
                grpc.StatusCode.INVALID_ARGUMENT, f"group: {peers[:8]} must name this peer, 1..{MAX_GROUP}"
            )
        with host.compute_lock:
            host.ledger.check_attempt(request.step, request.attempt_id)  # a late Reduce of an abandoned attempt
            if host.open_step != request.step or not host.gate.finished(request.step):
                raise CallRefused(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"Reduce of step {request.step} {EARLY_REDUCE} here (open step: {host.open_step})",
                )
            if self.groups[False].reduced == request.step:
                raise CallRefused(grpc.StatusCode.FAILED_PRECONDITION, f"step {request.step} is already reduced")
        return peers.index(host.peer_id)

    def _check_tied(self, peers: list[str], addresses: list[str]) -> int | None:
        """This peer's index in the tied group (None: no tied exchange asked), once the group is well formed; an
        end stage of a multi-stage pipeline must be asked (its tied gradient is summed nowhere else)."""
        host = self.host
        if not peers and not addresses:
            if self.tied_trained:
                raise CallRefused(
                    grpc.StatusCode.INVALID_ARGUMENT, "an end stage's Reduce must name the tied group (tied_peers)"
                )
            return None
        if self.tied_numel == 0:
            raise CallRefused(grpc.StatusCode.INVALID_ARGUMENT, f"stage {host.role.stage} holds no tied weight")
        if (
            not 2 <= len(peers) <= _most(True)
            or len(addresses) != len(peers)
            or len(set(peers)) != len(peers)
            or host.peer_id not in peers
        ):
            raise CallRefused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"tied group: {peers[:8]} must name 2..{_most(True)} distinct peers, this one among them",
            )
        return peers.index(host.peer_id)

    def _config(self, step: int, index: int, tied: bool = False) -> CodecConfig:
        """The group's codec (`group_config`, with this averager's floors), its rounding draws seeded by step, group
        and member so no two messages share them (fp32, behind a codec with sample buffers, draws none)."""
        weight = self.host.worker.module.tied_parameter() if tied else None
        cols = weight.shape[-1] if weight is not None else None
        cfg = group_config(self.codecs[tied], self.host.links.backward_recv.config, tied, self, tied_cols=cols)
        seed = (cfg.seed * 1_000_003 + step * 257 + index + (1 << 20 if tied else 0)) % (1 << 31)
        if codec_class(cfg.name).per_parameter:  # coded parameter by parameter: the same shapes on every member
            return replace(cfg, seed=seed, layout=layout_of([weight] if tied else self.trained))
        return replace(cfg, seed=seed)

    def _send_all(self, info, msg, config: CodecConfig, peers, addresses, me: int, end: float):
        """Streams `msg` to every other member at once, each through the shaper towards it, all by `end`
        (monotonic). (The bytes sent, the members it did not reach by `end`.) A send refused or failed otherwise
        raises, naming the member; one merely out of time does not: the deadline's failure is `_wait`'s, which names
        every member whose message is missing, wherever the clock ran out (a starved encode, a slow send)."""
        host = self.host
        errors: list[Exception] = []
        counts, done = [0] * len(peers), [False] * len(peers)
        refused: list[str | None] = [None] * len(peers)  # a member's last refusal for want of a data slot
        wire = info_to_wire(info)  # the same call info to every member

        def send(i: int) -> None:
            shaper = host.links.shaping.for_destination(addresses[i])

            def counted():
                for item in tensor_items(wire, msg, config.zstd_level, shaper):
                    counts[i] += len(item)
                    yield item

            pause = BUSY_RETRY_S
            while True:
                try:
                    # communication: this member's gradients to member i of the group
                    left = max(end - time.monotonic(), 0.001)
                    host.outbox.connector.stage(addresses[i], peers[i]).Average(counted(), timeout=left)
                    done[i] = True
                except grpc.RpcError as e:
                    code = e.code()
                    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and end - time.monotonic() > pause:
                        # the member's data slots are full: the step's last calls there (a Reduce that left with
                        # the pipeline sends while the other end still computes); they end soon
                        refused[i] = e.details()
                        time.sleep(pause)
                        pause = min(2 * pause, 0.1)
                        continue
                    if code != grpc.StatusCode.DEADLINE_EXCEEDED:  # out of time: reported with the missing ones
                        errors.append(name_failure(e, info.stage, peers[i], addresses[i]))
                except Exception as e:  # noqa: BLE001 - reported to the caller, naming the peer
                    errors.append(RuntimeError(f"member {peers[i]} at {addresses[i]}: {e}"))
                return

        sends = [spawn(lambda i=i: send(i), "average-send") for i in range(len(peers)) if i != me]
        wait(sends, timeout=max(0.0, end - time.monotonic()))  # all sends share the one deadline, not one each
        sent = sum(counts)
        link = "tied" if info.tied else "average"
        host.metrics.wire_bytes.labels(link, link).inc(sent)
        if errors:
            raise errors[0]
        # one refused until the clock ran out says so, whether its last refusal came before this wait ended or not
        unsent = [i for i in range(len(peers)) if i != me and not done[i]]
        return sent, [peers[i] + (f" (refused until the deadline: {refused[i]})" if refused[i] else "") for i in unsent]

    def _wait(self, step: int, tied: bool, keys, peers, me: int, end: float, unsent: list[str], attempt_id: int = 0):
        """The other members' messages of `step`, once all are in and this member's reached every other
        (`unsent`: those it did not reach by `end`); else DEADLINE_EXCEEDED naming the members missing either way,
        or ABORTED once the trainer abandoned this attempt (`attempt_id`) of the step. The abandon's wake-up comes
        before the step is closed, and the trainer's next attempt may open the same step again before this thread
        runs: judged by the open step alone, the wait then went on to its deadline, holding the stage's one Reduce
        slot, and the next attempt's Reduce was refused as busy (a suite run of test_verify, one attempt lost)."""
        group = self.groups[tied]
        with self._arrived:
            while True:
                have = group.inbox if group.inbox_step == step else {}
                missing = [peers[i] for i, k in enumerate(keys) if i != me and k not in have]
                if not missing and not unsent:
                    return dict(have)
                if self.host.ledger.was_abandoned(step, attempt_id):
                    raise CallRefused(grpc.StatusCode.ABORTED, f"step {step} ended while it was being reduced")
                left = end - time.monotonic()
                if left <= 0 or self.host.open_step != step or not missing:  # unsent: past `end` already
                    raise self._late(step, tied, missing, unsent)
                self._arrived.wait(left)

    def _late(self, step: int, tied: bool, missing: list[str], unsent: list[str]) -> CallRefused:
        """The Reduce's deadline failure: who sent nothing here, and whom this member's message did not reach."""
        what = "tied group member(s)" if tied else "replica(s)"
        parts = [f"{what} {', '.join(missing)} sent no gradients for step {step}"] if missing else []
        if unsent:
            parts.append(f"this member's gradients for step {step} did not reach {', '.join(unsent)}")
        return CallRefused(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"stage {self.host.role.stage}: {' and '.join(parts)} within the Reduce's deadline; nothing was summed",
        )
