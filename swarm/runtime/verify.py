"""Verified stage work, the trainer's side: audit sampled micro-batches against a sibling replica's recomputation,
compare replicas' weights after every step, evict the liar and undo what it poisoned.

Replicas of a stage hold bit-identical weights within a step (`swarm.runtime.average`), so any replica can redo
another's work. For a micro-batch drawn with a secret seed (a stage cannot know which of its micro-batches will
be audited), after its backward and before the step's `Step`, the trainer asks every stage of its route for its
records (`Stage.Audit`: the input it computed on, its output, the gradient it received and the one it sent,
`swarm.runtime.audit`) and another replica of each stage to recompute from the reported input (`Stage.Recompute`;
with direct sketched records the sibling fetches that input from the audited stage, `Stage.AuditInputs`, against the
digest the stage committed to in its Audit reply: `VerifyConfig.direct`).
Per stage it checks:

- own: the stage's recorded output (or loss) and input gradient equal the sibling's recomputation within `rtol`
  (float reordering only: the weights are the same bits);
- link: what the next stage says it decoded as its input (and the previous stage, as its received gradient)
  equals the recomputation within `link_rtol`, the codec's error: a stage that sends other than it records is
  caught by its neighbour's independent record.

A failed own check is resolved by more recomputations: the audited stage's own (a stage whose record disagrees
with its own recomputation contradicts itself) and, with 3+ replicas, a second sibling's (the majority of the
recomputations is right). A failed link check blames the sender where the receiver's own records are
corroborated (its own and downstream checks pass), else nobody. Two replicas that recompute the same input
differently, each consistently with itself, cannot be told apart by each other: the trainer's own recomputation
with their weights (`referee`, `swarm.runtime.referee`) names the liar; where it cannot (no referee, a failed
fetch, weights whose digest is not theirs) that is a dispute, the step is abandoned and nobody is evicted. A
verdict evicts the liar (`evict(peer, reason)`: the driver takes it out of its routes and tells `on_liar`) and
raises `LiarFound`, so the driver abandons the step before any `Step` and runs it again without the liar: nothing
it poisoned is applied. A route through a peer in its first step (`VerifyConfig.entry_steps`) is audited whole:
a step applied with a liar in it cannot be undone (the replicas' Reduce summed its gradients into every replica).

After `Step`, replicas report their weights' digest (`StepRequest.want_digest`): replicas that disagree have
diverged. With 3+ replicas the minority is the liar; with 2 the one whose digest did not change over an applied
step stopped updating; anything else is a dispute, logged. The honest replicas' state is the stage's: the
evicted replica is out of the routes, and a peer that returns catches up from its replicas
(`StateHandover.behind`).
"""

from __future__ import annotations

import hashlib
import logging
import math
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import wait
from dataclasses import dataclass, field

import torch

from swarm.compression import WireError
from swarm.net.stream import PLAN_MISMATCH, StageCallError, tokens_from_wire
from swarm.proto import stage_pb2
from swarm.runtime.audit_wire import (
    RECORD_CODECS,
    committed_mismatch,
    read_record,
    recompute_request,
    reply_tensor,
    sketch,
    sketch_digest,
)
from swarm.runtime.referee import RefereeFailed
from swarm.runtime.routing import reroutable, spawn

__all__ = ["AuditDisputed", "Evidence", "Finding", "LiarFound", "StageVerifier", "VerifyConfig", "judge", "rel_err"]

log = logging.getLogger("swarm.runtime.verify")


@dataclass(frozen=True)
class VerifyConfig:
    """How the trainer verifies replicated stages' work."""

    fraction: float = 0.1
    """Share of micro-batches audited (drawn per micro-batch with a secret seed); 0 turns audits off. Each audit
    costs one forward and one input-gradient backward of that micro-batch on a sibling replica, and the records'
    bytes through the trainer."""
    rtol: float = 1e-3
    """Largest relative error (L2) between a stage's record and a sibling's recomputation of the same input: the
    weights are the same bits, so only float reordering differs."""
    link_rtol: float = 1.0
    """Largest relative error between a recomputed activation and the next stage's decoded copy of it: the forward
    codec's error, which for AQ-SGD grows with how far the activation moved since the buffer last saw its sample
    (honest worst over 20 steps of a 2 x 2 pipeline whose samples change every step: 0.41 with acsgd2+ch+nr; over
    400 steps of the default model on the default data, every micro-batch audited: 0.44 with s42's default
    acsgd2+ch+nr+fsl32+s20, whose subspace-coded first sights set it, 0.43 with acsgd2+ch+nr; 0.05 with acsgd4; 2e-4
    fp16; in the convergence experiment's 8 epochs, every forward message, `scripts/measure_link_error.py`: s50's
    default's 2-bit deltas 0.37 at most, its first sights 0.53; the 1-bit bilevel+ch+fsl32+s20's deltas 0.57, 0.33
    median; the default's subspace-coded deltas (`+dsl16`, s53) 0.15, 0.11 median). Noise of the same norm is 1.4
    off, x10 is 9 off; a copy scaled x1.5 (0.5 off) passes the link and is caught only where the stage's own record
    holds it (docs/SECURITY.md#verified-stage-work)."""
    link_rtol_backward: float = 3.0
    """The same for an input gradient and the previous stage's decoded copy: the backward codec's error (honest
    worst 1.15 with gradq2+ef+rot+nr+cs+g1024 over 20 steps, 1.30 over the 400 above and 1.17 with s53's default
    gradq2+ef+rot+nr+cs+g256; 1.7 with gradq2+ef, 0.2 with gradq4; today's default, gradq2+rot+nr+cs+g256, sends no
    error feedback, so its error is one message's quantization alone): at 2 bits the link catches only gross lies
    (x10); a flip is caught by the sender's own record."""
    suspect_fraction: float = 0.5
    """Share of micro-batches audited on a route through a suspect peer (`suspect` in `sampled`): one with strikes
    in the window, or one on probation, in its first `probation_steps` steps of the run. A liar that lies from its
    start is then caught within a step or two rather than after ~1/fraction steps of applied poison; one that
    waits out its probation is caught at `fraction`. Never below `fraction`; 0 with `fraction` 0 (audits off)."""
    probation_steps: int = 5
    """Steps of the run a peer is audited at `suspect_fraction` after it first answers the trainer (each peer that
    joins, a Sybil's fresh key too, starts on probation)."""
    entry_steps: int = 1
    """Steps of the run, from a peer's first (counted as for probation), in which every micro-batch of a route
    through it is audited, before the step's Step: a liar that lies from its first step, as a fresh key must to do
    harm early, is then always caught before anything it computed is applied (at `suspect_fraction` alone its
    first step escaped 1 time in 4 with 2 micro-batches on its route, and was applied: the full attacks run's
    sign-flip and noise liars, docs/reports/attacks.md, seventh pass). Costs one fully audited step per peer that
    joins; 0: off (and nothing with `fraction` 0)."""
    backward: bool = True
    """Also audit the backward: the input gradient each stage sent."""
    digests: bool = True
    """Compare the replicas' weights digests after every Step."""
    digest_stride: int = 61
    """Hash every n-th element of each parameter (from an offset the trainer draws each step): about 1/n of a full
    SHA-256 of the weights per step (1: every element)."""
    seed: int | None = None
    """The sampling secret (None: a fresh random one; set only in tests)."""
    records: str = "fp32"
    """How the records and recomputations travel: "fp32" (exact); "fp16" (compact: fp16 after a power-of-two
    scale, half the bytes, `swarm.runtime.audit_wire`); or "sketch" (compact: fp16 for what a sibling recomputes
    from, a stage's input and received gradient; count sketches of `SKETCH_SIZE` buckets for every other tensor,
    compared by the norms of their differences). A compact audit whose checks all pass with a margin (the own
    checks within `rtol` / 2, the link checks within `COMPACT_LINK_SHARE`, or `SKETCH_LINK_SHARE`, of theirs)
    passes; any other is asked again in fp32 and judged exactly as an fp32 audit, so every verdict is reached on
    fp32 records, and a stage whose fp32 record does not round (or sketch) to the compact one it reported is a
    liar. The default is exact: in one process audits cross no wire; `swarm train` sends sketches
    (`--verify-records`)."""
    direct: bool = True
    """With "sketch" records: a stage sends the trainer only sketches of its input and received gradient, and the
    digests of their compact values, and the sibling that recomputes fetches those values from the stage itself
    (`Stage.AuditInputs`), checked against the digests: they cross the wire once instead of twice (stage to
    trainer, trainer to sibling). A fetch that fails or does not match is a disagreement: the audit is asked
    again in fp32, through the trainer."""
    referee_rtol: float = 0.05
    """Largest relative error between a replica's number and the trainer's own recomputation of it, when the
    trainer referees a dispute between two replicas (`swarm.runtime.referee`): the weights are the same bits, but
    the trainer computes in fp32 on its CPU where a stage may autocast to bf16/fp16 on an accelerator. A lie of
    x1.5 is 0.5 off."""

    def __post_init__(self) -> None:
        if not (0 <= self.fraction <= 1 and 0 <= self.suspect_fraction <= 1):
            raise ValueError(f"fraction and suspect_fraction must be in [0, 1], got {self.fraction}, "
                             f"{self.suspect_fraction}")  # fmt: skip
        if self.probation_steps < 0 or self.entry_steps < 0:
            raise ValueError(f"probation_steps and entry_steps must be >= 0, got {self.probation_steps}, "
                             f"{self.entry_steps}")  # fmt: skip
        if self.digest_stride < 1:
            raise ValueError(f"digest_stride must be >= 1, got {self.digest_stride}")
        if not (self.rtol > 0 and self.link_rtol > 0 and self.link_rtol_backward > 0 and self.referee_rtol > 0):
            raise ValueError("tolerances must be positive")
        if self.records not in RECORD_CODECS:
            raise ValueError(f"records must be one of {RECORD_CODECS}, got {self.records!r}")


COMPACT_OWN_SHARE = 0.5
"""A compact audit's own checks pass within this share of `rtol`: the compact inputs' rounding moves a
recomputation by about 2e-4 (relative) on the churn model's stages, so a compact pass is an fp32 pass too."""
COMPACT_LINK_SHARE = 0.99
"""A compact audit's link checks pass within this share of their tolerances (the rounding moves them by ~1e-5)."""
DISAGREED = math.nan
"""A recomputation that cannot be compared (a direct audit's failed fetch, other values, a digest that is not the
record's): it fails every check it enters (`rel_err` against it is inf), where None would skip a backward check
(a frozen stage's: it sends no gradient)."""
MAX_FETCHED_BYTES = 1 << 30
"""Most bytes a sibling's report of one direct fetch is counted at (the figure is the sibling's word)."""
SKETCH_SIZE = 1024
"""Buckets of a sketched audit's count sketches: the norm of a sketched difference is within 3% (one standard
deviation, at most) of the difference's norm."""
SKETCH_LINK_SHARE = 0.8
"""A sketched audit's link checks pass within this share of their tolerances: an error at the tolerance passes
only where the sketches underestimate it by 20%, about seven standard deviations. (Its own checks, within half of
`rtol`, would need a 50% underestimate.)"""


class LiarFound(Exception):
    """An audit found a stage replica lying; it was evicted and the step must be abandoned and run again."""

    def __init__(self, peer: str, stage: int, reason: str):
        super().__init__(f"stage {stage} peer {peer}: {reason}")
        self.peer, self.stage, self.reason = peer, stage, reason


class _Refused(Exception):
    """A live stage refused an Audit of its own work or a Recompute (judged in the audit's thread: `_liar`)."""

    def __init__(self, stage: int, peer: str, method: str, error: BaseException):
        super().__init__(str(error))
        self.stage, self.peer, self.method, self.error = stage, peer, method, error


class _Disagreed(Exception):
    """A sibling could not recompute a direct audit's micro-batch from the audited stage's inputs (its fetch failed
    or did not match, ABORTED; or it predates direct audits and found no input, INVALID_ARGUMENT): a disagreement,
    asked again in fp32 through the trainer, never a verdict."""


DIRECT_FAILURES = ("ABORTED", "INVALID_ARGUMENT")
"""A direct Recompute's failures that are `_Disagreed`, not a dispute."""


class AuditDisputed(Exception):
    """An audit found a mismatch it cannot pin on one peer: the step is abandoned, nobody is evicted."""


def rel_err(a: torch.Tensor | float | None, b: torch.Tensor | float | None) -> float:
    """‖a - b‖ / ‖b‖ (L2; inf when either is missing or the shapes differ, NaN stays NaN)."""
    if a is None or b is None:
        return math.inf
    a, b = torch.as_tensor(a).float(), torch.as_tensor(b).float()
    if a.shape != b.shape:
        return math.inf
    diff, norm = float((a - b).norm()), float(b.norm())
    if norm == 0:
        return 0.0 if diff == 0 else math.inf
    return diff / norm


@dataclass
class Evidence:
    """One stage of an audited micro-batch's route: the replica's records and a sibling's recomputation."""

    stage: int
    peer: str
    inputs: torch.Tensor | None = None
    output: torch.Tensor | float | None = None
    """the activation, or the last stage's loss"""
    grad_received: torch.Tensor | None = None
    grad_sent: torch.Tensor | None = None
    verifier: str | None = None
    """the sibling that recomputed (None: a lone stage, not verified)"""
    check_output: torch.Tensor | float | None = None
    check_grad: torch.Tensor | None = None
    wire: dict = field(default_factory=dict)
    """the record's tensors as they came (field -> (TensorMessage, scale)): a compact input is passed on to the
    sibling as it came, so both compute from the same bits"""
    sketched: set = field(default_factory=set)
    """the record's fields that came as count sketches (a sketched audit), under `sketch_seed`"""
    sketch_seed: int = 0
    digests: dict = field(default_factory=dict)
    """a direct audit's: field -> the digest of the compact tensor a sibling fetches from the stage itself"""


@dataclass(frozen=True)
class Finding:
    stage: int
    kind: str
    """"own" (the stage's record vs the recomputation) or "link" (the neighbour's record vs the recomputation)"""
    direction: str
    """"forward" or "backward\""""
    error: float


def judge(
    route: Sequence[Evidence], rtol: float, link_rtol: float, backward: bool = True, link_rtol_backward: float = 0.0
) -> list[Finding]:
    """The failed checks of one audited micro-batch, own checks first (pure: no calls); `link_rtol_backward` 0:
    `link_rtol` for both directions."""
    link_back = link_rtol_backward or link_rtol
    own, link = [], []
    last = len(route) - 1
    for s, e in enumerate(route):
        if e.verifier is None:
            continue
        err = rel_err(e.output, e.check_output)
        if not err <= rtol:
            own.append(Finding(s, "own", "forward", err))
        if s < last:
            err = rel_err(route[s + 1].inputs, e.check_output)
            if not err <= link_rtol:
                link.append(Finding(s, "link", "forward", err))
        if backward and s > 0 and e.grad_sent is not None and e.check_grad is not None:  # frozen stages send none
            err = rel_err(e.grad_sent, e.check_grad)
            if not err <= rtol:
                own.append(Finding(s, "own", "backward", err))
            err = rel_err(route[s - 1].grad_received, e.check_grad)
            if not err <= link_back:
                link.append(Finding(s, "link", "backward", err))
    return own + link


def _sketched(e: Evidence, values_in: bool, seed: int, size: int) -> Evidence:
    """`e` as a sketched audit judges it: every tensor a count sketch under `seed` (what came as values too: the
    inputs of stages after the first, received gradients, an older stage's or sibling's values)."""

    def of(t):
        return sketch(t, seed, size) if isinstance(t, torch.Tensor) and t.dim() > 1 else t

    return Evidence(
        e.stage, e.peer, of(e.inputs) if values_in else e.inputs, of(e.output), of(e.grad_received),
        of(e.grad_sent), e.verifier, of(e.check_output), of(e.check_grad),
    )  # fmt: skip


def _digest_of(digest: bytes, shown) -> bool:
    """Whether a sibling's `sketch_digest` is the digest of `shown`, the audited stage's own sketch."""
    return isinstance(shown, torch.Tensor) and shown.dim() == 1 and digest == sketch_digest(shown)


def _fetched_other(request, reply, audited: Evidence) -> str | None:
    """What a direct Recompute fetched that does not sketch to what the audited stage reported, or None."""
    for name, wanted, shown in (("input", request.input_digest, audited.inputs),
                                ("grad", request.grad_digest, audited.grad_received)):  # fmt: skip
        if wanted and not _digest_of(getattr(reply, f"{name}_sketch_digest"), shown):
            return f"its {name} does not sketch to the stage's"
    return None


def _together(calls: Sequence[Callable[[], object]]) -> list:
    """Runs `calls` at once, one thread each (the first in this one); their results in order, or the first
    failure raised after all ended."""
    results: list = [None] * len(calls)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = calls[i]()
        except BaseException as e:  # noqa: BLE001 - re-raised below, in the caller's thread
            errors.append(e)

    others = [spawn(lambda i=i: run(i), "audit") for i in range(1, len(calls))]
    if calls:
        run(0)
    wait(others)
    if errors:
        raise errors[0]
    return results


@dataclass
class VerifyStats:
    audits: int = 0
    """micro-batches audited"""
    recomputes: int = 0
    detections: list[tuple[str, str]] = field(default_factory=list)
    """(peer, reason) of every liar evicted"""
    disputes: int = 0
    refereed: int = 0
    """disputes the trainer recomputed itself (one weights fetch each)"""
    referee_failures: int = 0
    """of those, the ones it could not settle (fetch refused, digest mismatch, no agreement): still disputes"""
    seconds: float = 0.0
    """time spent in audits (on the micro-batches' threads, overlapping the step's other work)"""
    worst_own: float = 0.0
    """largest own-check error an audit passed (how close honest runs come to `rtol`)"""
    worst_link: float = 0.0
    """largest forward link-check error an audit passed (the forward codec's error)"""
    worst_link_backward: float = 0.0
    """largest backward link-check error an audit passed (the backward codec's)"""
    escalations: int = 0
    """compact audits (`VerifyConfig.records` "fp16") with a check outside its margin, asked again in fp32"""


Call = Callable[[int, int, str, object], object]
"""(stage, replica, method, request) -> reply: the driver's `_call`"""
Referee = Callable[..., object]
"""(stage, fetch, source, (stride, seed, digest), inputs, targets, grad) -> `Recomputed`, or raises
`RefereeFailed`: `swarm.runtime.referee.StageReferee`"""


class StageVerifier:
    """The trainer's audits of one pipeline's replicated stages.

    Args:
        config: sampling rate and tolerances.
        call: how to call a replica (the driver's `_call`, which counts the bytes and names failures).
        replica_peers: peer ids `[stage][replica]`.
        evict: takes a liar out (the driver's: out of the routes, and its `on_liar`).
        referee: the trainer's own recomputation (`swarm.runtime.referee.StageReferee`), asked once per dispute
            between two replicas (None: a dispute stays one).
        fetch: (stage, replica) -> that replica's GetState stream, for the referee's weights.
        count: (bytes, method) -> None: counts bytes that no call of `call` carries (a direct audit's fetch
            between two replicas, as the sibling reports it) in the step's control bytes.
    """

    def __init__(
        self,
        config: VerifyConfig,
        call: Call,
        replica_peers: Sequence[Sequence[str]],
        evict: Callable[[str, str], None],
        referee: Referee | None = None,
        fetch: Callable[[int, int], object] | None = None,
        count: Callable[[int, str], None] | None = None,
    ):
        self.config, self._call, self.evict, self._count = config, call, evict, count
        self.referee, self._fetch = (referee, fetch) if fetch is not None else (None, None)
        self.replica_peers = [tuple(r) for r in replica_peers]
        self._secret = (config.seed if config.seed is not None else secrets.randbits(64)).to_bytes(16, "little")
        self._last_digest: dict[str, str] = {}
        """each replica's digest at the step digested last, under `_last_seed`"""
        self._last_seed = 0
        self._baseline: dict[str, str] = {}
        """each replica's full weights digest (Status) before the first digested Step (`baseline`): whether its
        weights moved over that Step, where no earlier sampled digest can say"""
        self._lock = threading.Lock()
        self._local = threading.local()  # the running audit's `current`, per call thread
        self._exact: dict[int, bool] = {}
        """per stage: whether its siblings' recomputations have matched its records bit for bit (a direct audit
        then asks for the sketches' digests only, `_matched`); False from the first that did not"""
        self.stats = VerifyStats()

    # ---- which micro-batches ------------------------------------------------------------------------------

    def sampled(
        self, step: int, attempt: int, route: int, mb: int, suspect: bool = False, entering: bool = False
    ) -> bool:
        """Whether micro-batch `mb` of `route` in this attempt of `step` is audited: a keyed hash of them under
        the trainer's secret, so no stage can tell in advance, and a re-run attempt draws afresh. `suspect`: the
        route runs through a peer with strikes or on probation (`Suspects.suspect`), audited at
        `suspect_fraction`; `entering`: through a peer in its first `entry_steps` steps, audited whole."""
        cfg = self.config
        if cfg.fraction <= 0:
            return False
        if entering:
            return True
        key = f"{step}:{attempt}:{route}:{mb}".encode()
        draw = int.from_bytes(hashlib.blake2b(key, key=self._secret, digest_size=8).digest(), "little")
        return draw / 2**64 < (max(cfg.fraction, cfg.suspect_fraction) if suspect else cfg.fraction)

    def digest_seeds(self, step: int) -> tuple[int, int]:
        """This step's draw of the digest's elements (keyed by the secret: no stage knows it before its Step), and
        the draw of the step digested last (0: none), under which a replica that moved no weight reports what it
        reported then."""
        key = f"digest:{step}".encode()
        seed = 1 + int.from_bytes(hashlib.blake2b(key, key=self._secret, digest_size=7).digest(), "little")
        return seed, self._last_seed

    def _draw(self, what: str) -> int:
        """A 63-bit number keyed by the trainer's secret (no stage can foresee it)."""
        return int.from_bytes(hashlib.blake2b(what.encode(), key=self._secret, digest_size=8).digest(), "little") >> 1

    def _pick(self, step: int, stage: int, choices: Sequence[int]) -> int:
        key = f"pick:{step}:{stage}:{time.perf_counter_ns()}".encode()
        draw = int.from_bytes(hashlib.blake2b(key, key=self._secret, digest_size=8).digest(), "little")
        return choices[draw % len(choices)]

    # ---- one audited micro-batch --------------------------------------------------------------------------

    def audit(
        self,
        step: int,
        plan_version: int,
        replicas: Sequence[int],
        local_mb: Sequence[int],
        siblings: Sequence[Sequence[int]],
        micro,
        loss_weight: float,
        current: Callable[[], bool] = lambda: True,
    ) -> None:
        """Audits one micro-batch whose backward ran: `replicas[s]` ran it at stage s as local micro-batch
        `local_mb[s]`; `siblings[s]` are the other live replicas of stage s in this step; `micro` its `Batch`.
        Returns when every check passed; raises LiarFound (the liar evicted) or AuditDisputed. `current` says
        whether the attempt still runs: once it was abandoned, the stages' records may be another attempt's, so
        nothing is concluded (AuditDisputed) and nobody is evicted."""
        started = time.perf_counter()
        self._local.current = current
        try:
            self._audit(step, plan_version, replicas, local_mb, siblings, micro, loss_weight)
        except _Refused as refused:
            what = "an audit of its own work" if refused.method == "Audit" else "a recomputation"
            self._liar(Evidence(refused.stage, refused.peer), f"step {step}: refused {what}: {refused.error}")
        finally:
            with self._lock:
                self.stats.audits += 1
                self.stats.seconds += time.perf_counter() - started

    def _audit(self, step, plan_version, replicas, local_mb, siblings, micro, loss_weight) -> None:
        cfg, n = self.config, len(replicas)
        if not any(siblings):
            return  # lone stages only: nobody can recompute (a pipeline without replicas pays nothing)
        args = (step, plan_version, replicas, local_mb, siblings, micro, loss_weight)
        compact = cfg.records != "fp32"
        route, judged, requests, findings = self._gather(*args, compact=compact)
        if compact and findings:  # not clearly within: judged again, on the fp32 records
            with self._lock:
                self.stats.escalations += 1
            log.warning("step %d: a compact audit's checks failed (%s): asking again in fp32", step,
                     ", ".join(f"stage {f.stage} {f.kind} {f.direction} {f.error:.3g}" for f in findings))  # fmt: skip
            route, judged, requests, findings = self._gather(*args, compact=False, committed=route)
        self._note_passes(judged, findings)
        if not findings:
            return
        for f in findings:
            if f.kind == "own":
                self._resolve_own(step, route, f, replicas, siblings, requests[f.stage], n)
        for f in findings:
            self._resolve_link(step, route, f, findings)

    def _gather(self, step, plan_version, replicas, local_mb, siblings, micro, loss_weight, compact: bool,
                committed: Sequence[Evidence] = ()):  # fmt: skip
        """One audit's records and recomputations, in fp32 or compact, and the checks that failed (with a margin
        when compact: only a clear pass passes). `committed`: the compact records the stages reported first,
        which their fp32 records must round to."""
        cfg, n = self.config, len(replicas)
        size = SKETCH_SIZE if compact and cfg.records == "sketch" else 0
        seed = self._draw(f"sketch:{step}:{time.perf_counter_ns()}") if size else 0
        route = [Evidence(s, self.replica_peers[s][r], sketch_seed=seed) for s, r in enumerate(replicas)]

        def record(s: int, e: Evidence):
            request = stage_pb2.AuditRequest(
                step=step, plan_version=plan_version, stage=s, micro_batch=local_mb[s], backward=cfg.backward,
                compact=compact, sketch_seed=seed, sketch_size=size, direct=bool(size) and cfg.direct,
            )  # fmt: skip
            return self._ask(s, replicas[s], "Audit", request, e.peer)

        # the records, as each stage of the route states them (all stages at once)
        replies = _together([lambda s=s, e=e: record(s, e) for s, e in enumerate(route)])
        for s, (e, reply) in enumerate(zip(route, replies, strict=True)):
            lie = read_record(e, reply, s == 0, s == n - 1, micro, SKETCH_SIZE)
            if lie:
                self._liar(e, lie)
        if not bool(torch.equal(route[0].inputs, micro.tokens)):
            self._liar(route[0], f"step {step}: its record holds other tokens than the trainer sent")
        for e, first in zip(route, committed, strict=False):  # none when compact
            if lie := committed_mismatch(e, first):
                self._liar(e, f"step {step}: {lie}")
        requests, calls = {}, []
        for s, e in enumerate(route):  # a sibling recomputes from the stage's reported input
            if not siblings[s]:
                continue
            requests[s] = recompute_request(
                step, plan_version, s, n, e, micro, loss_weight, cfg.backward, compact, local_mb[s]
            )
            requests[s].sketch_seed, requests[s].sketch_size = seed, size
            # a direct audit's sibling recomputes from exactly the stage's values: where its recomputations of this
            # stage matched bit for bit so far, the sketches' digests say as much as the sketches
            requests[s].sketch_digests_only = bool(requests[s].fetch_peer) and self._exact.get(s, True)
            v = self._pick(step, s, siblings[s])
            e.verifier = self.replica_peers[s][v]
            calls.append((e, lambda s=s, v=v, e=e: self._recompute(s, v, requests[s], e.verifier, n, e)))
        for (e, _), (output, grad) in zip(calls, _together([c for _, c in calls]), strict=True):
            e.check_output, e.check_grad = output, grad
        own, link, back = cfg.rtol, cfg.link_rtol, cfg.link_rtol_backward
        if compact:
            share = SKETCH_LINK_SHARE if size else COMPACT_LINK_SHARE
            own, link, back = own * COMPACT_OWN_SHARE, link * share, back * share
        judged = [_sketched(e, s > 0, seed, size) for s, e in enumerate(route)] if size else route
        return route, judged, requests, judge(judged, own, link, cfg.backward, back)

    def _resolve_own(self, step, route, finding: Finding, replicas, siblings, request, n) -> None:
        """The stage's record disagrees with a sibling's recomputation: who is right?"""
        s, e = finding.stage, route[finding.stage]
        forward = finding.direction == "forward"
        pick = (lambda out: out[0]) if forward else (lambda out: out[1])
        claimed = e.output if forward else e.grad_sent
        verified = e.check_output if forward else e.check_grad
        tol, what = self.config.rtol, "output" if forward else "input gradient"
        own = pick(self._recompute(s, replicas[s], request, e.peer, n))
        if rel_err(own, verified) <= tol:
            self._liar(e, f"step {step}: its {what} record is {finding.error:.3g} off its own and {e.verifier}'s "
                       f"recomputation")  # fmt: skip
        others = [r for r in siblings[s] if self.replica_peers[s][r] != e.verifier]
        if others:
            third = others[0]
            again = pick(self._recompute(s, third, request, self.replica_peers[s][third], n))
            if rel_err(again, verified) <= tol:
                self._liar(e, f"step {step}: its {what} is {finding.error:.3g} off two replicas' recomputation")
            if rel_err(again, claimed) <= tol:
                verifier = Evidence(s, e.verifier)
                self._liar(verifier, f"step {step}: its recomputation of {e.peer}'s micro-batch disagrees with two "
                           f"replicas'")  # fmt: skip
        elif self.referee is not None:
            self._referee(step, route, finding, replicas, claimed, verified, request, n)
        self._dispute(step, f"stage {s}: {e.peer} and {e.verifier} compute the same input differently ({what})")

    def _referee(self, step, route, finding: Finding, replicas, claimed, verified, request, n) -> None:
        """Two replicas disagree, each consistently with itself: the trainer recomputes with weights fetched from
        one of them (drawn), checked against the sampled digest both reported after the last applied step (where
        none is known yet, the full digest both report in Status), and the replica its number disagrees with
        (beyond `referee_rtol`, the other within it) is the liar. Returns (a dispute) where it cannot tell:
        different or no digests, a failed fetch, fetched weights of another digest, both off or both within."""
        s, e = finding.stage, route[finding.stage]
        a, b = replicas[s], self.replica_peers[s].index(e.verifier)
        with self._lock:
            self.stats.refereed += 1
            digests = {self._last_digest.get(e.peer), self._last_digest.get(e.verifier)}
            stride, seed = self.config.digest_stride, self._last_seed
        try:
            if len(digests) != 1 or None in digests or not seed:  # none known yet (step 0, a replica that joined)
                stride, seed, digests = 1, 0, self._status_digests(s, (a, b), (e.peer, e.verifier))
            if len(digests) != 1:
                raise RefereeFailed(f"{e.peer} and {e.verifier} report different weights digests")
            source = self._pick(step, s, [a, b])
            peer = self.replica_peers[s][source]
            inputs = self._recompute_inputs(request, e, n)
            done = self.referee(s, lambda: self._fetch(s, source), peer, (stride, seed, digests.pop()), *inputs)
        except RefereeFailed as failed:
            with self._lock:
                self.stats.referee_failures += 1
            log.warning("step %d: stage %d: the trainer could not referee %s and %s: %s",
                        step, s, e.peer, e.verifier, failed)  # fmt: skip
            return
        forward = finding.direction == "forward"
        mine = (done.loss if s == n - 1 else done.output) if forward else done.grad_in
        tol, what = self.config.referee_rtol, "output" if forward else "input gradient"
        off_a, off_b = rel_err(claimed, mine), rel_err(verified, mine)
        if off_b <= tol < off_a or (off_b <= tol and math.isnan(off_a)):
            self._liar(e, f"step {step}: its {what} is {off_a:.3g} off the trainer's recomputation with the "
                       f"replicas' weights ({e.verifier}'s is {off_b:.3g})")  # fmt: skip
        if off_a <= tol < off_b or (off_a <= tol and math.isnan(off_b)):
            self._liar(Evidence(s, e.verifier), f"step {step}: its recomputation of {e.peer}'s {what} is {off_b:.3g} "
                       f"off the trainer's with the replicas' weights ({e.peer}'s is {off_a:.3g})")  # fmt: skip
        with self._lock:
            self.stats.referee_failures += 1
        log.warning("step %d: stage %d: the trainer's recomputation settles nothing (%s %.3g off, %s %.3g off)",
                    step, s, e.peer, off_a, e.verifier, off_b)  # fmt: skip

    def _status_digests(self, s: int, replicas: Sequence[int], peers: Sequence[str]) -> set[str]:
        """The SHA-256 of every weight each of `replicas` of stage `s` reports in its Status (the stage caches it
        per weights version): where no Step digest of theirs is known yet."""
        digests = set()
        for r, peer in zip(replicas, peers, strict=True):
            try:
                digest = self._call(s, r, "Status", stage_pb2.Empty()).weights_digest
            except Exception as error:  # noqa: BLE001 - no digest: the dispute stays one
                raise RefereeFailed(f"Status of {peer} failed: {error}") from error
            if not digest:
                raise RefereeFailed(f"{peer} reports no weights digest")
            digests.add(digest)
        return digests

    def _recompute_inputs(self, request, e: Evidence, n: int):
        """(inputs, targets, output gradient) of a Recompute request, as the stage reads them."""
        s = request.stage
        inputs = tokens_from_wire(request.tokens, 1 << 31, e.inputs.shape[1])[0] if s == 0 else e.inputs.float()
        targets = tokens_from_wire(request.targets, 1 << 31, e.inputs.shape[1])[0] if s == n - 1 else None
        grad = None
        if request.backward and s > 0:
            grad = torch.tensor(request.loss_weight) if s == n - 1 else e.grad_received.float()
        return inputs, targets, grad

    def _resolve_link(self, step, route, finding: Finding, findings: list[Finding]) -> None:
        """What a neighbour decoded differs from the sender's recomputed work, though the sender's own records
        agree: the sender sent other than it computed, unless the receiver's records are not corroborated."""
        s, e = finding.stage, route[finding.stage]
        if any(f.kind == "own" and f.stage == s for f in findings):
            return  # resolved as an own check
        forward = finding.direction == "forward"
        receiver = s + 1 if forward else s - 1
        r = route[receiver]
        # the receiver's records are corroborated by its own checks passing; stage 0's received gradient by nothing
        # (it sends no gradient on)
        corroborated = r.verifier is not None and not any(f.stage == receiver for f in findings)
        corroborated = corroborated and (forward or receiver > 0)
        what = "an activation" if forward else "an input gradient"
        if corroborated:
            self._liar(e, f"step {step}: sent {what} {finding.error:.3g} off the one it computed (as {r.peer} "
                       f"decoded it)")  # fmt: skip
        self._dispute(step, f"stage {s} ({e.peer}) -> stage {receiver} ({r.peer}): {what} differs by "
                      f"{finding.error:.3g}, and the receiver's records are not corroborated")  # fmt: skip

    # ---- after Step ---------------------------------------------------------------------------------------

    def baseline(self, keys: Sequence[tuple[int, int]]) -> None:
        """Before a Step while no sampled digest is known yet (the first digested step of this plan): every
        replica of a replicated stage in `keys` (stage, replica) reports its full weights digest in Status (the
        stage caches it per weights version), so that the first `check_digests` can tell a replica that stopped
        updating from one that moved (without it, two replicas apart after their first step are a dispute, and
        every audit of the next step disputes too: the run would stop). A replica that does not answer has no
        baseline."""
        if self._last_seed or self._baseline:
            return
        replicated = [(s, r) for s, r in keys if sum(1 for k in keys if k[0] == s) > 1]
        self._baseline = {p: d for p, d in self._full_digests(replicated).items() if d}

    def _full_digests(self, keys: Sequence[tuple[int, int]]) -> dict[str, str]:
        """Each replica's Status weights digest, peer -> digest ("" where it did not answer)."""

        def one(s: int, r: int) -> str:
            try:
                return self._call(s, r, "Status", stage_pb2.Empty()).weights_digest
            except Exception as error:  # noqa: BLE001 - no digest: that replica's movement stays unknown
                log.warning("Status of stage %d replica %d for its weights digest failed: %s", s, r, error)
                return ""

        found = _together([lambda s=s, r=r: one(s, r) for s, r in keys])
        return {self.replica_peers[s][r]: d for (s, r), d in zip(keys, found, strict=True)}

    def check_digests(self, step: int, digests: dict[tuple[int, int], tuple[str, str]]) -> None:
        """Replicas' (digest, digest under the previous draw) after `step` was applied (under `digest_seeds(step)`);
        evicts the replicas that diverged (the minority; with two, the one whose weights did not move)."""
        by_stage: dict[int, dict[int, str]] = {}
        moved: dict[str, bool] = {}
        for (s, r), (digest, previous) in digests.items():
            if digest:
                by_stage.setdefault(s, {})[r] = digest
                peer = self.replica_peers[s][r]
                if previous and peer in self._last_digest:
                    moved[peer] = previous != self._last_digest[peer]
        self._last_digest = {}
        for s, got in sorted(by_stage.items()):
            counts = Counter(got.values())
            unknown = [r for r in got if self.replica_peers[s][r] not in moved]
            if len(counts) > 1 and unknown and self._baseline:  # the first digested step: moved since the baseline?
                now = self._full_digests([(s, r) for r in unknown])
                for peer, digest in now.items():
                    if digest and self._baseline.get(peer):
                        moved[peer] = digest != self._baseline[peer]
            if len(counts) > 1:
                self._diverged(step, s, got, counts, moved)
            for r, digest in got.items():
                self._last_digest[self.replica_peers[s][r]] = digest
        self._last_seed = self.digest_seeds(step)[0]
        self._baseline = {}

    def _diverged(self, step: int, s: int, got: dict[int, str], counts: Counter, moved: dict[str, bool]) -> None:
        (top, most), *rest = counts.most_common()
        if most * 2 > len(got):
            liars = [r for r, d in got.items() if d != top]
            why = f"its weights differ from {most} of its {len(got)} replicas' after step {step}"
        else:
            liars = [r for r in got if moved.get(self.replica_peers[s][r]) is False]
            if any(moved.get(self.replica_peers[s][r]) is None for r in got):
                liars = []  # not every replica's movement is known: no rule names one
            why = f"its weights did not change at step {step}, its replicas' did"
            if not liars or len(liars) == len(got):
                self.stats.disputes += 1
                log.warning("step %d: stage %d's replicas' weights differ and no minority is known: %s", step, s, got)
                return
        for r in liars:
            self._detected(self.replica_peers[s][r], f"stage {s}: {why}")

    # ---- calls and bookkeeping ----------------------------------------------------------------------------

    def _ask(self, s: int, r: int, method: str, request, peer: str, disagreed: tuple[str, ...] = ()):
        """An Audit or Recompute call. A live peer's refusal is a lie (an honest stage holds its records until
        Step, and recomputes any checked input of the open step); a dead peer's failure and a plan change are
        passed on as the driver's other failures are; anything else (a full slot, an input the trainer could not
        check: another hidden size) makes the audit a dispute, never a stop of the run."""
        try:
            return self._call(s, r, method, request)
        except StageCallError as e:
            if reroutable(e) or PLAN_MISMATCH in str(e):
                raise
            if e.code.name in disagreed:
                raise _Disagreed(str(e)) from e
            codes = ("FAILED_PRECONDITION", "INTERNAL") + (("INVALID_ARGUMENT",) if method == "Audit" else ())
            if e.code.name in codes:
                raise _Refused(s, peer, method, e) from e
            raise AuditDisputed(f"{method} to stage {s} ({peer}) failed: {e}") from e

    def _recompute(self, s: int, r: int, request, peer: str, n: int, audited: Evidence | None = None):
        """A sibling's recomputation (output, input gradient); `DISAGREED` where a direct one could not fetch its
        inputs or fetched other values than the audited stage's sketches (`audited`) show."""
        direct = bool(request.fetch_peer)
        try:
            reply = self._ask(s, r, "Recompute", request, peer, DIRECT_FAILURES if direct else ())
        except _Disagreed as e:  # the audited stage or the sibling lies, or the two cannot reach each other
            return self._disagreed(s, request, f"{peer} could not recompute from {request.fetch_peer}'s inputs: {e}")
        if self._count is not None and reply.fetched_bytes:
            self._count(min(int(reply.fetched_bytes), MAX_FETCHED_BYTES), "AuditInputs")
        self.stats.recomputes += 1
        if direct and audited is not None and (why := _fetched_other(request, reply, audited)):
            # the digests bind what the sibling fetched to the stage's Audit reply, the sketches to what the link
            # checks saw: a stage that computed on other values than it showed the trainer is caught in fp32
            return self._disagreed(s, request, f"{peer} recomputed from other values than {audited.peer} showed: {why}")
        try:
            output = reply.loss if s == n - 1 else reply_tensor(reply, "output")
            grad = reply_tensor(reply, "grad_in") if request.backward else None
        except WireError:
            output, grad = None, None  # counts as a disagreement, resolved like any other
        if request.sketch_digests_only and audited is not None:
            output, grad = self._matched(s, reply, audited, output, grad)
        return output, grad

    @staticmethod
    def _disagreed(s: int, request, why: str):
        log.warning("stage %d: %s", s, why)
        return DISAGREED, DISAGREED if request.backward else None

    def _matched(self, s: int, reply, audited: Evidence, output, grad):
        """A digests-only recomputation read against the stage's own sketches: where a digest is the digest of the
        stage's sketch, the recomputation is that sketch (the same bits: error 0); where it is not, `DISAGREED`
        (asked again in fp32), and this stage's later audits ask for the sketches themselves (a
        sibling on another device reorders floats: honest, but never bit for bit)."""
        got = {"output": output, "grad": grad}
        shown = {"output": audited.output, "grad": audited.grad_sent}
        for name, attr in (("output", "output_sketch_digest"), ("grad", "grad_in_sketch_digest")):
            digest_of_it, mine = getattr(reply, attr), shown[name]
            if not digest_of_it:
                continue
            if _digest_of(digest_of_it, mine):
                got[name] = mine
            else:
                got[name] = DISAGREED
                if self._exact.get(s, True):
                    log.info("stage %d: a sibling's recomputation is not the record bit for bit: sketches from now", s)
                self._exact[s] = False
        return got["output"], got["grad"]

    def _note_passes(self, route: Sequence[Evidence], findings: list[Finding]) -> None:
        failed = {(f.stage, f.kind, f.direction) for f in findings}
        stats, last = self.stats, len(route) - 1
        for s, e in enumerate(route):
            if e.verifier is None:
                continue
            if (s, "own", "forward") not in failed:
                stats.worst_own = max(stats.worst_own, rel_err(e.output, e.check_output))
            if s < last and (s, "link", "forward") not in failed:
                stats.worst_link = max(stats.worst_link, rel_err(route[s + 1].inputs, e.check_output))
            if self.config.backward and s > 0 and e.grad_sent is not None and e.check_grad is not None:
                if (s, "own", "backward") not in failed:
                    stats.worst_own = max(stats.worst_own, rel_err(e.grad_sent, e.check_grad))
                if (s, "link", "backward") not in failed:
                    err = rel_err(route[s - 1].grad_received, e.check_grad)
                    stats.worst_link_backward = max(stats.worst_link_backward, err)

    def _liar(self, e: Evidence, reason: str):
        if not getattr(self._local, "current", lambda: True)():
            raise AuditDisputed(f"the attempt was abandoned during the audit of stage {e.stage}")
        self._detected(e.peer, f"stage {e.stage}: {reason}")
        raise LiarFound(e.peer, e.stage, reason)

    def _detected(self, peer: str, reason: str) -> None:
        with self._lock:
            if any(p == peer for p, _ in self.stats.detections):
                return
            self.stats.detections.append((peer, reason))
        self.evict(peer, reason)

    def _dispute(self, step: int, why: str):
        self.stats.disputes += 1
        log.warning("step %d: audit dispute, step abandoned: %s", step, why)
        raise AuditDisputed(f"step {step}: {why}")
