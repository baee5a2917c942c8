"""How the boundary's activations and gradients change over an fp32 single pass: the unsplit default model trained
as the convergence experiment trains it (`one_process`), and every EVERY steps, on the first micro-batch of 4
samples at the cut of 2 stages (rows of one token), what the top 32 and 64 eigenvectors of the rows' Gram matrix
leave out of its trace, the relative error of a first sight subspace-coded at those ranks on the default's step
(`subspace.encode_subspace`, step 20% of the rms), and the relative error of the default backward's 2-bit code on
the micro-batch's gradient. Prints one JSON line per measured step (docs/reports/single-pass.md, s59).

usage: python scripts/measure_boundary_spectrum.py [SEED] [SAMPLES] [EVERY]
"""

import json
import sys

import torch
from one_process import start

from swarm.compression import DEFAULT_BACKWARD_CODEC, CodecConfig, decoder_for, make_codec
from swarm.compression.subspace import encode_subspace
from swarm.model.gpt import split_layers
from swarm.proto import wire_pb2

seed = int(sys.argv[1]) if len(sys.argv) > 1 else 0
samples = int(sys.argv[2]) if len(sys.argv) > 2 else 24576
every = int(sys.argv[3]) if len(sys.argv) > 3 else 64
run = start(seed, samples)
model, micro = run.model, 4
cut = split_layers(model.cfg.n_layers, 2)[0][1]
captured: dict[str, torch.Tensor] = {}


def keep(module, _, out):
    if module.training:
        out.retain_grad()
        captured["out"] = out


list(model.blocks.values())[cut - 1].register_forward_hook(keep)
backward = make_codec(CodecConfig.parse(DEFAULT_BACKWARD_CODEC))


def left_out(rows: torch.Tensor, ranks: tuple[int, ...]) -> list[float]:
    """What each rank's top eigenvectors leave out of the rows' Gram matrix's trace, as a share."""
    values = torch.linalg.eigvalsh((rows.t() @ rows).double()).flip(0)
    return [float(values[rank:].sum() / values.sum()) for rank in ranks]


def relative(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x - y).norm() / x.norm())


for step, rows in run.batches(seed):
    part = run.train.batch(rows)
    model.zero_grad(set_to_none=True)
    loss = model(part.tokens, part.targets)
    loss.backward()
    if step % every == 0 or step == run.steps - 1:
        out = captured["out"]
        act = out.detach()[:micro]
        grad = out.grad.detach()[:micro] * (len(rows) // micro)  # the micro-batch's own mean loss's gradient
        mat = act.reshape(-1, act.shape[-1])
        sent = {r: encode_subspace(mat, r, 20, wire_pb2.Quantized(), wire_pb2.Quantized()) for r in (32, 64)}
        msg = backward.encode(grad.contiguous())
        left_out_32, left_out_64 = left_out(mat, (32, 64))
        row = {
            "step": step,
            "loss": round(float(loss.detach()), 4),
            "left_out_32": left_out_32,
            "left_out_64": left_out_64,
            "error_32": relative(mat, sent[32]),
            "error_64": relative(mat, sent[64]),
            "gradient_error_2bit": relative(grad, decoder_for(msg).decode(msg)),
        }
        print(json.dumps({k: round(v, 5) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    run.apply(step)
