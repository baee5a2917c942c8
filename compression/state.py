"""The explicit per-link, per-direction state that codecs read and update (codecs themselves are stateless)."""

from __future__ import annotations

import torch

from swarm.compression.buffers import BufferStore, make_store
from swarm.compression.codecs import codec_class
from swarm.compression.config import CodecConfig


class LinkState:
    """One end of one link direction: AQ-SGD message buffers, gradq's error-feedback residual, an RNG seed.

    Sender and receiver each hold their own; for AQ-SGD the two buffer stores must stay bit-identical.
    """

    def __init__(self, config: CodecConfig, buffers: BufferStore | None = None):
        self.config = config
        self.buffers = buffers
        if buffers is None and codec_class(config.name).uses_buffers:
            self.buffers = make_store(config.buffer_capacity, config.torch_buffer_dtype, config.buffer_path)
        self.residual: torch.Tensor | None = None
        self.warm: torch.Tensor | None = None
        """lowrank: the encoder's Q of its last message, the next power iteration's warm start (sender-local)"""
        self._draws = 0

    def next_seed(self) -> int | None:
        """A fresh, reproducible seed for one stochastic quantization."""
        if not self.config.stochastic:
            return None
        self._draws += 1
        return (self.config.seed * 1_000_003 + self._draws) % (1 << 62)

    def end_step(self) -> None:
        """Called after each optimizer step: error feedback carries only across micro-batches of one step."""
        self.residual = None
