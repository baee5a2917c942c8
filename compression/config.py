"""Configuration of one codec on one link direction (frozen, validated on construction)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from swarm.compression.codecs import BY_NAME, CODEC_NAMES, codec_class
from swarm.compression.quantized import SUPPORTED_BITS


@dataclass(frozen=True)
class CodecConfig:
    """What a link direction sends and how."""

    name: str = "fp32"
    """codec: a name in the codec registry (`swarm.compression.codecs.CODEC_NAMES`)"""
    bits: int = 4
    """bits per element of the quantized codecs (2, 3, 4 or 8)"""
    group_size: int | None = None
    """elements per quantization group (None: the kernels' measured default)"""
    stochastic: bool = True
    """stochastic (unbiased) rounding; False rounds to nearest"""
    seed: int = 0
    """seed of the stochastic rounding, so runs repeat"""
    error_feedback: bool = False
    """codecs with error feedback (gradq): carry each micro-batch's quantization error into the next micro-batch
    of the same step"""
    buffer_dtype: str = "float16"
    """aqsgd: dtype of the message buffers (float16 or bfloat16)"""
    buffer_capacity: int = 1 << 20
    """aqsgd: samples a link's buffer store holds; past it, new samples always travel in full"""
    buffer_path: str | None = None
    """aqsgd: a file for the memory-mapped buffer store of one `LinkState` (data sets larger than memory); None
    keeps it in RAM"""
    buffer_dir: str | None = None
    """aqsgd: a directory for the memory-mapped buffer stores of a stage's link ends, one file per end (the
    runtime's `Direction` names them: `fw-recv.buf`, `fw-send-<destination>.buf`); None keeps them in RAM"""
    first_sight_bits: int = 16
    """aqsgd: how a sample's first sight travels: 16 = in the buffer dtype, 8 or 4 = quantized directly"""
    zstd_level: int = 1
    """zstd level of the framing (0 turns zstd off); skipped per message when it does not shrink it"""

    def __post_init__(self) -> None:
        codec = codec_class(self.name)
        if codec.quantized and self.bits not in SUPPORTED_BITS:
            raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {self.bits}")
        if self.group_size is not None and not 1 <= self.group_size <= 65536:
            raise ValueError(f"group_size must be in 1..65536, got {self.group_size}")
        if self.buffer_dtype not in ("float16", "bfloat16"):
            raise ValueError(f"buffer_dtype must be float16 or bfloat16, got {self.buffer_dtype!r}")
        if self.first_sight_bits not in (16, *SUPPORTED_BITS):
            raise ValueError(f"first_sight_bits must be 16 or one of {SUPPORTED_BITS}")
        if self.buffer_path is not None and self.buffer_dir is not None:
            raise ValueError("give buffer_path (one store) or buffer_dir (one file per link end), not both")
        if self.buffer_capacity < 0:
            raise ValueError("buffer_capacity must be >= 0")
        if not 0 <= self.zstd_level <= 22:
            raise ValueError(f"zstd_level must be in 0..22, got {self.zstd_level}")
        if self.error_feedback and not codec.error_feedback:
            with_feedback = " and ".join(n for n, c in BY_NAME.items() if c.error_feedback)
            raise ValueError(f"error_feedback applies to the {with_feedback} codec only")

    @property
    def torch_buffer_dtype(self) -> torch.dtype:
        return torch.float16 if self.buffer_dtype == "float16" else torch.bfloat16

    @property
    def wire_bits(self) -> int:
        """Bits per element the codec puts on the wire in steady state (scales and framing aside)."""
        return codec_class(self.name).wire_bits(self)

    @property
    def label(self) -> str:
        """Short name for tables and plots, e.g. `aqsgd2`, `gradq4+ef`."""
        if not codec_class(self.name).quantized:
            return self.name
        return f"{self.name}{self.bits}" + ("+ef" if self.error_feedback else "")

    @classmethod
    def parse(cls, text: str, **overrides) -> CodecConfig:
        """Parses `fp32`, `aqsgd2`, `gradq4`, `gradq4+ef` (as printed by `label`)."""
        error_feedback = text.endswith("+ef")
        text = text.removesuffix("+ef")
        name = text if text in CODEC_NAMES else text.rstrip("0123456789")
        digits = text[len(name) :]
        kwargs = dict(name=name, error_feedback=error_feedback)
        if digits:
            kwargs["bits"] = int(digits)
        kwargs.update(overrides)
        return cls(**kwargs)
