"""The replicas' sum alone, in one process: 2 replicas' gradients of the unsplit model (no boundary codec), each
replica half of every batch of 16, summed one way, then the convergence experiment's AdamW step and schedule.
Its fp32 mode ends at the convergence experiment's fp32 held-out loss to 5 digits (2.20061 at 6,144 samples, seed 0),
so what a mode adds is the sum's alone, in a third of the pipeline's time.

Modes:
  fp32          the exact mean.
  parts:LABEL   each replica codes its gradient with the codec LABEL (mlowrank12+ef+f4: s57's default) and every
                replica adds the decoded messages: what `GradientAverager` does with a sum coded as it is (no
                `pre:`; the default since s58 codes it in AdamW's units, which this script does not).
  sum:R:BITS    PowerSGD of the sum (two rounds a step): a shared Q; round 1 sums P_i = M_i Q (BITS-bit columns),
                orthonormalises it; round 2 sums Q_i = M_i^T P (BITS-bit); error feedback per replica; vectors and
                matrices narrower than R whole at 8 bits. Not a wire codec: what the exchange would decode.

usage: python scripts/simulate_replica_sums.py MODE SEED [SAMPLES] [EPOCHS]   (prints one RESULT line)
"""

import sys
import time
from dataclasses import replace

import torch
from one_process import BATCH, start

from swarm.compression import CodecConfig, make_codec
from swarm.compression.codec_mlowrank import layout_of
from swarm.compression.factors import pack_factor
from swarm.compression.state import LinkState
from swarm.proto import wire_pb2

mode, seed = sys.argv[1], int(sys.argv[2])
samples = int(sys.argv[3]) if len(sys.argv) > 3 else 6144
epochs = int(sys.argv[4]) if len(sys.argv) > 4 else 1
run = start(seed, samples, epochs)
model, params, R = run.model, run.params, 2
layout = layout_of(params)
kept = [(None, None)] * R  # parts: each replica's residual and warm start
res = [[torch.zeros_like(p) for p in params] for _ in range(R)]
shared_q: dict[int, torch.Tensor] = {}
parts_config = replace(CodecConfig.parse(mode.split(":", 1)[1]), layout=layout) if mode.startswith("parts:") else None
sent = 0


def quant(x: torch.Tensor, bits: int) -> torch.Tensor:
    """What a receiver decodes of `x`'s columns at `bits` (the factors' int codes, each column with its step); 16 or
    more: `x` as it is."""
    return x if bits >= 16 else pack_factor(x, bits, wire_pb2.Quantized())


def combine(grads: list[list[torch.Tensor]], step: int) -> list[torch.Tensor]:
    global sent
    if mode == "fp32":
        return [sum(g[k] for g in grads) / R for k in range(len(params))]
    if mode.startswith("parts:"):
        total = None
        for i, g in enumerate(grads):
            cfg = replace(parts_config, seed=(seed * 1_000_003 + step * 257 + i) % (1 << 31))
            st = LinkState(cfg)
            st.residual, st.warm = kept[i]
            codec = make_codec(cfg)
            msg = codec.encode(torch.cat([x.reshape(-1) for x in g]), state=st)
            sent += msg.ByteSize()
            kept[i] = (st.residual, st.warm)
            d = codec.decode(msg).float()
            total = d if total is None else total + d
        total = total / R
        out, o = [], 0
        for p in params:
            out.append(total[o : o + p.numel()].view_as(p))
            o += p.numel()
        return out
    _, rank, bits = mode.split(":")
    rank, bits = int(rank), int(bits)
    out = []
    for k, p in enumerate(params):
        ms = [grads[i][k] + res[i][k] for i in range(R)]
        if p.dim() < 2 or min(p.shape[0], p[0].numel()) <= rank:
            dec = [quant(m.reshape(-1, 1), 8).view_as(m) for m in ms]  # vectors: 8-bit whole (as the codec's column)
            for i in range(R):
                res[i][k] = ms[i] - dec[i]
            out.append(sum(dec) / R)
            continue
        rows, cols = p.shape[0], p[0].numel()
        mats = [m.reshape(rows, cols) for m in ms]
        if k not in shared_q:
            g = torch.Generator().manual_seed(seed * 31 + k)
            shared_q[k] = torch.randn(cols, rank, generator=g)
        q = shared_q[k]
        P = sum(quant(m @ q, bits) for m in mats)  # round 1
        ph = torch.linalg.qr(P).Q
        qs = [quant(m.t() @ ph, bits) for m in mats]  # round 2
        Q = sum(qs)
        for i in range(R):
            res[i][k] = (mats[i] - ph @ qs[i].t()).view_as(p)
        shared_q[k] = Q
        out.append((ph @ Q.t() / R).view_as(p))
    return out


t0 = time.time()
losses = []
for step, rows in run.batches(seed, epochs):
    grads = []
    loss_sum = 0.0
    for i in range(R):
        part = run.train.batch(rows[i * BATCH // R : (i + 1) * BATCH // R])
        model.zero_grad(set_to_none=True)
        loss = model(part.tokens, part.targets)
        loss.backward()
        loss_sum += float(loss)
        grads.append([p.grad.detach() for p in params])  # the next backward makes new ones (set_to_none)
    avg = combine(grads, step)
    for p, g in zip(params, avg, strict=True):
        p.grad = g
    run.apply(step)
    losses.append(loss_sum / R)
tail = losses[-32:]
print(
    f"RESULT mode={mode} seed={seed} samples={samples} epochs={epochs} steps={run.steps} eval={run.held_out():.5f} "
    f"train_last32={sum(tail) / len(tail):.4f} sent_MB={sent / 1e6:.1f} s={time.time() - t0:.0f}",
    flush=True,
)
