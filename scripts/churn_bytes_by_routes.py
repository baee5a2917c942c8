"""The byte split of one `swarm train` steps.csv by how many routes each step ran on (a churn run whose trainer fell
back to one route under load has no replicas' sums and no audits in those steps: its whole-run ratio is not the
replicated one).

Usage: python scripts/churn_bytes_by_routes.py RUN/no-churn/trainer/steps.csv [FIRST_STEP]
  (or steps.jsonl, which the trainer appends to while it runs: the split of a run still going)
  FIRST_STEP: count only steps from this one on (e.g. 17: after the first sights of 64 samples at batch 8, two
  epochs). Prints one line per route count and one for all steps: MB sent, fp32 MB, the ratio, the split
  (boundaries, tied sum, replicas' sums, control) and the ratio of the tensors alone (both totals less control);
  then the control bytes of all those steps by call method (the `swarm_control_call_bytes_total{method=...}`
  columns, where the run has them).
"""

import csv
import json
import sys

with open(sys.argv[1]) as f:
    if sys.argv[1].endswith(".jsonl"):
        rows = [{k: str(v) for k, v in json.loads(line).items()} for line in f if line.strip()]
    else:
        rows = list(csv.DictReader(f))
first = int(sys.argv[2]) if len(sys.argv) > 2 else 0
rows = [r for r in rows if int(r["step"]) >= first]


def number(r: dict, key: str) -> float:
    return float(r.get(key) or 0)


def line(name: str, sel: list[dict]) -> None:
    if not sel:
        return
    total, fp32 = (sum(number(r, k) for r in sel) for k in ("total_wire_bytes", "fp32_total_wire_bytes"))
    sums = sum(number(r, k) for r in sel for k in r if "direction=average" in k)
    boundaries = sum(number(r, "forward_bytes") + number(r, "backward_bytes") for r in sel)
    tied, control = (sum(number(r, k) for r in sel) for k in ("sync_bytes", "control_bytes"))
    tensors = (fp32 - control) / (total - control) if total > control else float("nan")
    print(
        f"{name}: {len(sel)} steps, {total / 1e6:.1f} of {fp32 / 1e6:.1f} MB fp32 ({fp32 / total:.2f}x): boundaries "
        f"{boundaries / 1e6:.1f}, tied {tied / 1e6:.1f}, sums {sums / 1e6:.1f}, control {control / 1e6:.1f} MB; "
        f"tensors alone {tensors:.2f}x"
    )


for routes in sorted({r["chains"] for r in rows}):
    line(f"{routes} route(s)", [r for r in rows if r["chains"] == routes])
line("all", rows)

methods: dict[str, float] = {}
for r in rows:
    for k in r:
        if k.startswith("swarm_control_call_bytes_total{method="):
            name = k.split("method=", 1)[1].rstrip("}")
            methods[name] = methods.get(name, 0.0) + number(r, k)
if methods and rows:
    split = sorted(methods.items(), key=lambda kv: -kv[1])
    print(
        "control by method: " + ", ".join(f"{m} {b / 1e6:.2f} MB ({b / len(rows) / 1e3:.1f} KB/step)" for m, b in split)
    )
