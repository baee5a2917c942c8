"""The trainer's record of its steps, in constant memory however long the run.

Each step's row goes to disk as it is made (`steps.jsonl`, one JSON object per line) and only what the
summary and the loss plot need stays in memory: running totals and two float arrays (step, loss), 16 bytes a
step. `close()` turns the lines into `steps.csv`, whose columns are the union of every row's (a counter that
first moved at step 900 still gets its column, 0 before), and removes the lines file.
"""

from __future__ import annotations

import csv
import json
from array import array
from pathlib import Path

__all__ = ["StepLog"]


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
        self.totals = {"forward_bytes": 0, "backward_bytes": 0, "fp32_wire_bytes": 0, "sync_bytes": 0}

    def add(self, row: dict) -> None:
        self._lines.write(json.dumps(row) + "\n")
        for key in row:
            if key not in self._extra and key not in self.fields:
                self._extra[key] = None
        self.count += 1
        self.steps.append(row["step"])
        self.losses.append(row["train_loss"])
        self.step_seconds.append(row["step_s"])
        for key in self.totals:
            self.totals[key] += row[key]

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
