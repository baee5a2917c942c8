"""The rows, targets, plots and report of `swarm experiment attacks`, from what the run exposed (pure: no processes).

A setting's inputs are the trainer's step rows (steps.csv), its exit, the observations of the run made while it
trained (`Observation`: the plan, who is banned, every announcement, and the trainer's step count at that
moment), and what the attack itself saw (`facts`). Whether an attack was refused or detected is judged only from
those: a defence that is not in the code shows as the attack succeeding.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = [
    "CLEAN_KEYS",
    "LOSS_KEYS",
    "ROW_KEYS",
    "SHAPE_KEYS",
    "Check",
    "Observation",
    "clean_row",
    "held_out_loss",
    "judge",
    "read_observations",
    "read_steps",
    "replacement",
    "replicas_identical",
    "report_markdown",
    "save_plots",
    "targets",
]

ROW_KEYS = ("setting", "refused_or_detected", "detection_steps", "evicted", "run_stopped", "steps", "final_loss")
"""Every row's keys in `--json` (the issue's)."""
CLEAN_KEYS = ("evictions", "throughput_samples_s", "throughput_no_verify_samples_s")
"""The clean row's keys beside ROW_KEYS."""
SHAPE_KEYS = ("replaced_by", "replaced_after_steps", "replicas_identical")
"""Every row's keys about the run's shape: who took an evicted liar's place, how many trainer steps after the
eviction it served, and whether every stage's replicas ended on the same weights (`replicas_identical`)."""
LOSS_KEYS = ("held_out_loss",)
"""Every row's loss besides `final_loss` (a mean of the last steps' training losses, each on its own batch): the
model's loss on the same held-out windows at the end of every setting (`held_out_loss`)."""
DETECT_WITHIN_STEPS = 20
LOSS_TOLERANCE = 0.01
VERIFY_COST = 0.10
LOAD_NOISE = 0.15
"""How far apart two runs of one setting read on this kind of loaded machine (+-15%): a clean run faster than its
no-verify twin by more than this says the load moved between them, not that verification has a negative cost (the
ninth pass: 4.61 vs 3.11 samples/s, the no-verify run started as three helpers' experiments did)."""
REFUSED_CODES = ("UNAUTHENTICATED", "PERMISSION_DENIED")
"""A replayed call answered with one of these was refused by its authentication."""


@dataclass(frozen=True)
class Observation:
    """The run as anyone could read it at time `t` (one poll of the DHT), and the trainer's steps by then."""

    t: float
    step: int
    """steps the trainer had completed"""
    plan_version: int = 0
    """the plan readers follow (0: none found)"""
    stages: tuple[tuple[str, ...], ...] = ()
    """each stage's peer ids in that plan"""
    trainer_ids: tuple[str, ...] = ()
    banned: tuple[str, ...] = ()
    """ids the run says it banned (the plan's or the trainers' announcements' `banned`, where the code has it)"""
    peers: dict = field(default_factory=dict)
    """peer id -> [stage, plan_version, reach, relay, planner_until] of its announcement"""

    def in_run(self, peer_id: str) -> bool:
        """Named in the plan: at a stage or as a trainer."""
        return peer_id in self.trainer_ids or any(peer_id in s for s in self.stages)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, line: str) -> Observation:
        d = json.loads(line)
        return cls(**{**d, "stages": tuple(tuple(s) for s in d["stages"]), "trainer_ids": tuple(d["trainer_ids"]),
                      "banned": tuple(d["banned"])})  # fmt: skip


def read_observations(path: Path) -> list[Observation]:
    if not path.exists():
        return []
    return [Observation.from_json(line) for line in path.read_text().splitlines() if line.strip()]


def read_steps(trainer_dir: Path) -> list[dict]:
    """The trainer's step rows: steps.csv, or the lines it writes while running (a trainer that was stopped)."""
    csv_path, lines = trainer_dir / "steps.csv", trainer_dir / "steps.jsonl"
    try:  # first: while the lines are there, a CSV beside them is still being written from them
        text = lines.read_text()
    except FileNotFoundError:  # none yet, or closed into the CSV (written whole before the lines are removed)
        if not csv_path.exists():
            return []
        with open(csv_path, newline="") as f:
            return [dict(row) for row in csv.DictReader(f)]
    rows = []
    for line in text.splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # the line being written when the trainer stopped
            break
    return rows


def _float(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def final_loss(rows: list[dict]) -> float | None:
    """The mean training loss of the last 5 steps (as `swarm train`'s summary); None without steps."""
    losses = [_float(r.get("train_loss")) for r in rows[-5:]]
    return round(sum(losses) / len(losses), 5) if losses else None


def held_out_loss(rows: list[dict]) -> float | None:
    """The held-out loss the trainer measured after its last step (the same windows in every setting, so two
    settings' models are compared on one set of samples); None where the last step has none (a stopped run)."""
    value = _float(rows[-1].get("held_out_loss")) if rows else math.nan
    return round(value, 5) if math.isfinite(value) else None


def throughput(rows: list[dict], batch_size: int) -> float | None:
    """Samples per second between the first and the last completed step (None with fewer than 2 steps)."""
    times = [_float(r.get("time")) for r in rows]
    if len(times) < 2 or not times[-1] > times[0]:
        return None
    return round(batch_size * (len(times) - 1) / (times[-1] - times[0]), 3)


def _evicted_at(obs: list[Observation], peer_id: str, after_t: float) -> Observation | None:
    """The first observation after `after_t` at which `peer_id`, named in the run before, is banned, or is left out
    of a newer plan and never named again (a peer dropped for a missed heartbeat and planned again is no eviction)."""
    named_in, out_at = None, None
    for o in obs:
        if o.t >= after_t and peer_id in o.banned:
            return o
        if o.in_run(peer_id):
            named_in, out_at = o.plan_version, None
        elif o.t >= after_t and named_in is not None and o.plan_version > named_in and out_at is None:
            out_at = o
    return out_at


def evictions(obs: list[Observation]) -> int:
    """How many peers the run evicted: named in a plan, then banned, or left out of a newer one for good while still
    announced (a clean run: none)."""
    ids = {p for o in obs for s in o.stages for p in s}
    return sum(1 for p in ids if (o := _evicted_at(obs, p, 0.0)) is not None and (p in o.banned or p in o.peers))


def replacement(obs: list[Observation], peer_id: str, evicted: Observation) -> tuple[str, int] | None:
    """Who took evicted `peer_id`'s place at its stage, and the trainer's steps from the eviction until it served
    there: the first observation after `evicted` whose plan gives that stage as many replicas as before, one of
    them a peer new to it that announces the stage under that very plan (a peer announces its role once it holds
    the stage's state). None: the stage stayed short (no standby, or none came in time)."""
    before = [o for o in obs if o.t <= evicted.t and o.stages and any(peer_id in s for s in o.stages)]
    if not before:
        return None
    stage = next(i for i, s in enumerate(before[-1].stages) if peer_id in s)
    width, old = len(before[-1].stages[stage]), set(before[-1].stages[stage])
    for o in obs:
        if o.t < evicted.t or stage >= len(o.stages) or len(o.stages[stage]) < width or peer_id in o.stages[stage]:
            continue
        for p in o.stages[stage]:
            ann = o.peers.get(p)
            if p not in old and ann is not None and ann[0] == stage and ann[1] == o.plan_version:
                return p, max(0, o.step - evicted.step)
    return None


def replicas_identical(replicas: dict[str, list] | None) -> bool | None:
    """Whether every stage's replicas ended on the same step with bit-identical weights (`replicas`: peer id ->
    [stage, last step, weights digest], as `swarm.experiments.attacks.replica_digests` read them); None: none
    read."""
    if not replicas:
        return None
    by_stage: dict[int, set] = {}
    for stage, last_step, digest in replicas.values():
        by_stage.setdefault(stage, set()).add((last_step, digest))
    return all(len(v) == 1 for v in by_stage.values())


def replicas_seen(replicas: dict[str, list]) -> str:
    """`replicas` (peer id -> [stage, last step, digest]) in a line: `stage 0: 1a2b3c4d step 8 digest 5e6f...`."""
    return "; ".join(
        f"stage {stage}: {peer[:8]} step {step} digest {digest[:12]}"
        for peer, (stage, step, digest) in sorted(replicas.items(), key=lambda kv: (kv[1][0], kv[0]))
    )


@dataclass(frozen=True)
class Setting:
    """What one setting ran: its name, kind (clean, stranger, liar) and the attacker's ids and start."""

    name: str
    kind: str
    attacker_ids: tuple[str, ...] = ()
    attack_step: int = 0
    """trainer steps completed when the attack started (0: from the start, as a liar lies)"""
    attack_t: float = 0.0
    facts: dict = field(default_factory=dict)
    error: str | None = None
    """the setting's own failure (e.g. its swarm or the harness's DHT node did not start), if it had one"""


def _worked(s: Setting, obs: list[Observation], run_stopped: bool) -> tuple[bool | None, str]:
    """Whether the attack got what it came for (None: it could not be tried here), and the evidence."""
    after = [o for o in obs if o.t >= s.attack_t]
    f = s.facts
    if "error" in f:
        return None, f"the attacker failed: {f['error']}"
    if s.kind == "liar":
        return None, "judged by eviction"
    if s.name == "ground-key-planner":
        version = f.get("hijack_version")
        if version is None:
            return None, "no plan to copy: the attack did not start"
        # followed: the plan readers accept is the hijack (it names the attacker its only trainer: a planner never
        # names a stranger trainer, though it may plan the attacker at a stage like any volunteer), or honest peers
        # announce the hijack's version while the accepted plan is older (the authority's own plan of that
        # number, published later, does not count: it is the honest planner's)
        named = lambda o: any(p in s.attacker_ids for p in o.trainer_ids)  # noqa: E731
        honest = lambda o: [p for p, a in o.peers.items() if p not in s.attacker_ids and a[1] == version]  # noqa: E731
        took = [o for o in after if named(o)]
        followers = max((len(honest(o)) for o in after if o.plan_version < version), default=0)
        if took:
            return True, f"the accepted plan {took[0].plan_version} names the attacker its trainer"
        return followers > 0, f"{followers} honest peers followed the hijacked plan {version}"
    if s.name == "sybils-planner-kill":
        killed, at = f.get("killed"), f.get("killed_at", s.attack_t)
        if killed is None:
            return None, "no planner to kill"
        before = max((o.plan_version for o in obs if o.t <= at), default=0)
        replanned = [o for o in obs if o.t > at and o.plan_version > before and not o.in_run(killed)]
        elected = f"lowest sybil below every honest id: {f.get('lowest_sybil_below_honest')}"
        if replanned:
            return (
                False,
                f"re-planned without the killed planner {killed} (plan {replanned[0].plan_version}); {elected}",
            )
        return True, f"no plan after the planner {killed} was killed; {elected}"
    if s.name == "stranger-trainers":
        named = {p for o in after for p in o.trainer_ids if p in s.attacker_ids}
        return bool(named), f"{len(named)} of {len(s.attacker_ids)} strangers named trainers in a plan"
    if s.name == "held-data-streams":
        what = (
            f"{f.get('held', 0)} of {f.get('streams', 0)} streams held after 10 s, last refusals {f.get('codes', [])}"
        )
        return run_stopped, ("the honest run stopped; " if run_stopped else "the honest run went on; ") + what
    if s.name == "relay-slot-fill":
        victim = f.get("victim")
        if victim is None:
            return None, "no victim peer started"
        probes, reached = f.get("probes", 0), f.get("reachable", 0)
        if not probes:
            return None, "the NAT'd volunteer never announced a relay: not measured"
        return reached == 0, (
            f"{f.get('accepted', 0)}/{f.get('attaches', 0)} stranger attaches held; the NAT'd volunteer answered "
            f"{reached} of {probes} calls through its relay"
        )
    if s.name == "token-replay":
        capture, replay = f.get("capture"), f.get("replay")
        if capture in REFUSED_CODES or replay in (None, "no target", "nothing captured"):
            return None, f"nothing to replay (capture {capture}, replay {replay})"
        return replay not in REFUSED_CODES, f"captured call {capture}; replayed on another connection: {replay}"
    return None, f"unknown attack {s.name}"


def judge(
    s: Setting, rows: list[dict], obs: list[Observation], rc: int | None, target_steps: int,
    replicas: dict[str, list] | None = None,
) -> dict:  # fmt: skip
    """One setting's row: ROW_KEYS and SHAPE_KEYS plus `kind`, `attack_step` and `evidence` (`replicas`: the
    end's replicas, as `replicas_identical` reads them)."""
    if s.error and not rows:  # the harness failed before the trainer's first step: nothing of the swarm's to judge
        row = dict.fromkeys((*ROW_KEYS, *SHAPE_KEYS))  # run_stopped None: not run, which `targets` tells apart
        row.update(setting=s.name, kind=s.kind, evicted=False, steps=0, attack_step=s.attack_step)
        row["evidence"] = f"not run: the setting failed before its first step ({s.error})"
        return row
    run_stopped = rc != 0 or len(rows) < target_steps
    evicted_obs = [o for p in s.attacker_ids if (o := _evicted_at(obs, p, s.attack_t)) is not None]
    first = min(evicted_obs, key=lambda o: o.t) if evicted_obs else None
    evicted = first is not None
    row = {"setting": s.name, "kind": s.kind}
    if s.kind == "clean":
        refused, detection, evidence = None, None, "no attack"
    elif s.kind == "liar" and s.facts.get("lied") is False:
        refused, detection = None, None
        evidence = "the liar's stage gave its lie nothing to change (e.g. activations on the last stage): not tried"
    elif s.kind == "control":  # no attack: the killed volunteer's place is taken like an evicted liar's
        refused, detection, evidence = None, None, f"volunteer {s.attacker_ids[0] if s.attacker_ids else '?'} killed"
        if s.attacker_ids:  # dropped from the plan (dead), not banned: the first plan without it
            first = next((o for o in obs if o.t >= s.attack_t and o.stages and not o.in_run(s.attacker_ids[0])), None)
        evicted = False
    elif s.kind == "liar":
        refused = evicted
        detection = None if first is None else max(0, first.step - s.attack_step)
        evidence = f"liar {s.attacker_ids[0] if s.attacker_ids else '?'} " + (
            f"evicted or banned at step {first.step}" if first else "never evicted or banned"
        )
    else:
        # a stranger's attack is refused or not by its effect: its announced peers dropped from a plan for not
        # answering (liveness) is no detection of the attack
        worked, evidence = _worked(s, obs, run_stopped)
        refused = None if worked is None else not worked
        detection = None if first is None or not refused else max(0, first.step - s.attack_step)
    taker = None
    if s.kind in ("liar", "control") and first is not None and s.attacker_ids:
        taker = replacement(obs, s.attacker_ids[0], first)
    identical = replicas_identical(replicas)
    if identical is False:  # which replicas differ, and how (a step behind, or other bits): the row says it
        evidence += "; replicas at the end: " + replicas_seen(replicas)
    row.update(
        refused_or_detected=refused, detection_steps=detection, evicted=evicted, run_stopped=run_stopped,
        steps=len(rows), final_loss=final_loss(rows), held_out_loss=held_out_loss(rows), attack_step=s.attack_step,
        evidence=evidence,
        replaced_by=taker[0] if taker else None, replaced_after_steps=taker[1] if taker else None,
        replicas_identical=identical,
    )  # fmt: skip
    return row


def clean_row(
    row: dict, obs: list[Observation], rows: list[dict], no_verify_rows: list[dict] | None, batch: int
) -> dict:
    """Adds the clean row's evictions and both throughputs (no_verify_rows None: verification off was not run, its
    throughput is None and the cost target "not measured", never the clean run compared with itself)."""
    row = dict(row)
    row["evictions"] = evictions(obs)
    row["throughput_samples_s"] = throughput(rows, batch)
    row["throughput_no_verify_samples_s"] = None if no_verify_rows is None else throughput(no_verify_rows, batch)
    return row


@dataclass(frozen=True)
class Check:
    name: str
    value: str
    verdict: str
    """met, MISSED, or not measured"""


def targets(rows: list[dict]) -> list[Check]:
    """The issue's targets over the rows (verdicts as measured; a row that could not be tried is not counted)."""
    clean = next((r for r in rows if r["setting"] == "clean"), None)
    not_run = [r["setting"] for r in rows if r["run_stopped"] is None]  # the harness failed before a step
    rows = [r for r in rows if r["run_stopped"] is not None]
    attacks = [r for r in rows if r["setting"] != "clean" and r.get("kind") != "control"]  # controls: no target
    tried = [r for r in attacks if r["refused_or_detected"] is not None]
    stopped = [r["setting"] for r in attacks if not r["refused_or_detected"] or (
        r["detection_steps"] is not None and r["detection_steps"] > DETECT_WITHIN_STEPS)]  # fmt: skip
    stopped = [n for n in stopped if n in {r["setting"] for r in tried}]
    checks = [
        Check(
            f"every attack refused, or its peer evicted within {DETECT_WITHIN_STEPS} steps",
            f"{len(tried) - len(stopped)}/{len(tried)}" + (f"; not stopped: {', '.join(stopped)}" if stopped else ""),
            "met" if tried and not stopped else "MISSED" if tried else "not measured",
        ),
    ]
    halted = [r["setting"] for r in rows if r["run_stopped"] and r.get("kind") != "control"]
    checks.append(Check("the run never stops", ", ".join(halted) or "none stopped", "MISSED" if halted else "met"))
    if clean is not None and clean["final_loss"]:
        base = clean["final_loss"]
        far = [
            r["setting"]
            for r in attacks
            if r["final_loss"] is None or abs(r["final_loss"] - base) > LOSS_TOLERANCE * abs(base)
        ]
        value = f"clean {base:.4f}; " + (f"off by more than 1%: {', '.join(far)}" if far else "all within 1%")
        checks.append(Check("final loss within 1% of the clean run", value, "MISSED" if far else "met"))
        n = clean.get("evictions")
        checks.append(Check("the clean run has zero evictions", str(n), "met" if n == 0 else "MISSED"))
        on, off = clean.get("throughput_samples_s"), clean.get("throughput_no_verify_samples_s")
        if on and off:
            cost = 1.0 - on / off
            value = f"{on:.2f} vs {off:.2f} samples/s ({cost:+.1%})"
            if cost < -LOAD_NOISE:  # the run without verification was the slower one: the machine's load moved
                value += f"; verification off ran {-cost:.0%} slower, beyond the machine's noise: the load changed"
            verdict = "not measured" if cost < -LOAD_NOISE else "met" if cost <= VERIFY_COST else "MISSED"
            checks.append(Check("verification costs at most 10% of throughput", value, verdict))
        else:
            checks.append(Check("verification costs at most 10% of throughput", "no throughput", "not measured"))
    if not_run:  # say so in every verdict: a target over every attack is met only for the attacks that ran
        checks = [Check(c.name, f"{c.value}; not run: {', '.join(not_run)}",
                        f"{c.verdict} where run" if c.verdict == "met" else c.verdict) for c in checks]  # fmt: skip
    return checks


def save_plots(out: Path, curves: dict[str, list[dict]], kinds: dict[str, str]) -> list[Path]:
    """loss.png: each setting's training loss by step, stranger attacks and in-plan liars beside clean."""
    from swarm.plots import Panel, moving_average, save_line_plots

    panels = [Panel("stranger attacks", "step", "train loss"), Panel("in-plan liars", "step", "train loss", logy=True)]
    for name, rows in curves.items():
        if not rows:
            continue
        xs = [int(_float(r.get("step"))) for r in rows]
        ys = moving_average([_float(r.get("train_loss")) for r in rows], 3)
        for panel, kind in zip(panels, ("stranger", "liar"), strict=True):
            if kinds.get(name) in (kind, "clean") or (kind, kinds.get(name)) == ("liar", "control"):
                panel.series[name] = (xs, ys)
    return [save_line_plots(panels, out / "loss.png", "swarm experiment attacks: training loss")]


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def report_markdown(rows: list[dict], checks: Iterable[Check], config: dict, plots: list[str], notes: list[str]) -> str:
    cols = [*ROW_KEYS, *LOSS_KEYS, *SHAPE_KEYS, "attack_step", "owned_run", "evidence"]
    lines = [
        "# swarm experiment attacks",
        "",
        "## Targets",
        "",
        "| target | measured | verdict |",
        "| --- | --- | --- |",
    ]
    lines += [f"| {c.name} | {c.value} | {c.verdict} |" for c in checks]
    lines += ["", "## Settings", "", "| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    lines += ["| " + " | ".join(_cell(r.get(c)) for c in cols) + " |" for r in rows]
    clean = next((r for r in rows if r["setting"] == "clean"), None)
    if clean is not None:
        lines += ["", "Clean run: " + ", ".join(f"{k} {_cell(clean.get(k))}" for k in CLEAN_KEYS)]
    lines += ["", "## Configuration", ""] + [f"- {k}: {v}" for k, v in config.items()]
    lines += [""] + [f"![{p}]({p})" for p in plots]
    if notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"
