"""The convergence experiment with replicas under one replicas'-sum codec (`GradientAverager.sum_codec`).

Usage: python scripts/measure_sum_codecs.py SUM_CODEC OUT [convergence flags...]
  SUM_CODEC: a codec label for the replicas' sum over compressed links (e.g. topk2+ef+k64+g4096), or `dense` for the
  backward codec's sum config at `GradientAverager.min_bits` (gradq8, the sum before topk). Prints the rows as JSON.
Example: python scripts/measure_sum_codecs.py dense runs/sum-dense --replicas 2 \
    --settings fp32/fp32,acsgd2+ch+nr/gradq2+ef+rot+nr+cs+g1024
"""

import argparse
import json
import sys
from pathlib import Path

import torch

from swarm.experiments import convergence
from swarm.runtime.average import GradientAverager

label, out, rest = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
GradientAverager.sum_codec = None if label == "dense" else label
parser = argparse.ArgumentParser()
convergence.add_arguments(parser)
torch.set_num_threads(1)
rows = convergence.run_experiment(convergence.config_from_args(parser.parse_args(rest)), out, show_progress=False)
keep = ("setting", "final_eval_loss", "eval_vs_fp32_pct", "wire_bytes", "sync_bytes", "control_bytes",
        "total_wire_bytes", "total_ratio_vs_fp32", "total_steady_ratio_vs_fp32", "steps", "seconds")  # fmt: skip
print(json.dumps([{"sum_codec": label, **{k: r[k] for k in keep}} for r in rows], indent=1))
