"""Control bytes of one training step split by method and request/reply (issue 13's control share).

Runs a LocalPipeline of the convergence experiment's shape (2 stages, batch 16, 4 micro-batches) with one setting's
codecs for a few steps and tallies what `PipelineDriver._call` counts, per method. Usage:
    python scripts/control_split.py [--setting tern+ch+r75/gtern+ef+rot+nr+r100] [--steps 4]
"""

from __future__ import annotations

import argparse
from collections import defaultdict

from google.protobuf.message import Message

from swarm.experiments.convergence import ExperimentConfig, _codec_defaults, _parse_setting
from swarm.model.data import build_datasets, epoch_batches
from swarm.runtime.callinfo import RouteAcks
from swarm.runtime.driver import PipelineDriver
from swarm.runtime.inprocess import LocalPipeline
from swarm.runtime.worker import StageConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--setting", default="tern+ch+r75/gtern+ef+rot+nr+r100")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--carry-routes", action="store_true", help="every call carries its route (before the cut)")
    args = ap.parse_args()
    if args.carry_routes:
        RouteAcks.carry = lambda self, peer, version: True
    cfg = ExperimentConfig()
    setting = _parse_setting(args.setting, *_codec_defaults(cfg), cfg)
    tally: dict[tuple[str, str], int] = defaultdict(int)
    calls: dict[str, int] = defaultdict(int)
    original = PipelineDriver._call

    def counting(self, stage, replica, method, request, timeout=None):
        if isinstance(request, Message):
            tally[(method, "request")] += request.ByteSize()
        else:
            items = list(request)
            tally[(method, "request")] += sum(len(i) for i in items)
            request = iter(items)
        calls[method] += 1
        reply = original(self, stage, replica, method, request, timeout)
        tally[(method, "reply")] += reply.ByteSize()
        return reply

    PipelineDriver._call = counting
    train, _, _ = build_datasets(cfg.data)
    pipe = LocalPipeline(
        cfg.model,
        cfg.n_stages,
        setting.forward,
        setting.backward,
        schedule=cfg.schedule,
        stage_cfg=StageConfig(cfg.optim),
    )
    control, boundary = [], []
    try:
        for i, batch in enumerate(epoch_batches(train, cfg.batch_size, 0, cfg.data_seed)):
            if i == args.steps:
                break
            if i == 1:
                tally.clear(), calls.clear()
            r = pipe.train_step(batch, cfg.n_micro)
            control.append(r.control_bytes)
            boundary.append(r.forward_bytes + r.backward_bytes)
    finally:
        pipe.close()
    n = args.steps - 1
    print(f"{args.setting}: control bytes of steps 2..{args.steps} (StepResult): {[int(c) for c in control[1:]]}")
    print(f"  boundary (forward + backward) bytes of steps 2..{args.steps}: {[int(b) for b in boundary[1:]]}")
    total = 0
    for method in sorted({m for m, _ in tally}):
        req, rep = tally[(method, "request")] / n, tally[(method, "reply")] / n
        total += req + rep
        print(f"  {method:10s} calls/step {calls[method] / n:5.1f}  request {req:7.1f} B  reply {rep:7.1f} B")
    print(f"  total {total:.1f} B a step ({total / 1000:.2f} KB)")


if __name__ == "__main__":
    main()
