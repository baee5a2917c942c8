"""The explicit per-link, per-direction state that codecs read and update (codecs themselves are stateless)."""

from __future__ import annotations

import torch

from swarm.compression.buffers import BufferStore, make_store
from swarm.compression.codec_config import CodecConfig
from swarm.compression.codecs import codec_class


class LinkState:
    """One end of one link direction: AQ-SGD message buffers, gradq's error-feedback residual, an RNG seed.

    Sender and receiver each hold their own; for AQ-SGD the two buffer stores must stay bit-identical.
    """

    def __init__(self, config: CodecConfig, buffers: BufferStore | None = None):
        self.config = config
        self.buffers = buffers
        if buffers is None and codec_class(config.name).uses_buffers:
            self.buffers = make_store(config.buffer_capacity, config.torch_buffer_dtype, config.buffer_path)
        if self.buffers is not None:  # the config's budget and policy, on whatever store the runtime made
            self.buffers.eviction = config.buffer_eviction
            self.buffers.limit_bytes(config.buffer_budget_bytes)
        self.residual: torch.Tensor | None = None
        self.warm: torch.Tensor | tuple[torch.Tensor | None, ...] | None = None
        """lowrank: the encoder's Q of its last message, the next power iteration's warm start (sender-local);
        mlowrank: one such Q per parameter (None for one sent whole)"""
        self.exact_first_sights = False
        """AQ-SGD senders: first sights travel raw in the buffers' dtype whatever the config's first-sight coding
        (`+fsN`, `+fslR`): a frozen stage's activation cache (`swarm.runtime.freeze.cached_forward`) serves what
        both ends buffer for good, so that must be the output itself, not a lossy first sight. Sender-local: a
        receiver decodes by the message."""
        self._draws = 0
        self._saved: tuple[int, torch.Tensor | None] | None = None
        """the open step's starting draws and warm start (None: no step open), restored when it is abandoned"""

    def next_seed(self) -> int | None:
        """A fresh, reproducible seed for one stochastic quantization."""
        if not self.config.stochastic:
            return None
        self._draws += 1
        return (self.config.seed * 1_000_003 + self._draws) % (1 << 62)

    def begin_step(self) -> None:
        """A step starts: from here on, what this end changes is journalled until `end_step` says whether the
        step was applied (kept) or abandoned (undone exactly: buffers, rounding draws, warm start)."""
        self._saved = (self._draws, self.warm)
        if self.buffers is not None:
            self.buffers.begin()

    def end_step(self, commit: bool = True) -> None:
        """Called when a step ends: error feedback carries only across micro-batches of one step. `commit`
        False (the step was abandoned) undoes everything since `begin_step`, so a retry runs as a clean run."""
        self.residual = None
        saved, self._saved = self._saved, None
        if self.buffers is not None:
            (self.buffers.commit if commit else self.buffers.rollback)()
        if not commit and saved is not None:
            self._draws, self.warm = saved

    def journalled(self) -> int:
        """What the open step's journal holds (rows and ids; 0 outside a step or after it ended)."""
        return 0 if self.buffers is None else self.buffers.journalled()
