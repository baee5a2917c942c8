"""What the one-process simulations (`simulate_boundary_codecs.py`, `simulate_replica_sums.py`) share with the
convergence experiment: the unsplit default model from the seed, its data, and the experiment's AdamW (decay on
matrices only), warm-up of 20% of the steps and cosine, step by step; and the held-out loss without codecs. Their
fp32 modes end at the experiment's fp32 held-out loss to 5 digits (2.20061 on 6,144 samples, seed 0)."""

from dataclasses import dataclass, replace

import torch

from swarm.experiments.convergence import ModelData
from swarm.model.data import SampleSet, build_datasets
from swarm.model.gpt import GPT
from swarm.runtime.worker import OptimConfig, lr_at

BATCH = 16
"""Samples a step, as the experiment's."""


@dataclass
class Run:
    """One simulated run: the model, its data and its optimizer over `steps` steps."""

    model: GPT
    params: list[torch.nn.Parameter]
    """the model's trained parameters, in its order"""
    train: SampleSet
    held: SampleSet
    optim: OptimConfig
    optimizer: torch.optim.AdamW
    steps: int

    def batches(self, seed: int, epochs: int = 1):
        """(step, the batch's rows) of every step, each epoch in a fresh order of the seed's generator."""
        gen, step = torch.Generator().manual_seed(seed), 0
        for _epoch in range(epochs):
            order = torch.randperm(len(self.train), generator=gen)
            for b in range(len(self.train) // BATCH):
                yield step, order[b * BATCH : (b + 1) * BATCH]
                step += 1

    def apply(self, step: int) -> None:
        """Clip the gradients the parameters hold to the global norm `optim` gives (1), then the optimizer's step at
        `step`'s rate."""
        if self.optim.grad_clip_norm:  # None: clipping off
            torch.nn.utils.clip_grad_norm_(self.params, self.optim.grad_clip_norm)
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.optim, step)
        self.optimizer.step()

    def held_out(self) -> float:
        """The mean held-out loss, in eval mode, without codecs."""
        self.model.eval()
        with torch.no_grad():
            total, n = 0.0, 0
            for b in range(0, len(self.held), 64):
                part = self.held.batch(slice(b, b + 64))
                total += float(self.model(part.tokens, part.targets)) * len(part.tokens)
                n += len(part.tokens)
        return total / n


def start(seed: int, samples: int, epochs: int = 1) -> Run:
    """The model, data and optimizer the experiment starts `seed`'s run of `samples` training samples with."""
    torch.set_num_threads(1)
    built = ModelData(train_samples=samples, seed=seed).build()
    torch.manual_seed(seed)
    model = GPT(built["model"])
    train, held, _ = build_datasets(built["data"])
    steps = epochs * (len(train) // BATCH)
    optim = replace(built["optim"], total_steps=steps, warmup_steps=max(1, round(steps * 0.2)))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": optim.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=lr_at(optim, 0),
        betas=optim.betas,
        eps=optim.eps,
    )
    return Run(model, params, train, held, optim, optimizer, steps)
