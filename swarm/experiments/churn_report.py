"""What a churn run measured, from its files: sample accounting, recovery times, throughput, the targets.

Pure functions over the trainer's steps.csv rows, the churn controller's events and the step clock's
lines, so they are unit-tested from synthetic files. A column the trainer does not write yet (`sample_ids`
before replicas land) gives "not measured" (None), never a zero.
"""

from __future__ import annotations

import csv
import json
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "BYTES_TARGET",
    "ROW_KEYS",
    "SampleAccount",
    "Target",
    "account_samples",
    "byte_split",
    "completion_times",
    "expected_batches",
    "loss_agreement",
    "read_jsonl",
    "read_steps",
    "recovery_times",
    "report_markdown",
    "summarize",
    "targets",
]

ROW_KEYS = [
    "setting",
    "steps",
    "samples_lost",
    "samples_duplicated",
    "kills",
    "joins",
    "recovery_s_median",
    "recovery_s_max",
    "throughput_samples_s",
    "final_loss",
    "final_loss_mean20",
    "wire_bytes",
    "total_wire_bytes",
    "fp32_total_wire_bytes",
    "tensor_ratio_vs_fp32",
    "state_bytes",
]
BYTES_TARGET = 20.0
"""Issue 29's target: the no-churn setting sends at least this many times fewer bytes in all than the same tensors
would at fp32 (5.7x with the 8-bit replicas' sums of before; docs/reports/replicas.md has the 2-bit sum's runs)."""
TIME_COLUMNS = ("time", "unix_time", "wall_time", "t")
"""steps.csv columns taken as a step's completion time (unix seconds), first found wins."""
FINAL_LOSS_STEPS = 5
"""final_loss is the mean of the last this many steps' losses (as `swarm train`'s summary)."""
MEAN20_STEPS = 20
"""final_loss_mean20: the mean of the last 20 steps' losses, less noisy than final_loss (shown beside it)."""
SAME_LOSS_TOL = 1e-6
"""Largest |loss difference| between the settings at a step before the first kill that still counts as the
same computation (steps.csv holds float32 losses printed as Python floats)."""


def read_steps(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def expected_batches(steps: int, batch_size: int, train_samples: int, seed: int, seq_len_tokens: int, data=None):
    """The sample ids of steps 1..`steps` (the trainer's `step` column) in the order `swarm train` draws them:
    the same data set and seeded epoch shuffle (swarm.model.data)."""
    from swarm.model.data import DataConfig, build_datasets, epoch_batches

    cfg = DataConfig(path=data, seq_len_tokens=seq_len_tokens, train_samples=train_samples, eval_samples=0)
    train_set, _, _ = build_datasets(cfg)
    out: list[tuple[int, ...]] = []
    epoch = 0
    while len(out) < steps:
        for batch in epoch_batches(train_set, batch_size, epoch, seed):
            if len(out) == steps:
                break
            out.append(tuple(int(i) for i in batch.sample_ids.tolist()))
        epoch += 1
    return out


@dataclass(frozen=True)
class SampleAccount:
    """Every sample of every step's batch, trained exactly once? None: the trainer does not log sample ids."""

    lost: int | None
    """Expected (step, sample) pairs never applied."""
    duplicated: int | None
    """Applied (step, sample) pairs beyond the expected count (a step or a sample applied twice)."""
    unexpected: int | None
    """Applied pairs that no expected batch holds (a sample trained in another step's place)."""
    why: str = ""

    @property
    def measured(self) -> bool:
        return self.lost is not None


def account_samples(rows: Sequence[dict], expected: Sequence[Sequence[int]]) -> SampleAccount:
    """Compares the applied steps' `sample_ids` (space-separated, one row per applied step, `step` 1-based)
    with `expected[step - 1]`."""
    if not rows:
        lost = sum(len(b) for b in expected)
        return SampleAccount(lost, 0, 0, "no step was applied")
    if "sample_ids" not in rows[0]:
        return SampleAccount(None, None, None, "not measured: the trainer's steps.csv has no sample_ids column")
    want = Counter((k + 1, i) for k, batch in enumerate(expected) for i in batch)
    seen = Counter((int(r["step"]), int(i)) for r in rows for i in str(r["sample_ids"]).split())
    lost = sum(max(0, n - seen[key]) for key, n in want.items())
    duplicated = sum(max(0, n - want[key]) for key, n in seen.items() if key in want)
    unexpected = sum(n for key, n in seen.items() if key not in want)
    return SampleAccount(lost, duplicated, unexpected)


def completion_times(rows: Sequence[dict], clock: Sequence[dict]) -> list[float | None]:
    """Unix time each row's step completed: the row's own time column if it has one, else the step clock's
    first scrape that counted that many steps (row i is the trainer's (i+1)-th completed step)."""
    column = next((c for c in TIME_COLUMNS if rows and c in rows[0]), None)
    if column is not None:
        return [float(r[column]) if r.get(column) not in (None, "") else None for r in rows]
    times: list[float | None] = []
    marks = sorted((int(c["steps"]), float(c["t"])) for c in clock)
    for n in range(1, len(rows) + 1):
        times.append(next((t for steps, t in marks if steps >= n), None))
    return times


def recovery_times(leave_times: Sequence[float], done: Sequence[float]) -> list[float | None]:
    """Seconds from each leave to the next completed step; None where no step completed after it."""
    ordered = sorted(done)
    return [next((d - t for d in ordered if d > t), None) for t in leave_times]


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(
    setting: str,
    rows: Sequence[dict],
    events: Sequence[dict],
    clock: Sequence[dict],
    expected: Sequence[Sequence[int]],
    batch_size: int,
    target_steps: int,
    state: int | None = None,
) -> dict:
    """One row of the experiment's table (ROW_KEYS first, then the details the report uses); `state`: the GetState
    bytes its peers sent (`swarm.metrics.logged_state_bytes`), in the totals.

    A run that ended before `target_steps` is accounted over the steps it trained: the samples of steps never
    run are `samples_not_run`, not lost (the "all steps trained" target fails instead). `expected` may run past
    `target_steps` (a setting ended on purpose): a finished run is accounted up to its last step."""
    trained = max((int(r["step"]) for r in rows), default=0)
    finished = len(rows) >= target_steps
    account = account_samples(rows, expected[: max(trained, target_steps)] if finished else expected[:trained])
    not_run = 0 if finished else sum(len(b) for b in expected[trained:target_steps])
    done = [t for t in completion_times(rows, clock) if t is not None]
    leaves = [e for e in events if e.get("kind") in ("kill", "term")]
    if finished and done:  # a leave after the last step has nothing left to recover
        leaves = [e for e in leaves if e["t"] < max(done)]
    recovery = recovery_times([e["t"] for e in leaves], done)
    got = [r for r in recovery if r is not None]
    by_class = {"replica": [], "takeover": []}
    for e, r in zip(leaves, recovery, strict=True):
        if r is not None and e.get("replicas_left") is not None:
            by_class["replica" if e["replicas_left"] > 0 else "takeover"].append(r)
    throughput = (
        (len(done) - 1) * batch_size / (max(done) - min(done)) if len(done) >= 2 and max(done) > min(done) else None
    )
    losses = [float(r["train_loss"]) for r in rows]
    tail = losses[-FINAL_LOSS_STEPS:]
    wire = sum(int(float(r.get("forward_bytes") or 0)) + int(float(r.get("backward_bytes") or 0)) for r in rows)
    wire += sum(int(float(r.get("reduce_bytes") or 0)) for r in rows)
    split = byte_split(rows, state)
    return {
        "setting": setting,
        "steps": len(rows),
        "samples_lost": account.lost,
        "samples_duplicated": account.duplicated,
        "kills": sum(1 for e in events if e.get("kind") == "kill"),
        "joins": sum(1 for e in events if e.get("kind") == "join"),
        "recovery_s_median": _median(got),
        "recovery_s_max": (max(got) if got else None) if len(got) == len(recovery) else None,
        "throughput_samples_s": throughput,
        "final_loss": sum(tail) / len(tail) if tail else None,
        "final_loss_mean20": statistics.fmean(losses[-MEAN20_STEPS:]) if losses else None,
        "wire_bytes": wire,
        **split,
        "terms": sum(1 for e in events if e.get("kind") == "term"),
        "samples_unexpected": account.unexpected,
        "samples_not_run": not_run,
        "accounting": account.why or "by sample id",
        "unrecovered": len(recovery) - len(got),
        "leaves": len(leaves),
        "recovery_s_median_replica": _median(by_class["replica"]),
        "recovery_s_median_takeover": _median(by_class["takeover"]),
        "target_steps": target_steps,
        # the trainer's reroute columns (issue 12), None where it does not write them
        "retried_steps": sum(1 for r in rows if int(r["attempts"] or 1) > 1)
        if rows and "attempts" in rows[0]
        else None,
        "dead_peers": len({p for r in rows for p in str(r.get("dead_peers") or "").split() if p != "0"})
        if rows and "dead_peers" in rows[0]
        else None,
    }


def _column(rows: Sequence[dict], key: str) -> int:
    return sum(int(float(r.get(key) or 0)) for r in rows)


def byte_split(rows: Sequence[dict], state: int | None = None) -> dict:
    """Every byte of the run (steps.csv's `total_wire_bytes`, plus `state`: the GetState bytes the peers sent,
    `swarm.metrics.logged_state_bytes`) and its fp32 equivalent, and the split: boundaries (both directions), the
    tied sum, control, the replicas' sums (the trainer's `direction=average` counter columns; where it wrote none,
    the rest of the trainer's total) and the state the peers moved (held copies, takeovers, joiners: fp32 whatever
    the codecs, so in both totals alike). None where the trainer wrote no totals; `state_bytes` None where it was
    not read."""
    if not rows or "total_wire_bytes" not in rows[0]:
        keys = ("total_wire_bytes", "fp32_total_wire_bytes", "tensor_ratio_vs_fp32", "state_bytes", "boundary_bytes")
        return dict.fromkeys((*keys, "tied_bytes", "control_bytes", "replica_sum_bytes"), None)
    total, boundary = (
        _column(rows, "total_wire_bytes"),
        _column(rows, "forward_bytes") + _column(rows, "backward_bytes"),
    )
    tied, control = _column(rows, "sync_bytes"), _column(rows, "control_bytes")
    average = [k for k in rows[0] if k.startswith("swarm_wire_bytes_total{") and "direction=average" in k]
    fp32 = _column(rows, "fp32_total_wire_bytes")
    summed = sum(_column(rows, k) for k in average) if average else total - boundary - tied - control
    moved = state or 0
    return {
        "total_wire_bytes": total + moved,
        "fp32_total_wire_bytes": fp32 + moved,
        # both totals carry the same control bytes (audits' fp32 records, calls): the ratio of what the codecs carry
        "tensor_ratio_vs_fp32": (fp32 - control) / (total - control) if total > control else None,
        "state_bytes": state,
        "boundary_bytes": boundary,
        "tied_bytes": tied,
        "control_bytes": control,
        "replica_sum_bytes": summed,
    }


def loss_agreement(base: Sequence[dict], churn: Sequence[dict], events: Sequence[dict]) -> dict:
    """How far the churn setting's losses are from the no-churn setting's at the steps it completed before
    its first leave (kill or term) and before the two settings' plans part: both settings run the same
    computation until then, by design. A plan can part before the first kill without one: on a loaded machine a
    peer's DHT record can lapse and the planner repair around it. From that step on the routes differ, and so do
    the losses, so the comparison stops there and says where (the rows' `plan_version`; rows without it are
    compared until the leave).

    Returns {"prekill_steps": steps compared, "prekill_max_loss_diff": the largest |difference| (None: no
    step to compare), "prekill_first_diff_step": the first step differing by more than SAME_LOSS_TOL,
    "prekill_plan_parted_step": the first step the settings ran on different plans (None: they did not)}."""
    leaves = [float(e["t"]) for e in events if e.get("kind") in ("kill", "term")]
    first = min(leaves) if leaves else float("inf")
    times = completion_times(churn, [])
    by_step = {int(r["step"]): r for r in base}
    parted = None
    diffs = []
    for r, t in zip(churn, times, strict=True):
        step = int(r["step"])
        if t is None or t >= first or step not in by_step:
            continue
        if _plan(r) != _plan(by_step[step]):
            parted = step
            break
        diffs.append((step, abs(float(r["train_loss"]) - float(by_step[step]["train_loss"]))))
    over = [step for step, d in diffs if d > SAME_LOSS_TOL]
    return {
        "prekill_steps": len(diffs),
        "prekill_max_loss_diff": max((d for _, d in diffs), default=None),
        "prekill_first_diff_step": over[0] if over else None,
        "prekill_plan_parted_step": parted,
    }


def _plan(row: dict) -> str | None:
    value = row.get("plan_version")
    return None if value in (None, "") else str(int(float(value)))


@dataclass(frozen=True)
class Target:
    name: str
    value: str
    passed: bool | None
    """None: not measured in this run (no such event, or no such column)."""

    @property
    def verdict(self) -> str:
        return {True: "PASS", False: "FAIL", None: "not measured"}[self.passed]


def _fmt(value, spec: str = ".3g") -> str:
    return "-" if value is None else format(value, spec)


def targets(rows: Sequence[dict], kill_every_s: float | None = None, schedule: str | None = None) -> list[Target]:
    """Issue 12's targets over the rows (`no-churn` and `churn`), reported as measured, never adjusted.
    `schedule` names the churn in words ("a kill every 150 steps"); by default from `kill_every_s`."""
    out = []
    for r in rows:
        lost, dup, unexp = r["samples_lost"], r["samples_duplicated"], r.get("samples_unexpected")
        if lost is None:
            out.append(Target(f"{r['setting']}: zero samples lost or duplicated", r["accounting"], None))
        else:
            ok = lost == 0 and dup == 0 and not unexp
            out.append(
                Target(
                    f"{r['setting']}: zero samples lost or duplicated",
                    f"lost {lost}, duplicated {dup}, unexpected {unexp}",
                    ok,
                )
            )
        if r["steps"] < r.get("target_steps", r["steps"]):
            value = f"{r['steps']} of {r['target_steps']}"
            value += f" ({r['samples_not_run']} samples not run)" if r.get("samples_not_run") else ""
            out.append(Target(f"{r['setting']}: all steps trained", value, False))
    by = {r["setting"]: r for r in rows}
    churn, base = by.get("churn"), by.get("no-churn")
    if base is not None and base.get("total_wire_bytes"):
        ratio = base["fp32_total_wire_bytes"] / base["total_wire_bytes"]
        mb = lambda key: f"{base[key] / 1e6:.1f} MB"  # noqa: E731
        parts = ("boundary_bytes", "tied_bytes", "replica_sum_bytes", "control_bytes", "state_bytes")
        other = base["total_wire_bytes"] - sum(base[k] or 0 for k in parts)
        state = "not read" if base.get("state_bytes") is None else mb("state_bytes")
        out.append(
            Target(
                f"no-churn: >= {BYTES_TARGET:g}x fewer total bytes than fp32",
                f"{ratio:.1f}x ({mb('total_wire_bytes')} of {mb('fp32_total_wire_bytes')}: boundaries "
                f"{mb('boundary_bytes')}, tied sum {mb('tied_bytes')}, replicas' sums {mb('replica_sum_bytes')}, "
                f"control {mb('control_bytes')}, stage state moved {state}, other {other / 1e6:.1f} MB; tensors alone "
                f"{base.get('tensor_ratio_vs_fp32') or 0:.1f}x)",
                ratio >= BYTES_TARGET,
            )
        )
    if churn is not None:
        for key, bound, label in (
            ("replica", 10.0, "while a replica survives"),
            ("takeover", 30.0, "via standby + checkpoint"),
        ):
            median = churn.get(f"recovery_s_median_{key}")
            name = f"churn: median recovery {label} < {bound:g} s"
            out.append(
                Target(
                    name,
                    f"{_fmt(median)} s" if median is not None else "no such leave",
                    None if median is None else median < bound,
                )
            )
        if churn.get("unrecovered"):
            out.append(
                Target("churn: every leave recovered", f"{churn['unrecovered']} leaves with no step after them", False)
            )
    if churn is not None and base is not None and not churn["leaves"]:
        why = "no leave happened during training"
        out.append(Target("throughput under churn >= 70% of no-churn", why, None))
        out.append(Target("final loss under churn within 2% of no-churn", why, None))
    elif churn is not None and base is not None:
        every = schedule or (f"a kill every {kill_every_s:g} s" if kill_every_s else "the schedule's kills")
        tc, tb = churn["throughput_samples_s"], base["throughput_samples_s"]
        ratio = tc / tb if tc is not None and tb else None
        ended = churn["steps"] < churn.get("target_steps", churn["steps"])
        note = "" if kill_every_s == 60 or schedule else " (target is stated for a kill every 60 s)"
        out.append(
            Target(
                f"throughput with {every} >= 70% of no-churn{note}",
                f"{_fmt(ratio, '.1%')}" + (f" until the run ended at step {churn['steps']}" if ended else ""),
                None if ratio is None else ratio >= 0.7 and not ended,
            )
        )
        if churn.get("prekill_steps"):
            diff, n = churn["prekill_max_loss_diff"], churn["prekill_steps"]
            first, parted = churn.get("prekill_first_diff_step"), churn.get("prekill_plan_parted_step")
            out.append(
                Target(
                    f"experiment: churn loss = no-churn loss at each step before the first kill"
                    f" (|d| <= {SAME_LOSS_TOL:g})",
                    f"max |d| {diff:.3g} over {n} steps"
                    + (f"; first differs at step {first}" if first else "")
                    + (f"; plans parted at step {parted} (compared until then)" if parted else ""),
                    diff <= SAME_LOSS_TOL,
                )
            )
        m20c, m20b = churn.get("final_loss_mean20"), base.get("final_loss_mean20")
        lc, lb = churn["final_loss"], base["final_loss"]
        same = churn["steps"] == base["steps"]
        rel = abs(lc - lb) / abs(lb) if lc is not None and lb else None
        value = f"{_fmt(rel, '.2%')}" + ("" if same else f" (steps differ: {churn['steps']} vs {base['steps']})")
        rel20 = abs(m20c - m20b) / abs(m20b) if m20c is not None and m20b else None
        value += f"; mean of the last {MEAN20_STEPS} steps: {_fmt(rel20, '.2%')}"
        out.append(Target("final loss within 2% of no-churn", value, None if rel is None else (rel <= 0.02 and same)))
    return out


def report_markdown(rows: Sequence[dict], checks: Sequence[Target], config: dict, plots: Sequence[str]) -> str:
    lines = ["# Churn experiment", "", "Configuration: " + ", ".join(f"{k} {v}" for k, v in config.items()), ""]
    lines += ["| " + " | ".join(ROW_KEYS) + " |", "|" + " --- |" * len(ROW_KEYS)]
    for r in rows:
        cells = []
        for key in ROW_KEYS:
            v = r[key]
            cells.append(
                "not measured"
                if v is None and key.startswith("samples_")
                else _fmt(v, ".4g")
                if isinstance(v, float)
                else _fmt(v, "")
            )
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## Targets", "", "| target | measured | verdict |", "| --- | --- | --- |"]
    lines += [f"| {c.name} | {c.value} | {c.verdict} |" for c in checks]
    lines += [
        "",
        f"final_loss: the mean training loss of the last {FINAL_LOSS_STEPS} steps (as `swarm train`'s summary); "
        f"final_loss_mean20: of the last {MEAN20_STEPS} steps, less noisy. The 2% target is judged on final_loss.",
        "",
        "Recovery: seconds from a kill or term to the trainer's next completed step. "
        "Leaves where another replica of the stage was serving count as 'while a replica survives', the "
        "others as 'via standby + checkpoint'.",
        "",
    ]
    for r in rows:
        lines.append(
            f"- {r['setting']}: accounting {r['accounting']}; terms {r['terms']}; "
            f"recovery median while a replica survives {_fmt(r['recovery_s_median_replica'])} s, "
            f"via takeover {_fmt(r['recovery_s_median_takeover'])} s; unrecovered leaves {r['unrecovered']}; "
            f"steps run more than once {_fmt(r['retried_steps'], '')}; peers the trainer declared dead "
            f"{_fmt(r['dead_peers'], '')}"
        )
    lines += [
        "",
        "Plots: " + ", ".join(plots),
        "Files per setting: steps.csv, events.jsonl, step_clock.jsonl, logs/.",
        "",
    ]
    return "\n".join(lines)
