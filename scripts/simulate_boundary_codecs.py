"""One boundary's codecs alone, in one process: the unsplit default model cut where 2 stages would split it, each
step 4 micro-batches of 4 samples, every micro-batch's activation through the forward codec (encoded and decoded
with its own link states on both ends, sample ids as the trainer numbers them) and its gradient through the
backward codec (error feedback, where the label asks for it, within a step, as a link end keeps it), then the
convergence experiment's AdamW step, clipping and schedule. Held-out loss without codecs, as the experiment's.

Its fp32 mode ends at the convergence experiment's fp32 held-out loss to 5 digits on 6,144 samples (2.20061, seed
0); a codec's figures differ from the pipeline's by its own rounding draws and rotation seeds (the default on
6,144 samples: +0.92% here, +0.79% in the pipeline), so use it to screen, and the experiment to decide. A
24,576-sample pass takes about 4 minutes here, a third of the pipeline's time.

usage: python scripts/simulate_boundary_codecs.py FORWARD BACKWARD [SEED] [SAMPLES]   (labels, or fp32; prints one
RESULT line; the bytes are the messages' before zstd)
"""

import sys
import time

import torch
from one_process import BATCH, start

from swarm.compression import CodecConfig, decoder_for, make_codec
from swarm.compression.state import LinkState
from swarm.model.gpt import split_layers

forward, backward = sys.argv[1], sys.argv[2]
seed = int(sys.argv[3]) if len(sys.argv) > 3 else 0
samples = int(sys.argv[4]) if len(sys.argv) > 4 else 6144
run = start(seed, samples)
model, n_micro = run.model, 4
fw_config = None if forward == "fp32" else CodecConfig.parse(forward, seed=seed)
bw_config = None if backward == "fp32" else CodecConfig.parse(backward, seed=seed + 1)
fw_codec, bw_codec = (make_codec(c) if c else None for c in (fw_config, bw_config))
fw_send, fw_recv = (LinkState(fw_config), LinkState(fw_config)) if fw_config else (None, None)
bw_send = LinkState(bw_config) if bw_config else None
current_ids: list[int] = []
sent = [0, 0]


class Boundary(torch.autograd.Function):
    """The activation as the next stage decodes it; its gradient as the previous stage decodes it (the previous
    stage backpropagates through its own activation, so the codec's error reaches it only through the gradient)."""

    @staticmethod
    def forward(ctx, x):
        if fw_codec is None:
            return x.clone()
        msg = fw_codec.encode(x.detach(), sample_ids=current_ids, state=fw_send)
        sent[0] += msg.ByteSize()
        return decoder_for(msg).decode(msg, state=fw_recv).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        if bw_codec is None:
            return grad
        msg = bw_codec.encode(grad.contiguous(), state=bw_send)
        sent[1] += msg.ByteSize()
        return decoder_for(msg).decode(msg).to(grad.dtype)


cut = split_layers(model.cfg.n_layers, 2)[0][1]
last_of_stage_0 = list(model.blocks.values())[cut - 1]
last_of_stage_0.register_forward_hook(lambda module, _, out: Boundary.apply(out) if module.training else out)

t0 = time.time()
losses = []
for step, rows in run.batches(seed):
    model.zero_grad(set_to_none=True)
    if bw_send is not None:
        bw_send.end_step()  # error feedback carries across one step's micro-batches only
    total = 0.0
    for mb in range(n_micro):
        part_rows = rows[mb * BATCH // n_micro : (mb + 1) * BATCH // n_micro]
        current_ids = [int(i) for i in part_rows]
        part = run.train.batch(part_rows)
        loss = model(part.tokens, part.targets) / n_micro
        loss.backward()
        total += float(loss.detach())
    run.apply(step)
    losses.append(total)
tail = losses[-64:]
print(
    f"RESULT forward={forward} backward={backward} seed={seed} samples={samples} steps={run.steps} "
    f"eval={run.held_out():.5f} train_last64={sum(tail) / len(tail):.4f} forward_MB={sent[0] / 1e6:.1f} "
    f"backward_MB={sent[1] / 1e6:.1f} s={time.time() - t0:.0f}",
    flush=True,
)
