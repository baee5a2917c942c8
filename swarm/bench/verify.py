"""What verified stage work costs: samples/s of one replicated in-process pipeline with audits at several rates.

Every setting trains the same steps of the same model from the same seed on a fresh `LocalPipeline` (2 stages x 2
replicas, the swarm's default codecs); the settings alternate round after round in one run of this command, so the
machine's drift touches all alike. In one process every replica shares the CPU, so the figure is the audits' whole
added compute (a recomputation on a sibling, the records' copies and bytes, the weights' digests), not only their
latency. Two figures per run: samples per second of wall time, and samples per CPU-second of the process (all
its threads: every stage, replica and the trainer), which other load on a shared machine barely moves. Reported:
each setting's medians over rounds, its cost against verification off, and the audits' counts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass

from swarm.flags import Flags
from swarm.report import print_table

__all__ = ["VerifyBench", "measure"]


@dataclass(frozen=True)
class VerifyBench:
    """`swarm bench verify`: samples/s with audits off and at several rates, alternating."""

    fractions: str = "0,0.05,0.1,0.25"
    """audit rates to compare, comma-separated (0: verification off, the reference)"""
    rounds: int = 3
    """runs of every setting, alternating"""
    steps: int = 12
    """optimizer steps per run (the first is left out of the rate)"""
    hidden: int = 128
    """the model's hidden size (4 layers, sequence 64)"""
    quick: bool = False
    """one round of 4 steps with a hidden size of 32"""
    json: bool = False
    """print one JSON object per row"""


_FLAGS = Flags(VerifyBench)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _FLAGS.add_to(parser)


def measure(fraction: float, steps: int, hidden: int, seed: int = 0) -> dict:
    """One run: samples/s over steps 2..`steps` of a fresh 2 x 2 pipeline with audits at `fraction` (0: off)."""
    import torch

    from swarm.compression import DEFAULT_BACKWARD_CODEC, DEFAULT_FORWARD_CODEC, CodecConfig
    from swarm.model.data import Batch
    from swarm.model.gpt import ModelConfig
    from swarm.runtime.inprocess import LocalPipeline
    from swarm.runtime.verify import VerifyConfig

    torch.set_num_threads(1)
    model = ModelConfig(vocab_size=256, seq_len_tokens=64, hidden_dim=hidden, n_layers=4, n_heads=4, init_seed=seed)
    fw, bw = CodecConfig.parse(DEFAULT_FORWARD_CODEC), CodecConfig.parse(DEFAULT_BACKWARD_CODEC)
    pipe = LocalPipeline(model, 2, fw, bw, replicas=2)
    verify = VerifyConfig(fraction=fraction, seed=seed) if fraction > 0 else None
    driver = pipe.driver(8, verify=verify)
    gen, rows = torch.Generator().manual_seed(seed), 16
    windows = torch.randint(0, model.vocab_size, (4 * rows, model.seq_len_tokens + 1), generator=gen)
    try:
        start, cpu, samples = 0.0, 0.0, 0
        for step in range(steps):
            if step == 1:
                start, cpu = time.perf_counter(), time.process_time()
            at = (step % 4) * rows  # samples come back (AQ-SGD buffers warm), as in an epoch
            batch = Batch(torch.arange(at, at + rows), windows[at : at + rows, :-1], windows[at : at + rows, 1:])
            driver.train_step(step, batch)
            samples += rows if step >= 1 else 0
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
        stats = driver.verifier.stats if driver.verifier is not None else None
        return {
            "fraction": fraction,
            "samples_s": samples / seconds,
            "samples_cpu_s": samples / cpu_seconds,
            "audits": stats.audits if stats else 0,
            "detections": len(stats.detections) if stats else 0,
            "audit_s": stats.seconds if stats else 0.0,
        }
    finally:
        pipe.close()


def run(args: argparse.Namespace) -> int:
    bench = _FLAGS.from_args(args)
    fractions = sorted({float(f) for f in bench.fractions.split(",")} | {0.0})
    rounds, steps, hidden = (1, 4, 32) if bench.quick else (bench.rounds, bench.steps, bench.hidden)
    runs = []
    for r in range(rounds):
        for fraction in fractions:
            runs.append({"round": r, **measure(fraction, steps, hidden, seed=r)})
            done = runs[-1]
            print(f"round {r} fraction {fraction}: {done['samples_s']:.2f} samples/s, {done['samples_cpu_s']:.2f} per "
                  f"CPU-second", file=sys.stderr)  # fmt: skip
    off = statistics.median(x["samples_s"] for x in runs if x["fraction"] == 0)
    off_cpu = statistics.median(x["samples_cpu_s"] for x in runs if x["fraction"] == 0)
    rows = []
    for fraction in fractions:
        mine = [x for x in runs if x["fraction"] == fraction]
        rate = statistics.median(x["samples_s"] for x in mine)
        cpu_rate = statistics.median(x["samples_cpu_s"] for x in mine)
        rows.append(
            {"fraction": fraction, "samples_s": round(rate, 3), "cost": round(1 - rate / off, 4),
             "samples_cpu_s": round(cpu_rate, 3), "cpu_cost": round(1 - cpu_rate / off_cpu, 4),
             "audits": sum(x["audits"] for x in mine), "detections": sum(x["detections"] for x in mine)}
        )  # fmt: skip
    if bench.json:
        for row in rows:
            print(json.dumps(row))
        print(json.dumps({"fraction": "summary", "throughput_no_verify_samples_s": off, "rounds": rounds}))
    else:
        columns = ["fraction", "samples_s", "cost", "samples_cpu_s", "cpu_cost", "audits", "detections"]
        print_table(rows, columns, "verified stage work: cost")
    return 0
