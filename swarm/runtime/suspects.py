"""The trainer's judgement of what its peers report: the rules every number of a Grads reply must meet, and
strikes per peer that evict a peer whose replies keep failing or skipping steps.

A peer in the plan may lie. The numbers it reports to the trainer are checked before any of them is used
(`Suspects.judge_grads`), and a failed call whose error names who caused it (`culprit`) costs that peer a
strike. The rules, on the squared gradient norm a stage's replica reports (`GradReport.grad_sq_norm`):

- finite and >= 0, or +Inf (the fp16 signal "Inf/NaN found here": legitimate only for a stage that scales its
  loss, and struck anyway once the loss scale is down to `inf_strike_scale`, where an honest stage no longer
  overflows);
- at most `max_sq_norm` (no honest model's gradients come near it);
- equal (within `replica_rtol`) on every replica of a stage: replicas hold the same reduced gradients;
- at most `norm_ratio` times the median of that stage's last `norm_history` applied steps' squared norms, once
  `min_history` of them are known, for a lone stage (where two or more replicas report it alike, each from its own
  reduction, it is a real spike: accepted, and global clipping bounds the update). A lone stage's breach up to
  `spike_max_ratio` x the median is applied as a real spike for `spike_steps` steps in a row (nobody can vouch
  for it, and a skipped honest spike recurs on every batch until its peer is evicted); beyond that ratio, or
  from the next step on, each breach is struck and skipped. A breach never joins the median.

The per-block norms (`layer_sq_norms`) must be finite, >= 0 and sum to at most the stage's norm (they are part
of it); the loss scale a power of two in the scaler's range. A reply that breaks a rule raises `Implausible`
naming the stage, replica, peer and address, and the value; the driver abandons the step on every replica
(nothing of it is applied: a lying norm never shrinks the honest stages' update through clipping) and strikes
the peer. `strikes` strikes within `window_steps` steps (one per peer per step), or `max_strikes` within
`long_window_steps`, evict the peer: it is banned for the run, the driver treats it as dead (its routes are
left out, as a dead peer's), and the trainer publishes the ban in its `TrainerAnnouncement.banned` for the
planner (`swarm.daemon.bans`).
"""

from __future__ import annotations

import logging
import math
import re
import statistics
import threading
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import grpc

from swarm.net.stream import PLAN_MISMATCH, StageCallError

__all__ = [
    "BLAME_TAG",
    "PROPORTION_TAG",
    "Implausible",
    "SuspectConfig",
    "Suspects",
    "blame_tag",
    "culprit",
    "disproportionate",
    "proportion_tag",
]

log = logging.getLogger(__name__)

BLAME_TAG = "[suspect peer "
"""How a stage's refusal names the peer that sent what it refused (`blame_tag`), for the trainer's strikes."""
_BLAMED = re.compile(r"\[suspect peer ([^\]\s]+)\]")
PROPORTION_TAG = "[out of proportion: member "
"""How a replica's Reduce refusal names the member whose gradients it found out of proportion to its own
(`proportion_tag`): the trainer audits that step's routes before it blames anyone (`disproportionate`)."""
_DISPROPORTION = re.compile(r"\[out of proportion: member ([^\]\s]+)\]")
_NAMED = re.compile(r"^stage (\d+) \(peer ([^\s()]+)[ )]")
STRIKE_CODES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.DATA_LOSS,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.UNKNOWN,
    }
)
"""Codes of a failure that a named peer caused by what it computed or sent (not by being gone, busy or on
another plan): a strike for that peer."""


def blame_tag(peer: str) -> str:
    """The tag a stage adds to a refusal of what `peer` sent it."""
    return f"{BLAME_TAG}{peer}]"


def proportion_tag(member: str) -> str:
    """The tag a replica adds to its refusal of `member`'s gradients as out of proportion to its own."""
    return f"{PROPORTION_TAG}{member}]"


def disproportionate(error: BaseException | None) -> tuple[int, str, str] | None:
    """(stage, refuser, member) of a failed call that is a replica's refusal of one member's gradients as out of
    proportion to its own (`swarm.runtime.average`'s `max_norm_ratio`), else None. Either may be honest: a liar
    upstream of the refuser on its route can make the refuser's own gradients tiny (the full attacks run's
    liar-scale:300), a liar on the member's route can make the member's huge, and a lying refuser or member
    speaks for itself. Who, is for the audits of the step's routes."""
    if not isinstance(error, StageCallError) or error.code != grpc.StatusCode.INVALID_ARGUMENT:
        return None
    text = str(error)
    named, tagged = _NAMED.match(text), _DISPROPORTION.search(text)
    if named is None or tagged is None:
        return None
    return int(named.group(1)), named.group(2), tagged.group(1)


def culprit(error: BaseException | None, peers: frozenset[str] | set[str]) -> str | None:
    """The peer (one of `peers`) a failed call's error blames: the sender a stage's refusal names
    (`blame_tag`), else the peer at the head of the error ("stage S (peer P at A): ...") where the error is one
    of `STRIKE_CODES`; None for failures that may mean a dead, busy or re-planned peer."""
    if not isinstance(error, StageCallError) or PLAN_MISMATCH in str(error):
        return None
    text = str(error)
    if isinstance(error, Implausible) and error.peer in peers:
        return error.peer
    if (tagged := _BLAMED.search(text)) is not None and tagged.group(1) in peers:
        return tagged.group(1)
    if error.code in STRIKE_CODES and (named := _NAMED.match(text)) is not None and named.group(2) in peers:
        return named.group(2)
    return None


class Implausible(StageCallError):
    """A reply whose numbers cannot be true; `peer` sent it (None: the liar among the replicas cannot be told).
    `struck`: the peer has had its strike for it already."""

    def __init__(self, details: str, peer: str | None, struck: bool = False):
        super().__init__(details, grpc.StatusCode.INVALID_ARGUMENT)
        self.peer, self.struck = peer, struck


@dataclass(frozen=True)
class SuspectConfig:
    """The trainer's rules for its peers' numbers, and when strikes evict."""

    strikes: int = 3
    """strikes within `window_steps` that evict a peer"""
    window_steps: int = 10
    """steps over which strikes count (the step of the strike and the `window_steps - 1` before it)"""
    max_strikes: int = 10
    """strikes within `long_window_steps` that evict a peer however spread out (one that lies every
    `window_steps`-th step would never gather `strikes` in a window)"""
    long_window_steps: int = 1000
    """steps over which `max_strikes` count (long: rare honest failures must not add up to an eviction)"""
    norm_ratio: float = 1e4
    """largest ratio of a stage's squared gradient norm to the median of its recent ones (1e4: 100x the norm;
    the honest quick convergence settings peaked at 8x the squared norm, see docs/SECURITY.md)"""
    norm_history: int = 16
    """applied steps whose squared norms make a stage's median"""
    min_history: int = 4
    """applied steps a stage's median needs before the ratio rule applies"""
    spike_steps: int = 4
    """steps in a row a lone stage's norm may break the ratio rule and still be applied as a real spike (global
    clipping bounds the update, which moves the model out of the spike); from the next one on each breach is
    struck and skipped. A skipped step leaves the weights as they were, so an honest spike skipped recurs on
    every later batch: striking at once evicted the only peer of an honest demo's stage 0 (a loss spike at step
    8 of a 3-step warm-up, squared norm 6e4 against a median of 5.8, three steps in a row)"""
    spike_max_ratio: float = 1e8
    """the largest ratio to the median a lone stage's breach may have to be applied as a spike (1e8: 1e4 x the
    norm); above it the breach is struck and skipped at once (a lie of 1e30 never shrinks the honest updates)"""
    max_sq_norm: float = 1e12
    """largest squared norm a stage may report at all (a norm of 1e6)"""
    replica_rtol: float = 1e-3
    """largest relative difference between the squared norms of one stage's replicas"""
    inf_strike_scale: float = 2.0**8
    """an fp16 "Inf/NaN found" (+Inf) at a loss scale this low or lower is a strike for the stage reporting it"""
    max_scale: float = 2.0**24
    """largest loss scale a stage may report (the scaler's `max_scale`)"""
    max_lr: float = 1e3
    """largest learning rate a Step reply may report"""
    max_loss: float = 1e4
    """largest loss a Forward reply may report"""
    max_call_bytes: int = 1 << 40
    """largest byte count one call's reply may report on one link"""

    def __post_init__(self) -> None:
        if min(self.strikes, self.window_steps, self.norm_history, self.min_history) < 1 or self.spike_steps < 0:
            raise ValueError(
                "SuspectConfig: strikes, window_steps, norm_history and min_history must be >= 1, spike_steps >= 0"
            )
        if self.max_strikes < self.strikes or self.long_window_steps < self.window_steps:
            raise ValueError("SuspectConfig: need max_strikes >= strikes and long_window_steps >= window_steps")
        if not (
            self.norm_ratio > 1
            and self.spike_max_ratio >= self.norm_ratio
            and self.max_sq_norm > 0
            and 0 <= self.replica_rtol < 1
        ):
            raise ValueError(
                "SuspectConfig: need norm_ratio > 1, spike_max_ratio >= norm_ratio, max_sq_norm > 0, "
                "0 <= replica_rtol < 1"
            )


Where = Callable[[int, int], str]
"""(stage, replica) -> "stage S replica R (peer ID at ADDR)", how an error names a replica"""


class Suspects:
    """Strikes per peer, the run's banned peers, and each stage's recent squared gradient norms.

    One lives for the whole run (the trainer hands it to every driver it builds on a new plan), so strikes,
    bans and norm history survive re-plans. Thread-safe.

    Args:
        cfg: the rules and the strike threshold.
        on_ban: told (peer, why) once per evicted peer (e.g. to publish the ban at once).
    """

    def __init__(self, cfg: SuspectConfig | None = None, on_ban: Callable[[str, str], None] | None = None):
        self.cfg = cfg or SuspectConfig()
        self.on_ban = on_ban
        self._lock = threading.Lock()
        self._strikes: dict[str, deque[int]] = {}
        """each peer's strikes (their steps) within the long window"""
        self.banned: dict[str, str] = {}
        """evicted peer -> why, in eviction order; never shrinks during the run"""
        self._norms: dict[int, deque[float]] = {}
        self._spikes: dict[int, tuple[int, int]] = {}
        """per lone stage: (the last step whose norm broke the ratio rule, how many steps in a row did)"""
        self._layout: object = None
        """the plan layout the norm history is for (`layout`); None: none seen yet"""
        self._served: dict[str, tuple[int, int]] = {}
        """each peer's (steps whose Grads it answered, the last of them): how long it has been in the run"""
        self.stood_in = 0
        """Grads replies refused and replaced by a sibling replica's (`judge_grads`): steps a liar did not cost"""
        self.peak_ratio: dict[int, float] = {}
        """per stage: the largest ratio of an applied squared norm to its stage's median seen so far (the margin
        of the ratio rule on this run)"""

    # ---- strikes ----------------------------------------------------------------------------------------

    def strike(self, peer: str, step: int, why: str) -> bool:
        """One strike for `peer` at `step` (a second one in the same step does not count); True when this one
        evicts it (or it was banned already)."""
        cfg = self.cfg
        with self._lock:
            if peer in self.banned:
                return True
            steps = self._strikes.setdefault(peer, deque())
            if step not in steps:
                steps.append(step)
            while steps and steps[0] <= step - cfg.long_window_steps:
                steps.popleft()
            count = sum(1 for s in steps if s > step - cfg.window_steps)
            evicted = count >= cfg.strikes or len(steps) >= cfg.max_strikes
            if evicted:
                self.banned[peer] = why
                self._strikes.pop(peer, None)
        log.warning("step %d: strike %d/%d for peer %s: %s", step, count, cfg.strikes, peer, why)
        if evicted:
            log.error("step %d: peer %s evicted (%d strikes in %d steps): %s", step, peer, count, cfg.window_steps, why)
            if self.on_ban is not None:
                self.on_ban(peer, why)
        return evicted

    def ban(self, peer: str, why: str) -> bool:
        """Evicts `peer` at once, without strikes: for conclusive evidence (an audit caught it recomputing to
        something else than it sent, `swarm.runtime.verify`). True when this call banned it (False: it was)."""
        with self._lock:
            if peer in self.banned:
                return False
            self.banned[peer] = why
            self._strikes.pop(peer, None)
        log.error("peer %s evicted: %s", peer, why)
        if self.on_ban is not None:
            self.on_ban(peer, why)
        return True

    def strikes(self, peer: str) -> int:
        """`peer`'s strikes in the long window (0 once banned)."""
        with self._lock:
            return len(self._strikes.get(peer, ()))

    def suspect(self, peer: str, probation_steps: int) -> bool:
        """Whether `peer` deserves closer audits (`swarm.runtime.verify.VerifyConfig.suspect_fraction`): it has
        strikes within the window, or has answered fewer than `probation_steps` steps' Grads in this run."""
        cfg = self.cfg
        with self._lock:
            served, last = self._served.get(peer, (0, -1))
            struck = any(s > last - cfg.window_steps for s in self._strikes.get(peer, ()))
        return struck or served < probation_steps

    def entering(self, peer: str, steps: int) -> bool:
        """Whether `peer` has answered fewer than `steps` steps' Grads in this run (strikes aside): its routes are
        audited whole (`swarm.runtime.verify.VerifyConfig.entry_steps`)."""
        with self._lock:
            return self._served.get(peer, (0, -1))[0] < steps

    def banned_ids(self) -> tuple[str, ...]:
        """The evicted peers, in eviction order."""
        with self._lock:
            return tuple(self.banned)

    # ---- the numbers of a Grads reply ---------------------------------------------------------------------

    def judge_grads(self, step: int, replies: Mapping, peers: Mapping[tuple[int, int], str], where: Where) -> dict:
        """Checks every Grads reply of a step (keyed (stage, replica); `peers` gives each one's peer id) against
        the rules of this module, and returns the replies to go on with.

        A replica's reply that breaks a rule of its own (`_reply_lie`: a NaN, negative or absurd norm, a loss scale
        that is no power of two...) or (3+ replicas) stands apart from its siblings that agree, is struck; where
        another replica of its stage answered plausibly, that sibling's reply stands in for it (`stood_in`:
        replicas hold the same reduced gradients after their Reduce, so the honest sibling's norm is the stage's)
        and the step goes on: a liar among replicas costs no step. Raises `Implausible` where no sibling can
        stand in (a lone stage, or every replica lied), where two replicas disagree (the one farther from the
        stage's history is struck, where it is known), where a loss scale goes against the majority, where the
        lone stage breaks the ratio rule, or where a strike evicts (the step then runs again without the
        evicted peer). An fp16 +Inf at a loss scale down to `inf_strike_scale` is struck but not raised (the step
        is skipped as every +Inf skips it) unless the strike evicts."""
        cfg = self.cfg
        replies = dict(replies)
        with self._lock:
            for peer in set(peers.values()):
                served, last = self._served.get(peer, (0, -1))
                if step != last:
                    self._served[peer] = (served + 1, step)
        lies = {k: why for k, reply in sorted(replies.items()) if (why := _reply_lie(reply, cfg)) is not None}
        stood = set(lies)  # keys whose reply is a sibling's from here on (each raised or stood in)
        for key, why in lies.items():
            self._stand_in(step, key, f"step {step}: {where(*key)}: {why}", replies, lies, peers, where)
        self._judge_scales(step, replies, peers, where)
        for s in sorted({s for s, _ in replies}):
            keys = sorted(k for k in replies if k[0] == s)
            values = [replies[k].grad_sq_norm for k in keys]
            if any(math.isinf(v) for v in values):
                for k, v in zip(keys, values, strict=True):
                    scale = replies[k].loss_scale
                    if math.isinf(v) and scale <= cfg.inf_strike_scale:
                        why = f"Inf/NaN in its gradients at loss scale {scale:g} (<= {cfg.inf_strike_scale:g})"
                        msg = f"step {step}: {where(*k)}: {why}"
                        if self.strike(peers[k], step, msg):
                            raise Implausible(msg, peers[k], struck=True)  # evicted: the step runs again without it
                continue  # a skip: no norm to compare
            if len(keys) > 1 and max(values) - min(values) > cfg.replica_rtol * max(values):
                liar = self._odd_replica(s, keys, values)
                held = ", ".join(f"{where(*k)}: {v:.6g}" for k, v in zip(keys, values, strict=True))
                msg = f"step {step}: the replicas of stage {s} report different grad_sq_norm ({held})"
                rest = [replies[k].grad_sq_norm for k in keys if k != liar]
                if len(keys) > 2 and max(rest) - min(rest) <= cfg.replica_rtol * max(rest):
                    # the others agree: the odd one is struck, a sibling's reply stands in for it
                    self._stand_in(step, liar, msg, replies, {liar: msg}, peers, where)
                    stood.add(liar)
                    values = [replies[k].grad_sq_norm for k in keys]
                else:
                    self._raise(step, msg, None if liar is None else peers[liar])
            median = self._median(s)
            if median is not None and values[0] > cfg.norm_ratio * median:
                msg = (
                    f"step {step}: {where(*keys[0])}: grad_sq_norm {values[0]:.6g} is more than {cfg.norm_ratio:g} x "
                    f"the median {median:.6g} of stage {s}'s last {len(self._norms[s])} steps"
                )
                if len({peers[k] for k in keys if k not in stood}) > 1:
                    # replicas that each reduced the same gradient agree on it: a real spike (a loss spike moves
                    # every stage's norm), which clipping bounds; striking them evicted honest peers of an honest run
                    log.warning("%s, on which its %d replicas agree: taken as a real spike", msg, len(keys))
                    continue
                if values[0] > cfg.spike_max_ratio * median:
                    self._raise(step, f"{msg} (beyond any spike: {cfg.spike_max_ratio:g} x)", peers[keys[0]])
                run = self._spike_run(s, step)
                if run <= cfg.spike_steps:
                    log.warning(
                        "%s: taken as a real spike (%d of %d in a row a lone stage may have)", msg, run, cfg.spike_steps
                    )
                    continue
                self._raise(step, f"{msg}, {run} steps in a row", peers[keys[0]])
            elif median is not None:
                with self._lock:
                    self._spikes.pop(s, None)
        return replies

    def _spike_run(self, stage: int, step: int) -> int:
        """Counts `step` into the stage's run of ratio-rule breaches (a step judged again, as a rerun, counts
        once) and returns the run's length."""
        with self._lock:
            last, run = self._spikes.get(stage, (-1, 0))
            if step != last:
                run = run + 1 if step == last + 1 or last < 0 or run == 0 else 1
                self._spikes[stage] = (step, run)
            return run

    def _stand_in(self, step: int, key, msg: str, replies: dict, lies: Mapping, peers: Mapping, where: Where) -> None:
        """Strikes the replica at `key` for `msg` and puts a plausible sibling's reply in its place in `replies`;
        raises `Implausible` where there is none (the step is skipped) or the strike evicts (it runs again)."""
        sibling = next((k for k in sorted(replies) if k[0] == key[0] and k != key and k not in lies), None)
        if sibling is None:
            self._raise(step, msg, peers[key])
        if self.strike(peers[key], step, msg):
            raise Implausible(msg, peers[key], struck=True)
        log.warning("step %d: %s stands in for %s, whose reply is refused", step, where(*sibling), where(*key))
        replies[key] = replies[sibling]
        with self._lock:
            self.stood_in += 1

    def _judge_scales(self, step: int, replies: Mapping, peers: Mapping, where: Where) -> None:
        """Every stage computed the step with the same loss scale: where a strict majority of the replies gives
        one, each reply giving another is struck and the step skipped (`Implausible`: a replica holding another
        scale would refuse the step's Step, so no sibling stands in). Without a majority (two replies, one each)
        nobody can be told the liar: `agreed_step` refuses the step, as it always did."""
        votes: dict[float, int] = {}
        for reply in replies.values():
            votes[reply.loss_scale] = votes.get(reply.loss_scale, 0) + 1
        if len(votes) < 2:
            return
        scale, most = max(votes.items(), key=lambda kv: kv[1])
        if most * 2 <= len(replies):
            return
        odd = [k for k, reply in sorted(replies.items()) if reply.loss_scale != scale]
        msgs = [
            f"step {step}: {where(*k)}: loss_scale {replies[k].loss_scale:g}, the other stages computed with {scale:g}"
            for k in odd
        ]
        for k, msg in zip(odd[1:], msgs[1:], strict=True):
            self.strike(peers[k], step, msg)
        self._raise(step, msgs[0], peers[odd[0]])

    def judge_steps(
        self,
        step: int,
        replies: Mapping,
        peers: Mapping[tuple[int, int], str],
        where: Where,
        held: float,
        skipped: bool,
    ) -> tuple[float, float]:
        """(the loss scale the stages now hold, the lr) from a step's Step replies (keyed (stage, replica), each
        with `lr` and `loss_scale`). The step is applied already, so nothing is skipped: each reply whose numbers
        cannot be true is struck. The scale is the one most replies give among those the scaler can move to
        from `held` (a skip: `held` or lower; an applied step: `held` or 2 x `held`), ties to the lower; an lr
        must be finite in [0, `max_lr`]. The trainer names that scale in every next call, so one reply's lie no
        longer makes every stage refuse the next step."""
        cfg = self.cfg

        def possible(scale: float) -> bool:
            if not (math.isfinite(scale) and 2.0**-24 <= scale <= cfg.max_scale and math.frexp(scale)[0] == 0.5):
                return False
            return held <= 0 or (scale <= held if skipped else scale in (held, 2 * held))

        votes: dict[float, int] = {}
        for reply in replies.values():
            if possible(reply.loss_scale):
                votes[reply.loss_scale] = votes.get(reply.loss_scale, 0) + 1
        scale = min(votes, key=lambda s: (-votes[s], s)) if votes else held
        lr = None
        for key, reply in sorted(replies.items()):
            why = None
            if reply.loss_scale != scale:
                why = f"loss_scale {reply.loss_scale!r} after the step, the other stages hold {scale:g}"
            elif not (math.isfinite(reply.lr) and 0 <= reply.lr <= cfg.max_lr):
                why = f"lr {reply.lr!r} is not in [0, {cfg.max_lr:g}]"
            if why is not None:
                self.strike(peers[key], step, f"step {step}: {where(*key)}: {why}")
            elif lr is None:
                lr = reply.lr
        return scale, 0.0 if lr is None else lr

    def loss_lie(self, loss: float, scale: float) -> str | None:
        """Why a micro-batch's loss cannot be true (None: possible): a cross-entropy is >= 0 and at most
        `max_loss`; Inf or NaN only where the stages scale their loss (fp16 overflow: the Grads replies then
        skip the step) or the trainer has not heard their scale yet (0), never at scale 1."""
        if math.isnan(loss) or math.isinf(loss):
            return None if scale != 1 else f"loss {loss!r} from a stage without loss scaling"
        if not 0 <= loss <= self.cfg.max_loss:
            return f"loss {loss!r} is not a cross-entropy in [0, {self.cfg.max_loss:g}]"
        return None

    def counted_bytes(self, traffic, n_links: int) -> tuple[dict[int, int], int, str | None]:
        """A reply's byte counts (`link_bytes`, `fp32_wire_bytes`) fit for the metrics: links of this pipeline
        only, each count at most `max_call_bytes`; and why the reply's were not (None: taken as they came).
        They feed metrics only and are summed along the route, so no peer is blamed: a lie is dropped."""
        cap, why = self.cfg.max_call_bytes, None
        links = {}
        for link, nbytes in traffic.link_bytes.items():
            if not 0 <= link < n_links or nbytes > cap:
                why = f"link_bytes {{{link}: {nbytes}}} (links 0..{n_links - 1}, at most {cap:g} bytes)"
                continue
            links[link] = nbytes
        fp32 = traffic.fp32_wire_bytes
        if fp32 > cap:
            why, fp32 = f"fp32_wire_bytes {fp32} (at most {cap:g})", 0
        return links, fp32, why

    def applied(self, sq_norms: Mapping[int, float]) -> None:
        """A step was applied with these stages' squared norms: they join each stage's history."""
        cfg = self.cfg
        with self._lock:
            for s, v in sq_norms.items():
                if not math.isfinite(v):
                    continue
                history = self._norms.setdefault(s, deque(maxlen=cfg.norm_history))
                if len(history) >= cfg.min_history:
                    median = statistics.median(history)
                    if median > 0:
                        self.peak_ratio[s] = max(self.peak_ratio.get(s, 0.0), v / median)
                        if v > cfg.norm_ratio * median:
                            continue  # a spike taken as real stays out of the median it was judged against
                history.append(v)

    def _median(self, stage: int) -> float | None:
        """The stage's median applied squared norm; None while it has too few steps, or a median of 0 (a frozen
        stage: no history to judge a norm by, and one that thaws or is repacked onto other layers is honest)."""
        with self._lock:
            history = self._norms.get(stage)
            if history is None or len(history) < self.cfg.min_history:
                return None
            median = statistics.median(history)
            return median if median > 0 else None

    def layout(self, key: object) -> None:
        """The plan's stage layout (e.g. its number of stages) that the norm history is for: a new one clears the
        history, since stage s then holds other layers (a repack for a frozen prefix, a re-split), whose norms
        the old ones say nothing about."""
        with self._lock:
            if self._layout is not None and key != self._layout:
                self._norms.clear()
                self._spikes.clear()
            self._layout = key

    def _odd_replica(self, stage: int, keys: list, values: list[float]) -> tuple[int, int] | None:
        """The replica whose squared norm stands apart: with 3+ the farthest from their median, with 2 the one
        farther (in log ratio) from the stage's history; None when that cannot be told (2 replicas, no history)."""
        if len(keys) > 2:
            mid = statistics.median(values)
            return max(zip(keys, values, strict=True), key=lambda kv: abs(kv[1] - mid))[0]
        median = self._median(stage)
        if median is None:
            return None

        def distance(v: float) -> float:
            return abs(math.log(max(v, 1e-30) / median))

        return max(zip(keys, values, strict=True), key=lambda kv: distance(kv[1]))[0]

    def _raise(self, step: int, msg: str, peer: str | None) -> None:
        if peer is not None:
            self.strike(peer, step, msg)
        else:
            log.warning("%s: the step is skipped, nobody struck", msg)
        raise Implausible(msg, peer, struck=True)


def _reply_lie(reply, cfg: SuspectConfig) -> str | None:
    """Why a Grads reply cannot be true (None: its numbers are possible)."""
    v, scale, layers = reply.grad_sq_norm, reply.loss_scale, reply.layer_sq_norms
    if math.isnan(v) or v < 0 or (math.isfinite(v) and v > cfg.max_sq_norm):
        return f"grad_sq_norm {v!r} is not a squared norm in [0, {cfg.max_sq_norm:g}] (nor +Inf)"
    if not (math.isfinite(scale) and 2.0**-24 <= scale <= cfg.max_scale and math.frexp(scale)[0] == 0.5):
        return f"loss_scale {scale!r} is not a power of two in [2^-24, {cfg.max_scale:g}]"
    if any(not (math.isfinite(x) and x >= 0) for x in layers):
        return f"layer_sq_norms {[float(x) for x in layers][:8]} are not all finite and >= 0"
    if math.isfinite(v) and sum(layers) > v * (1 + 1e-3) + 1e-12:
        return f"layer_sq_norms sum to {sum(layers):.6g}, more than grad_sq_norm {v:.6g} (they are part of it)"
    return None
