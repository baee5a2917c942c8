"""The trainer's record of its steps, in constant memory however long the run, and where it is (to resume).

Each step's row goes to disk as it is made (`steps.jsonl`, one JSON object per line) and only what the
summary and the loss plot need stays in memory: running totals and two float arrays (step, loss), 16 bytes a
step. `close()` turns the lines into `steps.csv`, whose columns are the union of every row's (a counter that
first moved at step 900 still gets its column, 0 before), and removes the lines file.
"""

from __future__ import annotations

import contextlib
import csv
import json
import logging
import os
from array import array
from pathlib import Path

from swarm.runtime.checkpoint import describe_disk

__all__ = [
    "StepLog",
    "counter_columns",
    "load_position",
    "machine_cpu",
    "machine_cpu_s",
    "load_state",
    "save_position",
    "step_columns",
    "step_row",
    "step_spans",
]

log = logging.getLogger("swarm.train.steplog")


class StepLog:
    """Rows of `fields` (fixed columns, in order), then link and counter columns as they appear.

    `resume_at`: the run resumes with its step `resume_at` (0-based; rows number steps from 1): the rows of
    steps 1..resume_at that earlier lives wrote are kept (and counted in the totals, so the summary and the plot
    cover the whole run), later ones dropped. None: a fresh run, whatever the folder held."""

    def __init__(self, out: Path, fields: list[str], resume_at: int | None = None):
        self.csv_path, self.fields = out / "steps.csv", fields
        self._lines_path = out / "steps.jsonl"
        kept = _earlier_rows(out, resume_at) if resume_at is not None else []
        if resume_at is not None:
            tmp = out / "steps.jsonl.tmp"  # replaced whole: a kill now leaves the old files, read again next time
            tmp.write_text("".join(json.dumps(row) + "\n" for row in kept))
            os.replace(tmp, self._lines_path)
            self.csv_path.unlink(missing_ok=True)  # its rows are in the lines now
        self._lines = open(self._lines_path, "a" if resume_at is not None else "w")  # noqa: SIM115 - closed in close()
        self._extra: dict[str, None] = {}
        self.steps, self.losses = array("d"), array("d")
        self.step_seconds = array("d")
        self.count = 0
        self.totals = {
            "forward_bytes": 0, "backward_bytes": 0, "fp32_wire_bytes": 0, "sync_bytes": 0,
            "control_bytes": 0, "total_wire_bytes": 0, "fp32_total_wire_bytes": 0,
        }  # fmt: skip
        for row in kept:
            self._count(row)

    def has(self, step: int) -> bool:
        """Whether the row of `step` (numbered from 1, as in steps.csv) is in the log."""
        return step in self.steps  # once, at a resume: a scan is cheap enough

    def add(self, row: dict) -> None:
        self._lines.write(json.dumps(row) + "\n")
        self._lines.flush()  # a live reader (a dashboard, the churn experiment) sees each row as it is made
        self._count(row)

    def _count(self, row: dict) -> None:
        for key in row:
            if key not in self._extra and key not in self.fields:
                self._extra[key] = None
        self.count += 1
        self.steps.append(row["step"])
        self.losses.append(row["train_loss"])
        self.step_seconds.append(row["step_s"])
        for key in self.totals:
            self.totals[key] += row.get(key, 0)

    @property
    def wire_bytes(self) -> int:
        return self.totals["forward_bytes"] + self.totals["backward_bytes"]

    def close(self) -> Path:
        """Writes steps.csv from the lines (one row in memory at a time) and returns its path."""
        self._lines.close()
        links = sorted(k for k in self._extra if k.startswith("link"))
        counters = sorted(k for k in self._extra if not k.startswith("link"))
        with open(self.csv_path, "w", newline="") as f, open(self._lines_path) as lines:
            writer = csv.DictWriter(f, self.fields + links + counters, restval=0)
            writer.writeheader()
            for line in lines:
                writer.writerow(json.loads(line))
        self._lines_path.unlink()
        return self.csv_path


def _earlier_rows(out: Path, resume_at: int) -> list[dict]:
    """The rows of steps 1..resume_at that earlier lives of the run wrote, in step order, each step once: those of
    a closed steps.csv, then the lines of a life that was killed (its last line may be cut short: skipped)."""
    rows: dict[int, dict] = {}
    csv_path, lines_path = out / "steps.csv", out / "steps.jsonl"
    if csv_path.exists():
        with open(csv_path, newline="") as f:
            for row in csv.DictReader(f):
                parsed = {k: _cell(v) for k, v in row.items() if k is not None}
                if type(parsed.get("step")) is int:
                    rows[parsed["step"]] = parsed
    if lines_path.exists():
        with open(lines_path) as f:
            for line in f:
                try:
                    row = json.loads(line)
                except ValueError:
                    log.warning("%s: a row cut short by a kill is dropped: %.80s", lines_path, line)
                    continue
                if isinstance(row, dict) and type(row.get("step")) is int:
                    rows[row["step"]] = row
    return [rows[k] for k in sorted(rows) if 1 <= k <= resume_at]


def _cell(text: str):
    """A steps.csv cell as the row held it: an int, a float, or the text (sample ids, peers, the setting)."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


TRAINER_FORMAT = "swarm-trainer/1"


def save_position(out: Path, step: int, epoch: int, batch: int, identity: dict, durable: bool = True, **extra) -> bool:
    """Writes where the trainer is (`trainer_state.json`: the next step, its epoch and batch within the epoch,
    and `extra` fields: the trainer's journal, `swarm.train.journal`) atomically, with `identity` (seed, batch
    size, samples) that a resume must match. `durable` False skips the fsync: the rename alone survives a kill
    of the process (not a power cut) at a fraction of the cost. Returns False when the disk refuses (full,
    read-only): logged with the path and the disk, no `.tmp` left behind, the previous position kept (a resume
    starts there, as it would after a crash), and training goes on."""
    path, tmp = out / "trainer_state.json", out / "trainer_state.json.tmp"
    state = {"format": TRAINER_FORMAT, "step": step, "epoch": epoch, "batch": batch, **identity, **extra}
    try:
        write_state(tmp, json.dumps(state), durable)
        os.replace(tmp, path)
        return True
    except OSError as e:
        log.error(
            "trainer position %s (step %d) not written: %s (%s); the previous one is kept", path, step, e,
            describe_disk(path),
        )  # fmt: skip
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        return False


def write_state(tmp: Path, text: str, durable: bool) -> None:
    """Writes `text` to the temporary file `tmp` (fsynced when `durable`) before it is renamed into place."""
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        if durable:
            os.fsync(f.fileno())


def load_position(out: Path, identity: dict) -> tuple[int, int, int] | None:
    """(step, epoch, batch) to resume at from `out`'s trainer_state.json; None without one. Raises ValueError
    if it belongs to another run (other seed, batch size or samples) or is not a trainer state."""
    state = load_state(out, identity)
    return None if state is None else (state["step"], state["epoch"], state["batch"])


def load_state(out: Path, identity: dict) -> dict | None:
    """`out`'s trainer_state.json, checked (its position and `identity`); None without one. Raises ValueError
    if it belongs to another run (other seed, batch size or samples) or is not a trainer state."""
    path = out / "trainer_state.json"
    if not path.exists():
        return None
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not readable: {e}") from None
    if not isinstance(state, dict) or state.get("format") != TRAINER_FORMAT:
        raise ValueError(f"{path} is not a trainer state ({TRAINER_FORMAT})")
    other = {k: (state.get(k), v) for k, v in identity.items() if state.get(k) != v}
    if other:
        raise ValueError(f"{path} is another run's: " + ", ".join(f"{k} {a} (now {b})" for k, (a, b) in other.items()))
    values = [state.get(k) for k in ("step", "epoch", "batch")]
    if not all(type(v) is int and v >= 0 for v in values):
        raise ValueError(f"{path}: step, epoch and batch must be integers >= 0, got {values}")
    return state


def step_row(result, step: int, epoch: int) -> dict:
    """A step's row as every run records it, `swarm train` (steps.csv) and the convergence experiment alike:
    the loss, learning rate and gradient norm of `result` (a `StepResult`), and its bytes: both boundary
    directions, the tied-embedding sync, the replicas' gradient sums, control, every byte of the step and the same
    tensors at fp32."""
    return {
        "step": step,
        "epoch": epoch,
        "train_loss": result.loss,
        "lr": result.lr,
        "grad_norm": result.grad_norm,
        "forward_bytes": result.forward_bytes,
        "backward_bytes": result.backward_bytes,
        "sync_bytes": result.sync_bytes,
        "reduce_bytes": result.reduce_bytes,
        "control_bytes": result.control_bytes,
        "total_wire_bytes": result.total_wire_bytes,
        "fp32_total_wire_bytes": result.fp32_total_wire_bytes,
    }


def step_columns(result, sample_ids: tuple[int, ...], routes: int, retries: int = 0) -> dict:
    """The churn columns of a step row: the applied step's samples (space-separated ids, each once), the
    attempts it took, the peers declared dead during it, and the live routes it ran on (column `chains`). A
    driver without replicas reports none of these: one attempt on one route, the batch's samples. `retries`: the
    trainer's own re-runs of the step on a newer plan, counted as attempts too."""
    return {
        "attempts": int(getattr(result, "attempts", 1)) + retries,
        "chains": int(getattr(result, "routes", routes)),
        "dead_peers": " ".join(getattr(result, "dead_peers", ())),
        "sample_ids": " ".join(str(int(i)) for i in sample_ids),
    }


def counter_columns(counters: dict[str, float]) -> dict[str, float | int]:
    """steps.csv columns for what the driver's counters gained in a step, named as Prometheus names them
    (`swarm_wire_bytes_total{direction=forward,link=0}`), so a new counter is a new column."""
    return {k.replace('"', ""): int(v) if float(v).is_integer() else v for k, v in counters.items()}


def machine_cpu_s() -> float | None:
    """The whole machine's busy CPU-seconds since boot (user, nice, system, irq, softirq, steal: every core's,
    every process's, this run's or not; psutil), None where the system does not say. Read at each step's end into
    the step's row (`machine_cpu_s`): the difference between two rows is what the machine spent between them."""
    try:
        import psutil

        t = psutil.cpu_times()
    except Exception:  # no psutil, or no such counters here: the column stays empty
        return None
    return sum(getattr(t, k, 0.0) for k in ("user", "nice", "system", "irq", "softirq", "steal"))


def step_spans(rows: list[dict]) -> list[tuple[float, float, float]]:
    """The steps of `rows` (each with `time`, unix s, and `machine_cpu_s` at its end) after the first, as (start, end,
    the machine's CPU-seconds between): each from the row before it to its own, both rows carrying both readings;
    none after a row with a `held_out_loss` (the evaluation ran in that interval)."""
    read = [
        (float(r["time"]), float(r["machine_cpu_s"]), bool(r.get("held_out_loss") not in (None, "")))
        if r.get("time") and r.get("machine_cpu_s")
        else None
        for r in rows
    ]
    pairs = zip(read, read[1:], strict=False)  # each row with the one before it
    return [(a[0], b[0], b[1] - a[1]) for a, b in pairs if a is not None and b is not None and not a[2]]


def machine_cpu(rows: list[dict], cores: int | None = None) -> dict:
    """What the machine's CPU spent on `rows`' steps (each with `time`, unix s, and `machine_cpu_s` at its end,
    as `machine_cpu_s` reads them), over each row's interval from the one before it: `cpu_ms_per_step` (every
    process's, the run's own and anything else running), `busy_cores` (its mean rate), `wall_s_per_step` (the
    steps with what ran between them) and `cpu_floor_step_s`, the step no schedule could beat on `cores` (default:
    this machine's) at that much CPU a step. An interval after a row with a `held_out_loss` is left out (the
    evaluation ran in it). Empty without two consecutive rows that carry both."""
    spans = step_spans(rows)
    wall, cpu = sum(end - start for start, end, _ in spans), sum(c for _, _, c in spans)
    if not spans or wall <= 0:
        return {}
    cores = cores or os.cpu_count() or 1
    per_step = cpu / len(spans)
    return {
        "cpu_ms_per_step": 1000 * per_step,
        "wall_s_per_step": wall / len(spans),
        "busy_cores": cpu / wall,
        "cpu_floor_step_s": per_step / cores,
        "cores": cores,
    }
