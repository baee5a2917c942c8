"""The convergence experiment with replicas under one replicas'-sum codec (`GradientAverager.sum_codec`).

Usage: python scripts/measure_sum_codecs.py SUM_CODEC OUT [--baseline DIR] [convergence flags...]
  SUM_CODEC: a codec label for the replicas' sum over compressed links: topk2+ef+k64+g4096, or a dense gradq label
  (gradq2+ef+rot+nr+cs+g1024: its bits become `GradientAverager.min_bits` too), or `dense` for the backward codec's
  sum config at the default `min_bits` (gradq8, the sum before issue 29); a `pre:` prefix codes the sum in AdamW's
  units (`GradientAverager.precondition_max_bits` 32 and `precondition_ranked`: factored sums too), none not at all
  (as labelled, whatever the defaults). Prints the rows as JSON.
  --baseline DIR: take the fp32/fp32 run from an earlier run's losses.csv and eval.csv (same flags) instead of
  training it again.
Example: python scripts/measure_sum_codecs.py dense runs/sum-dense --replicas 2 \\
    --settings fp32/fp32,acsgd2+ch+nr/gradq2+ef+rot+nr+cs+g1024
"""

import argparse
import csv
import json
import sys
from pathlib import Path

import torch

from swarm.compression import CodecConfig
from swarm.experiments import convergence
from swarm.runtime.average import GradientAverager

label, out, rest = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
baseline = None
if rest[:1] == ["--baseline"]:
    baseline, rest = Path(rest[1]), rest[2:]
GradientAverager.precondition_max_bits, GradientAverager.precondition_ranked = 0, False  # as labelled: `pre:` or not
if label.startswith("pre:"):  # quantized (or factored) in AdamW's units
    GradientAverager.precondition_max_bits, GradientAverager.precondition_ranked, label = 32, True, label[4:]
GradientAverager.sum_codec = None if label == "dense" else label
if label.startswith("gradq"):
    GradientAverager.min_bits = CodecConfig.parse(label).bits
parser = argparse.ArgumentParser()
convergence.add_arguments(parser)
torch.set_num_threads(1)
cfg = convergence.config_from_args(parser.parse_args(rest))
if baseline is None:
    rows = convergence.run_experiment(cfg, out, show_progress=False)
else:  # the fp32 run as recorded, then only the other settings
    number = lambda v: float(v) if "." in v or "e" in v or "n" in v else int(v)  # noqa: E731
    with open(baseline / "losses.csv") as f:
        steps = [{k: number(v) for k, v in r.items() if k != "setting"} for r in csv.DictReader(f)
                 if r["setting"] == "fp32/fp32"]  # fmt: skip
    with open(baseline / "eval.csv") as f:
        evals = [{k: number(v) for k, v in r.items() if k != "setting"} for r in csv.DictReader(f)
                 if r["setting"] == "fp32/fp32"]  # fmt: skip
    defaults = convergence._codec_defaults(cfg)
    fp32 = convergence.SettingResult(convergence.Setting.parse("fp32/fp32", *defaults), steps, evals)
    train, held_out, _ = convergence.build_datasets(cfg.data)
    from tqdm import tqdm

    results = [fp32]
    with tqdm(disable=True) as bar:
        for name in cfg.settings:
            if name != "fp32/fp32":
                setting = convergence._parse_setting(name, *defaults, cfg)
                results.append(convergence._run_setting(setting, cfg, train, held_out, bar))
    rows = [convergence._summarize(r, fp32, cfg.epochs) for r in results]
    out.mkdir(parents=True, exist_ok=True)
    (out / "rows.json").write_text(json.dumps(rows, indent=1))
keep = ("setting", "final_eval_loss", "eval_vs_fp32_pct", "wire_bytes", "sync_bytes", "control_bytes",
        "total_wire_bytes", "total_ratio_vs_fp32", "total_steady_ratio_vs_fp32", "steps", "seconds")  # fmt: skip
print(json.dumps([{"sum_codec": label, **{k: r[k] for k in keep}} for r in rows], indent=1))
