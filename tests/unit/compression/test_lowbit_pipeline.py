"""tern and bilevel through the swarm's runtime: a small convergence experiment trains with them as forward
codecs (framing, link states, the AQ-SGD buffers of a real pipeline), and with 128 tokens a sample (a group of
the channel layout) their bytes after the first epoch fall below acsgd2's."""

from __future__ import annotations

import argparse
import math

import torch

from swarm.experiments import convergence

torch.set_num_threads(1)


def test_small_run_with_the_low_bit_forward_codecs(tmp_path):
    parser = argparse.ArgumentParser()
    convergence.add_arguments(parser)
    labels = [f"{fw}/gradq2+ef+rot+nr+cs" for fw in ("acsgd2+ch", "tern+ch", "bilevel+ch")]
    small = "--hidden 32 --layers 2 --heads 2 --train-samples 16 --eval-samples 8 --epochs 2 --batch-size 8"
    args = parser.parse_args([*small.split(), "--micro-batches", "2", "--settings", ",".join(["fp32/fp32", *labels])])
    rows = convergence.run_experiment(convergence.config_from_args(args), tmp_path, show_progress=False)
    by = {r["setting"]: r for r in rows}
    assert [r["setting"] for r in rows] == ["fp32/fp32", *labels]
    assert all(math.isfinite(r["final_eval_loss"]) and r["eval_vs_fp32_pct"] < 25 for r in rows)
    acsgd, tern, bilevel = (by[name]["steady_wire_bytes"] for name in labels)
    # the forward: 2 bits + one fp16 per 128, 5 codes a byte + one fp16, 1 bit + two fp16 (zstd aside; on
    # this small model's deltas zstd brings tern's codes near bilevel's)
    assert max(tern, bilevel) < acsgd
    assert (by[labels[1]]["forward"], by[labels[2]]["forward"]) == ("tern+ch", "bilevel+ch")
    assert by[labels[2]]["fw_bits"] == 1
