"""A volunteer running modified code: `swarm-peer` whose stage lies in one way, for `swarm experiment attacks`.

    python -m swarm.experiments.liar_peer --lie scale:300 <swarm-peer flags>

The peer is the normal daemon (`swarm.daemon.peer.main`); only the compute of its stage is changed, through the
daemon's `on_host` hook, by replacing methods of the host's `StageWorker` instance. Everything on the wire stays
well-formed: the lies are in the numbers, as a volunteer's own modified build would send them.

Lies (`LIES`):
- `scale:F`: every activation it sends forward is multiplied by F (the last stage's loss is not changed);
- `noise`: every activation it sends forward is replaced by Gaussian noise of the same norm;
- `no-update`: it never changes its weights (each `step` drops the gradients and pretends);
- `sign-flip`: every gradient it sends backward is negated (on the first stage, which sends none, its own
  parameter gradients are negated before its step);
- `norm:V`: it reports V as its squared gradient norm (NaN, -1e30, 1e30...).
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from dataclasses import dataclass

import torch

__all__ = ["LIES", "Lie", "apply_lie", "main", "parse_lie"]

log = logging.getLogger("swarm.liar")

LIES = ("scale:1.5", "scale:10", "scale:300", "noise", "no-update", "sign-flip", "norm:nan", "norm:-1e30", "norm:1e30")
"""The lies of the attacks experiment, by name (`parse_lie` takes any scale or norm value)."""
_KINDS = ("scale", "noise", "no-update", "sign-flip", "norm")


@dataclass(frozen=True)
class Lie:
    """One way of lying: `kind` (scale, noise, no-update, sign-flip, norm) and its number (scale, norm)."""

    kind: str
    """which lie"""
    value: float = 0.0
    """the factor of scale, the reported squared norm of norm; unused by the others"""

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"Lie.kind: expected one of {_KINDS}, got {self.kind!r}")
        if self.kind == "scale" and not math.isfinite(self.value):
            raise ValueError(f"Lie: a scale must be finite, got {self.value}")

    def __str__(self) -> str:
        return f"{self.kind}:{self.value:g}".replace("e+", "e") if self.kind in ("scale", "norm") else self.kind


def parse_lie(text: str) -> Lie:
    """`scale:300`, `noise`, `no-update`, `sign-flip`, `norm:nan` -> a Lie. Raises ValueError naming the text."""
    kind, _, number = text.partition(":")
    if kind in ("scale", "norm"):
        try:
            return Lie(kind, float(number))
        except ValueError:
            raise ValueError(f"--lie {text!r}: {kind} needs a number, e.g. {kind}:10") from None
    if number:
        raise ValueError(f"--lie {text!r}: {kind} takes no number")
    return Lie(kind)


def apply_lie(worker, lie: Lie) -> None:
    """Makes `worker` (a `StageWorker`) lie from now on, by replacing its instance's methods."""
    forward, backward, step = worker.forward, worker.backward, worker.step
    last = worker.module.is_last
    first = worker.module.is_first

    if lie.kind in ("scale", "noise") and not last:

        def lying_forward(*args, **kwargs):
            out = forward(*args, **kwargs)
            if lie.kind == "scale":
                return out * lie.value
            noise = torch.randn_like(out)
            return noise * (out.norm() / noise.norm().clamp_min(1e-12))

        worker.forward = lying_forward
    elif lie.kind == "no-update":

        def no_step(global_grad_norm=None):
            from swarm.runtime.worker import lr_at

            worker.optimizer.zero_grad(set_to_none=True)
            worker.found_inf = False
            lr = lr_at(worker.cfg.optim, worker.step_count)
            worker.step_count += 1
            return lr

        worker.step = no_step
    elif lie.kind == "sign-flip" and not first:

        def flipped_backward(mb, grad_out):
            grad = backward(mb, grad_out)
            return None if grad is None else -grad

        worker.backward = flipped_backward
    elif lie.kind == "sign-flip":

        def flipped_step(global_grad_norm=None):
            for p in worker.module.parameters():
                if p.grad is not None:
                    p.grad.neg_()
            return step(global_grad_norm)

        worker.step = flipped_step
    elif lie.kind == "norm":
        worker.grad_sq_norm = lambda: lie.value
    else:
        log.warning("lie %s has nothing to change on the last stage: this peer is honest here", lie)
        return
    log.warning("this peer lies: %s", lie)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m swarm.experiments.liar_peer",
        description="swarm-peer whose stage lies (for swarm experiment attacks); other flags go to swarm-peer",
    )
    parser.add_argument("--lie", required=True, help=f"how to lie: one of {', '.join(LIES)} (any scale:F, norm:V)")
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    try:
        lie = parse_lie(args.lie)
    except ValueError as e:
        parser.error(str(e))
    from swarm.daemon.peer import main as peer_main

    return peer_main(rest, on_host=lambda host: apply_lie(host.worker, lie))


if __name__ == "__main__":
    sys.exit(main())
