"""What a peer offers the swarm: its measured compute speed and its memory."""

from __future__ import annotations

import dataclasses
import os
import time

import torch

from swarm.compression import CodecConfig, make_codec
from swarm.model.gpt import ModelConfig
from swarm.scheduler import ModelSpec, TransformerShape

__all__ = [
    "low_precisions",
    "measure_compute",
    "measure_speeds",
    "memory_bytes",
    "message_bytes",
    "model_spec",
    "tied_bytes",
    "wire_bits",
]

REFERENCE_MICRO_BATCH = 2
"""Samples per micro-batch of the plan's model by default: the trainer's default split (8 samples, 4 micro-batches)."""
REFERENCE_MICRO_BATCHES = 4
"""Micro-batches per step of the plan's model by default (the trainer's default)."""


def measure_compute(model, device: str, iters: int = 10, micro_batch_size: int = 2, precision: str = "fp32") -> float:
    """Forward+backward throughput of one block on one micro-batch of the plan's size (layers per second).

    The fastest of `iters` timed passes after two warm-ups: a peer measures while others start beside it on a
    shared machine, and the median of passes then measured the neighbours (on a loaded 2-core machine the median
    read 22-25 layers/s where the fastest pass read 51-59 and a 2-stage swarm computed at about 41). The plan's
    FLOPs per layer are for the same micro-batch size, so the predicted compute is this time, not an
    extrapolation from another size. `precision` times the pass as a stage computes in it
    (`swarm.runtime.precision.autocast`: fp32 weights, the forward under autocast, the backward following it).
    """
    from swarm.model.spec import build_stage
    from swarm.runtime.precision import autocast

    block = build_stage(model, 0, 1, False, False).to(device)  # one block of whichever family (a middle stage)
    x = torch.randn(micro_batch_size, model.seq_len_tokens, model.hidden_dim, device=device, requires_grad=True)

    def one_pass() -> None:
        with autocast(precision, device):
            out = block(x)
        out.float().sum().backward()

    for _ in range(2):  # warm-up: allocator and kernel selection
        one_pass()
    fastest = float("inf")
    for _ in range(iters):
        start = time.perf_counter()
        one_pass()
        fastest = min(fastest, time.perf_counter() - start)
    return 1.0 / fastest


def low_precisions(device: str) -> tuple[str, ...]:
    """The precisions below fp32 a peer measures on `device`. CUDA: bf16 (where supported) and fp16. CPU: bf16
    only: CPU autocast runs fp16 too, but without an fp16 matmul (a block's pass measured 0.05-0.08x fp32's on
    an AVX-512 EPYC, torch 2.13) it is never worth planning. No int8 anywhere: torch has no int8 training path
    (its quantized kernels are inference-only, without autograd), even on a CPU with VNNI."""
    if torch.device(device).type != "cuda":
        return ("bf16",)
    return ("bf16", "fp16") if torch.cuda.is_bf16_supported() else ("fp16",)


def measure_speeds(model, device: str, micro_batch_size: int = 2, iters: int = 10) -> tuple[tuple[str, float], ...]:
    """`measure_compute` in each of `low_precisions(device)`: what a peer announces as `PeerAnnouncement.speeds`
    beside its fp32 speed. A precision that fails on the device (an autocast op it lacks) is left out."""
    speeds = []
    for precision in low_precisions(device):
        try:
            speeds.append((precision, measure_compute(model, device, iters, micro_batch_size, precision)))
        except RuntimeError:
            continue
    return tuple(speeds)


def memory_bytes() -> int:
    """Physical memory of the machine, in bytes (0 if unknown)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


def wire_bits(codec: CodecConfig) -> float:
    """Bits per element a codec puts on the wire in steady state (scales and framing aside)."""
    return float(codec.wire_bits)


def message_bytes(codec: CodecConfig, shape: tuple[int, ...], seed: int = 0) -> int:
    """Bytes one boundary message of `shape` takes on the wire, measured: a layer-normed random tensor (what a
    block's output looks like to the codec) encoded and framed at the codec's zstd level, scales and headers
    included. A codec with message buffers (aqsgd, acsgd) is measured in its steady state: the second sight of
    the samples, a quantized delta against the buffers the first sight filled."""
    from swarm.compression import LinkState, frame

    gen = torch.Generator().manual_seed(seed)

    def sample() -> torch.Tensor:
        return torch.nn.functional.layer_norm(torch.randn(shape, generator=gen), shape[-1:])

    encoder, x = make_codec(codec), sample()
    if encoder.uses_buffers:
        state, ids = LinkState(codec), list(range(shape[0]))
        encoder.encode(x, sample_ids=ids, state=state)  # first sight: fills the buffers
        msg = encoder.encode(x + 0.1 * sample(), sample_ids=ids, state=state)
    else:
        msg = encoder.encode(x)
    return sum(chunk.ByteSize() for chunk in frame(msg, zstd_level=codec.zstd_level))


def model_spec(
    model: ModelConfig,
    forward: CodecConfig,
    backward: CodecConfig,
    micro_batch_size: int = REFERENCE_MICRO_BATCH,
    micro_batches: int = REFERENCE_MICRO_BATCHES,
    step_overhead_s: float = 0.0,
) -> ModelSpec:
    """The cost model's figures for our GPT as the run trains it: the trainer's micro-batch size and count
    (what the plan's step is), the codecs' measured message bytes (`message_bytes`), full-duplex links."""
    spec = ModelSpec.transformer(
        TransformerShape(
            layers=model.n_layers,
            hidden=model.hidden_dim,
            seq_len=model.seq_len_tokens,
            micro_batch_size=micro_batch_size,
            micro_batches=micro_batches,
            forward_bits=wire_bits(forward),
            backward_bits=wire_bits(backward),
            optimizer_bytes_per_param=16.0,
        )
    )
    shape = (micro_batch_size, model.seq_len_tokens, model.hidden_dim)
    return dataclasses.replace(
        spec,
        forward_bytes=float(message_bytes(forward, shape)),
        backward_bytes=float(message_bytes(backward, shape)),
        full_duplex=True,
        step_overhead_s=step_overhead_s,
        tied_bytes=tied_bytes(model, backward),
    )


def tied_bytes(model: ModelConfig, backward: CodecConfig) -> float:
    """Bytes each end stage sends the other per step for the tied embedding's gradient sum: the backward codec as
    the averager configures it for the tied group (`GradientAverager._config`: at least `tied_min_bits`, error
    feedback where the codec has it, fp32 for a codec with sample buffers), measured on a [vocab, hidden] tensor;
    0 for an untied model."""
    from swarm.compression import codec_class
    from swarm.runtime.average import GradientAverager

    if model.n_layers < 2 or not getattr(model, "tied_embeddings", True):
        return 0.0
    backward = codec_class(backward.name).sum_config(backward)  # as the averager: gsign's sums are gradq's
    cls = codec_class(backward.name)
    if cls.uses_buffers:
        config = CodecConfig("fp32", zstd_level=backward.zstd_level)
    else:
        bits = max(backward.bits, GradientAverager.tied_min_bits) if cls.quantized else backward.bits
        config = dataclasses.replace(backward, bits=bits, error_feedback=cls.error_feedback)
    return float(message_bytes(config, (model.vocab_size, model.hidden_dim)))
