"""In-process: 2 stages x R replicas, aqsgd2 forward / gradq4 backward, the replicas' sum at BITS bits.

Usage: python scripts/measure_reduce_bits.py REPLICAS BITS STEPS  (prints the final train and eval loss)
"""

import sys
from dataclasses import replace

from swarm.compression import CodecConfig
from swarm.experiments.convergence import ExperimentConfig
from swarm.model.data import build_datasets, epoch_batches
from swarm.runtime.average import GradientAverager
from swarm.runtime.inprocess import LocalPipeline
from swarm.runtime.worker import StageConfig

replicas, bits, steps = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
GradientAverager.min_bits = bits
cfg = ExperimentConfig()
train, evals, _ = build_datasets(cfg.data)
optim = replace(cfg.optim, total_steps=steps, warmup_steps=max(1, steps // 20))
codecs = CodecConfig("aqsgd", bits=2), CodecConfig("gradq", bits=4)
stage_cfg = StageConfig(optim, cfg.autocast_bf16)
pipe = LocalPipeline(cfg.model, 2, *codecs, stage_cfg=stage_cfg, replicas=replicas)
losses, step, epoch = [], 0, 0
while step < steps:
    for batch in epoch_batches(train, cfg.batch_size, epoch, cfg.data_seed):
        losses.append(pipe.train_step(batch, cfg.n_micro).loss)
        step += 1
        if step >= steps:
            break
    epoch += 1
train_loss = sum(losses[-10:]) / len(losses[-10:])
eval_loss = pipe.evaluate(evals, cfg.batch_size * 2)
print(f"replicas={replicas} reduce_bits={bits} steps={steps} train_loss(last 10)={train_loss:.4f} eval={eval_loss:.4f}")
