"""The cost model's figures for a model as a run trains it: what the codecs put on the wire per element and per
boundary message (measured by encoding), and the tied embedding's gradient sum."""

from __future__ import annotations

import dataclasses
import math

import torch

from swarm.compression import CodecConfig, LinkState, codec_class, frame, make_codec
from swarm.compression.codec_mlowrank import layout_of
from swarm.model.gpt import ModelConfig
from swarm.scheduler.plans import ModelSpec, TransformerShape

__all__ = [
    "REFERENCE_MICRO_BATCH",
    "REFERENCE_MICRO_BATCHES",
    "SPEED_SAMPLE_ELEMENTS",
    "measure_codec_speed",
    "measure_link_rungs",
    "message_bytes",
    "layer_shapes",
    "model_spec",
    "sum_bits",
    "sum_layer_bytes",
    "tied_bytes",
    "wire_bits",
]

REFERENCE_MICRO_BATCH = 2
"""Samples per micro-batch of the plan's model by default: the trainer's default split (8 samples, 4 micro-batches)."""
REFERENCE_MICRO_BATCHES = 4
"""Micro-batches per step of the plan's model by default (the trainer's default)."""


def wire_bits(codec: CodecConfig) -> float:
    """Bits per element a codec puts on the wire in steady state (scales and framing aside)."""
    return float(codec.wire_bits)


def _activations(shape: tuple[int, ...], seed: int):
    """Draws of a layer-normed random tensor of `shape` (what a block's output looks like to a codec), seeded."""
    gen = torch.Generator().manual_seed(seed)
    return lambda: torch.nn.functional.layer_norm(torch.randn(shape, generator=gen), shape[-1:])


def message_bytes(codec: CodecConfig, shape: tuple[int, ...], seed: int = 0) -> int:
    """Bytes one boundary message of `shape` takes on the wire, measured: a layer-normed random tensor (what a
    block's output looks like to the codec) encoded and framed at the codec's zstd level, scales and headers
    included. A codec with message buffers (aqsgd, acsgd) is measured in its steady state: the second sight of
    the samples, a quantized delta against the buffers the first sight filled."""
    sample = _activations(shape, seed)
    encoder, x = make_codec(codec), sample()
    if encoder.uses_buffers:
        state, ids = LinkState(codec), list(range(shape[0]))
        encoder.encode(x, sample_ids=ids, state=state)  # first sight: fills the buffers
        msg = encoder.encode(x + 0.1 * sample(), sample_ids=ids, state=state)
    else:
        msg = encoder.encode(x)
    return sum(chunk.ByteSize() for chunk in frame(msg, zstd_level=codec.zstd_level))


def measure_link_rungs(
    labels, shape: tuple[int, ...], repeats: int = 3, seed: int = 0
) -> dict[str, tuple[float, float]]:
    """Per codec label, one boundary message of `shape` as this process sends it: (its bytes on the wire,
    `message_bytes`; the seconds to encode and frame it and to decode it, the fastest of `repeats` after one that
    warms up). A codec with message buffers is timed in its steady state (a delta against the buffers the sender's
    and the receiver's first sight filled). What `swarm.scheduler.bits.link_ladder` prices each pair of peers with;
    the planner's machine stands for every peer's (peers do not announce theirs)."""
    import time

    from swarm.compression import WireLimits, decoder_for

    sample = _activations(shape, seed)
    numel = int(torch.Size(shape).numel())
    limits = WireLimits(max_dims=len(shape), max_numel=numel, max_message_bytes=8 * numel + (1 << 20))
    out = {}
    for label in dict.fromkeys(labels):
        config = CodecConfig.parse(label)
        encoder, x = make_codec(config), sample()
        ids = list(range(shape[0]))
        sent, received = LinkState(config), LinkState(config)
        if encoder.uses_buffers:  # first sights fill both ends' buffers; the timed messages are deltas
            first = encoder.encode(x, sample_ids=ids, state=sent)
            decoder_for(first, config).decode(first, state=received, limits=limits)
        best = float("inf")
        for _ in range(repeats + 1):
            y = x + 0.1 * sample()
            start = time.perf_counter()
            msg = encoder.encode(y, sample_ids=ids, state=sent) if encoder.uses_buffers else encoder.encode(y)
            sum(chunk.ByteSize() for chunk in frame(msg, zstd_level=config.zstd_level))
            decoder_for(msg, config).decode(msg, state=received if encoder.uses_buffers else None, limits=limits)
            best = min(best, time.perf_counter() - start)
        out[label] = (float(message_bytes(config, shape, seed)), best)
    return out


SPEED_SAMPLE_ELEMENTS = 1 << 18
"""Elements of the gradient `measure_codec_speed` times each codec on: large enough that a codec's per-call costs
(scales, the rotation's setup) are a small part, small enough to measure every epilogue codec in about a second."""


def measure_codec_speed(labels, elements: int = SPEED_SAMPLE_ELEMENTS, repeats: int = 3):
    """How fast this process encodes (with error feedback, framed at the codec's zstd level, as a member sends
    its message) and decodes each codec of `labels`, seconds per element: the fastest of `repeats` passes after one
    that warms up, on a random gradient, with this process's torch threads (`swarm.scheduler.bits.CodecSpeed`)."""
    import time

    from swarm.compression import WireLimits, decoder_for
    from swarm.scheduler.bits import CodecSpeed

    grad = torch.randn(elements, generator=torch.Generator().manual_seed(0)) * 1e-3
    limits = WireLimits(max_dims=1, max_numel=elements, max_message_bytes=4 * elements + (1 << 20))
    figures = []
    for label in dict.fromkeys(labels):
        config = CodecConfig.parse(label)
        codec, state = make_codec(config), LinkState(config)
        encode_s = decode_s = float("inf")
        for _ in range(repeats + 1):
            start = time.perf_counter()
            msg = codec.encode(grad, state=state)
            sum(chunk.ByteSize() for chunk in frame(msg, zstd_level=config.zstd_level))
            middle = time.perf_counter()
            decoder_for(msg, config).decode(msg, limits=limits)
            end = time.perf_counter()
            encode_s, decode_s = min(encode_s, middle - start), min(decode_s, end - middle)
        figures.append((label, encode_s / elements, decode_s / elements))
    return CodecSpeed(tuple(figures))


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
    shape = (micro_batch_size, model.seq_len_tokens, model.boundary_dim)
    tied = tied_bytes(model, backward)
    return dataclasses.replace(
        spec,
        # the replicas' sums as the averager runs them without a plan's epilogue codecs (`sum_layer_bytes`)
        gradient_bytes_per_layer=sum_layer_bytes(model, backward, spec.gradient_elements_per_layer),
        forward_bytes=float(message_bytes(forward, shape)),
        backward_bytes=float(message_bytes(backward, shape)),
        full_duplex=True,
        step_overhead_s=step_overhead_s,
        tied_bytes=tied,
        tied_shape=(model.vocab_size, model.hidden_dim) if tied else (0, 0),
    )


def sum_bits(backward: CodecConfig) -> float:
    """Wire bits an element of the replicas' gradient sum, as `GradientAverager` sums without a plan's epilogue
    codecs: `SUM_CODEC` (2 bits) behind a quantized backward codec, fp32 behind a codec with sample buffers, an
    unquantized one (fp32, bf16) as it is. (The cost model's 8 bits were the averager's floor before `SUM_CODEC`:
    with them a 2x2 swarm's predicted step at 1 Mbit/s was 3.29 s for a measured 0.61 s.)"""
    from swarm.runtime.average import group_config  # lazy: the stage runtime

    return float(group_config(None, backward).wire_bits)


def layer_shapes(model) -> tuple[tuple[int, ...], ...]:
    """The shapes of one layer's parameters (any model family: a middle stage of one layer, built on the meta device,
    so a wide model's layer is never allocated), in the order a stage's averager lays them out (by name)."""
    from swarm.model.spec import build_stage

    layer = min(1, model.n_layers - 1)
    with torch.device("meta"):
        stage = build_stage(model, layer, layer + 1, False, False)
    return layout_of(p for _, p in sorted(stage.named_parameters()))


def sum_layer_bytes(model: ModelConfig, backward: CodecConfig, elements: float) -> float:
    """Bytes of one layer's share of a replica's sum message, as `GradientAverager` sums without a plan's epilogue
    codecs: a per-parameter codec (`SUM_CODEC`, mlowrank) priced on one block's shapes, any other at
    its wire bits (`sum_bits`) for `elements`."""
    from swarm.runtime.average import group_config  # lazy: the stage runtime

    config = group_config(None, backward)
    if codec_class(config.name).per_parameter:
        layout = layer_shapes(model)
        return float(make_codec(dataclasses.replace(config, layout=layout)).payload_nbytes(
            sum(math.prod(shape) for shape in layout)))  # fmt: skip
    return elements * sum_bits(backward) / 8


def tied_bytes(model: ModelConfig, backward: CodecConfig) -> float:
    """Bytes each end stage sends the other per step for the tied embedding's gradient sum, as the averager sums it
    without a plan (`GradientAverager._config`: `TIED_CODEC` behind compressed links, factoring the weight's
    [vocab, hidden] matrix; fp32 or bf16 links as they are; fp32 behind a codec with sample buffers), measured on a
    [vocab, hidden] tensor; 0 for an untied model."""
    from swarm.runtime.average import group_config  # lazy: the stage runtime

    if model.n_layers < 2 or not getattr(model, "tied_embeddings", True):
        return 0.0
    config = group_config(None, backward, tied=True, tied_cols=model.hidden_dim)  # the averager's view of the weight
    return float(message_bytes(config, (model.vocab_size, model.hidden_dim)))
