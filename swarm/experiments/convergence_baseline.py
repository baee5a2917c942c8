"""`swarm experiment convergence --baseline DIR`: the fp32 row of an earlier run of the same experiment, read back
instead of trained again, so that the settings of one long run can train in parallel processes (one per core or
machine), each compared with the one fp32 run. The earlier run must have the same config (settings aside) and the
same data (`corpus_digest`, `windows_digest`): the ratios and loss gaps are only meaningful against the same
baseline. The baseline is the run's own output files, plain CSV and JSON: nothing is unpickled."""

from __future__ import annotations

import csv
import json
from dataclasses import asdict, replace
from pathlib import Path

from swarm.model.data import DataReport

__all__ = ["BASELINE", "load_baseline", "comparable_config"]

BASELINE = "fp32/fp32"
"""The setting a baseline directory must hold."""


def comparable_config(cfg, jsonable) -> dict:
    """`cfg` as results.json records it, settings left out, through a JSON round trip (tuples become lists)."""
    return json.loads(json.dumps(jsonable(asdict(replace(cfg, settings=())))))


def load_baseline(directory: Path, cfg, report: DataReport, jsonable, result_type, setting):
    """The fp32 `SettingResult` of the run in `directory` (results.json, losses.csv, eval.csv).

    Args:
        directory: an earlier run's output folder that trained `fp32/fp32`.
        cfg: this run's `ExperimentConfig`; every field but `settings` must equal the earlier run's.
        report: this run's data report; its corpus and windows digests must equal the earlier run's.
        jsonable, result_type, setting: the experiment's `_jsonable`, `SettingResult` and parsed fp32 `Setting`.

    Raises:
        ValueError: naming the file and the first field that differs, or a missing baseline.
    """
    if not (directory / "results.json").is_file():
        raise ValueError(f"baseline {directory}: no results.json (not the output folder of a convergence run)")
    saved = json.loads((directory / "results.json").read_text())
    ours, theirs = comparable_config(cfg, jsonable), dict(saved["config"], settings=[])
    for key in sorted(set(ours) | set(theirs)):
        if ours.get(key) != theirs.get(key):
            raise ValueError(
                f"baseline {directory}/results.json: config field {key!r} is {theirs.get(key)!r}, this run's is "
                f"{ours.get(key)!r}"
            )
    data = saved.get("data_report", {})
    for key in ("corpus_digest", "windows_digest"):
        if data.get(key) != getattr(report, key):
            raise ValueError(f"baseline {directory}/results.json: {key} differs from this run's data")
    rows = [r for r in saved["rows"] if r["setting"] == BASELINE]
    if not rows:
        raise ValueError(f"baseline {directory}/results.json has no {BASELINE} row")
    result = result_type(setting)
    result.steps = [_numbers(r) for r in _read_csv(directory / "losses.csv") if r["setting"] == BASELINE]
    result.evals = [_numbers(r) for r in _read_csv(directory / "eval.csv") if r["setting"] == BASELINE]
    if len(result.steps) != rows[0]["steps"] or not result.evals:
        raise ValueError(f"baseline {directory}: losses.csv has {len(result.steps)} fp32 steps, results.json says "
                         f"{rows[0]['steps']}")  # fmt: skip
    result.seconds, result.max_sample_visits = rows[0]["seconds"], rows[0]["max_sample_visits"]
    return result


def _read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _numbers(row: dict) -> dict:
    """A CSV row's values as the run wrote them: ints stay ints (byte counts, steps), the rest floats."""
    out = {}
    for key, value in row.items():
        if key == "setting":
            continue
        try:
            out[key] = int(value)
        except ValueError:
            out[key] = float(value)
    return out
