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

__all__ = ["StepLog", "counter_columns", "load_position", "save_position", "step_columns", "step_row"]

log = logging.getLogger("swarm.train.steplog")


class StepLog:
    """Rows of `fields` (fixed columns, in order), then link and counter columns as they appear."""

    def __init__(self, out: Path, fields: list[str]):
        self.csv_path, self.fields = out / "steps.csv", fields
        self._lines_path = out / "steps.jsonl"
        self._lines = open(self._lines_path, "w")  # noqa: SIM115 - open for the log's lifetime, closed in close()
        self._extra: dict[str, None] = {}
        self.steps, self.losses = array("d"), array("d")
        self.step_seconds = array("d")
        self.count = 0
        self.totals = {
            "forward_bytes": 0, "backward_bytes": 0, "fp32_wire_bytes": 0, "sync_bytes": 0,
            "control_bytes": 0, "total_wire_bytes": 0, "fp32_total_wire_bytes": 0,
        }  # fmt: skip

    def add(self, row: dict) -> None:
        self._lines.write(json.dumps(row) + "\n")
        self._lines.flush()  # a live reader (a dashboard, the churn experiment) sees each row as it is made
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


TRAINER_FORMAT = "swarm-trainer/1"


def save_position(out: Path, step: int, epoch: int, batch: int, identity: dict) -> bool:
    """Writes where the trainer is (`trainer_state.json`: the next step, its epoch and batch within the epoch)
    atomically, with `identity` (seed, batch size, samples) that a resume must match. Returns False when the
    disk refuses (full, read-only): logged with the path and the disk, no `.tmp` left behind, the previous
    position kept (a resume starts there, as it would after a crash), and training goes on."""
    path, tmp = out / "trainer_state.json", out / "trainer_state.json.tmp"
    try:
        with open(tmp, "w") as f:
            f.write(json.dumps({"format": TRAINER_FORMAT, "step": step, "epoch": epoch, "batch": batch, **identity}))
            f.flush()
            os.fsync(f.fileno())
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


def load_position(out: Path, identity: dict) -> tuple[int, int, int] | None:
    """(step, epoch, batch) to resume at from `out`'s trainer_state.json; None without one. Raises ValueError
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
    return values[0], values[1], values[2]


def step_row(result, step: int, epoch: int) -> dict:
    """A step's row as every run records it, `swarm train` (steps.csv) and the convergence experiment alike:
    the loss, learning rate and gradient norm of `result` (a `StepResult`), and its bytes: both boundary
    directions, the tied-embedding sync, control, every byte of the step and the same tensors at fp32."""
    return {
        "step": step,
        "epoch": epoch,
        "train_loss": result.loss,
        "lr": result.lr,
        "grad_norm": result.grad_norm,
        "forward_bytes": result.forward_bytes,
        "backward_bytes": result.backward_bytes,
        "sync_bytes": result.sync_bytes,
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
