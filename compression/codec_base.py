"""The interface every codec implements: encode a tensor into a wire message, decode one, estimate the ratio.

A codec lives in its own `codec_*` module as a subclass of `Codec` that declares its name (as configs and the
command line spell it), its wire enum (proto/wire.proto's `Codec`) and its traits; the module lists it in
`CODECS`, and `swarm.compression.codecs` registers the module. Codecs are stateless: whatever must persist
between messages (AQ-SGD message buffers, the error-feedback residual) lives in an explicit `LinkState` that
the runtime owns, one per link end and direction.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch

from swarm.compression.wire import (
    DEFAULT_LIMITS,
    WireError,
    WireLimits,
    check_shape,
    codec_name,
    torch_dtype,
    wire_dtype,
)
from swarm.kernels import all_finite
from swarm.proto import wire_pb2

if TYPE_CHECKING:
    from swarm.compression.codec_config import CodecConfig
    from swarm.compression.state import LinkState


class Codec:
    """encode a tensor into a wire message; decode a checked wire message into a tensor; estimate the ratio."""

    name: ClassVar[str] = ""
    """the codec's name in configs, labels and on the command line, e.g. `aqsgd`"""
    wire: ClassVar[int] = wire_pb2.CODEC_UNSPECIFIED
    """the proto enum that marks its messages on the wire (one per codec, never reused)"""
    quantized: ClassVar[bool] = False
    """takes a bit width (`CodecConfig.bits`), written in its label: `directq4`"""
    error_feedback: ClassVar[bool] = False
    """can carry its quantization error into the next message (`CodecConfig.error_feedback`, label `+ef`)"""
    uses_buffers: ClassVar[bool] = False
    """needs AQ-SGD message buffers in its `LinkState`"""
    rotates: ClassVar[bool] = False
    """reads `TensorMessage.rotation`; every other codec refuses a message that sets it (it would decode unrotated)"""
    ranked: ClassVar[bool] = False
    """takes a rank (`CodecConfig.rank`), written in its label where a quantized codec writes its bits: `lowrank4`"""
    rated: ClassVar[bool] = False
    """takes a rate weight (`CodecConfig.rate_percent`, label suffix `+rN`)"""
    compact_scales: ClassVar[bool] = False
    """can send its group scales in 16 bits (`CodecConfig.scale_dtype`, label suffixes `+cs`, `+bs`)"""
    sparse: ClassVar[bool] = False
    """sends only the `CodecConfig.keep` largest elements of each group (label suffix `+kN`)"""
    low_bit_first_sights: ClassVar[bool] = False
    """can send a sample's first sight in its own sub-2-bit delta code (`CodecConfig.first_sight_delta_code`,
    label suffix `+fsd`)"""
    clipped_first_sights: ClassVar[bool] = False
    """can choose each group's scale of a quantized first sight by least squared error below its max |x|
    (`CodecConfig.first_sight_clip`, label suffix `+clip`; `compression.clipping`)"""
    subspace_first_sights: ClassVar[bool] = False
    """can send a sample's first sight subspace-coded (`CodecConfig.first_sight_rank`, label suffix `+fslR` with
    its step `+sN`; `compression.subspace`)"""
    subspace_deltas: ClassVar[bool] = False
    """can send a buffered sample's later visits subspace-coded (`CodecConfig.delta_rank`, label suffix `+dslR`;
    `compression.subspace`)"""
    device_encoded: ClassVar[bool] = False
    """a sending end on a GPU encodes there, its message buffers kept on the device (kernels for its quantizer
    on CUDA); every other codec's ends encode on the host"""
    per_parameter: ClassVar[bool] = False
    """codes a flat gradient parameter by parameter, against the shapes its config's `layout` gives (the averager
    sets them from the stage's parameters)"""

    TRAITS: ClassVar[tuple[str, ...]] = (
        "quantized",
        "error_feedback",
        "uses_buffers",
        "rotates",
        "ranked",
        "rated",
        "compact_scales",
        "sparse",
        "low_bit_first_sights",
        "clipped_first_sights",
        "subspace_first_sights",
        "subspace_deltas",
        "device_encoded",
        "per_parameter",
    )
    """The boolean traits every codec declares (its own or inherited); the registry checks them at import."""

    @classmethod
    def check(cls, config: CodecConfig) -> None:
        """Refuses (ValueError) values of this codec's own parameters that it cannot send; `CodecConfig` checks
        the shared ones, and that a codec's fields are left at their defaults for codecs without the trait."""

    @classmethod
    def label(cls, config: CodecConfig) -> str:
        """The short name of `config` for tables, plots and plans: the name, the bit width of a quantized codec,
        then suffixes for what differs from the defaults: `aqsgd2`, `gradq4+ef`, `aqsgd2+ch`, `gradq2+ef+rot+cs`,
        `tern+ch+r50` (rounding and group size are not part of it; `CodecConfig.parse` reads it back)."""
        return (
            (f"{cls.name}{config.bits}" if cls.quantized else cls.name)
            + ("+ef" if config.error_feedback else "")
            + ("+ch" if config.group_layout == "channel" else "")
            + ("+rot" if config.rotation == "hadamard" else "")
            + {"float32": "", "auto": "+cs", "bfloat16": "+bs"}[config.scale_dtype]
            + (f"+r{config.rate_percent}" if config.rate_percent else "")
            + (f"+fs{config.first_sight_bits}" if config.first_sight_bits != 16 else "")
            + ("+fsd" if config.first_sight_delta_code else "")
            + ("+clip" if config.first_sight_clip else "")
            + (f"+fsl{config.first_sight_rank}" if config.first_sight_rank else "")
            + (f"+fslw{config.first_sight_width_divisor}" if config.first_sight_width_divisor else "")
            + (f"+fsle{config.first_sight_energy}" if config.first_sight_energy else "")
            + (f"+dsl{config.delta_rank}" if config.delta_rank else "")
            + (f"+s{config.subspace_step_percent}" if config.subspace_step_percent and cls.uses_buffers else "")
        )

    @classmethod
    def nominal_bits(cls, config: CodecConfig) -> float:
        """Bits per element of the codes themselves, scales aside (the codec benchmark's `bits` column): a
        quantized codec's bit width; any other codec says its own."""
        if not cls.quantized:
            raise NotImplementedError(f"{cls.__name__} must say its nominal bits")
        return config.bits

    @classmethod
    def sum_config(cls, config: CodecConfig) -> CodecConfig:
        """The config a replicas' or tied gradient sum starts from when this codec is the backward codec (the
        averager then applies its bit floors): the same config, unless the codec has no bit width to raise."""
        return config

    def __init__(self, config: CodecConfig):
        self.config = config

    @classmethod
    def wire_bits(cls, config: CodecConfig) -> int:
        """Bits per element this codec puts on the wire in steady state (scales and framing aside): the planner's
        figure. A quantized codec's is its bit width; any other codec says its own."""
        if not cls.quantized:
            raise NotImplementedError(f"{cls.__name__} must say its wire bits")
        return config.bits

    def encode(
        self, x: torch.Tensor, *, sample_ids: list[int] | None = None, state: LinkState | None = None
    ) -> wire_pb2.TensorMessage:
        check_finite(x, "tensor to encode")
        msg = wire_pb2.TensorMessage(shape=list(x.shape), dtype=wire_dtype(x.dtype), codec=self.wire)
        if sample_ids is not None:
            msg.sample_ids.extend(int(s) for s in sample_ids)
        self._encode_body(x, msg, state)
        return msg

    def decode(
        self, msg: wire_pb2.TensorMessage, *, state: LinkState | None = None, limits: WireLimits = DEFAULT_LIMITS
    ) -> torch.Tensor:
        if msg.codec != self.wire:
            raise WireError("codec", f"message is {codec_name(msg.codec)}, this decoder is {codec_name(self.wire)}")
        if not self.rotates and (msg.rotation or msg.rotation_seed):
            raise WireError("rotation", f"{codec_name(self.wire)} messages are never rotated")
        if not self.subspace_first_sights and msg.HasField("first_sight_basis"):
            raise WireError("first_sight_basis", f"{codec_name(self.wire)} messages carry no subspace first sights")
        if not self.subspace_deltas and msg.HasField("delta_basis"):
            raise WireError("delta_basis", f"{codec_name(self.wire)} messages carry no subspace-coded deltas")
        numel = check_shape(list(msg.shape), limits)
        dtype = torch_dtype(msg.dtype)
        body = self._decode_body(msg, numel, state)
        out = body.to(dtype)
        if torch.finfo(dtype).max < torch.finfo(body.dtype).max:  # a narrowing cast (to fp16) may overflow
            check_wire_finite(out, "dtype")
        return out.view(tuple(msg.shape))

    def ratio(self, numel: int) -> float:
        """fp32 bytes over this codec's payload bytes for a tensor of `numel` elements (before zstd)."""
        return 4 * numel / max(1, self.payload_nbytes(numel))

    def payload_nbytes(self, numel: int) -> int:
        raise NotImplementedError

    def _encode_body(self, x: torch.Tensor, msg: wire_pb2.TensorMessage, state: LinkState | None) -> None:
        raise NotImplementedError

    def _decode_body(self, msg: wire_pb2.TensorMessage, numel: int, state: LinkState | None) -> torch.Tensor:
        raise NotImplementedError


def check_finite(x: torch.Tensor, what: str) -> None:
    """Refuses to send a tensor with NaN or Inf."""
    if not all_finite(x):
        raise ValueError(f"{what} contains NaN or Inf; refusing to send garbage")


def decoded_bound(msg: wire_pb2.TensorMessage, *dtypes: torch.dtype) -> float:
    """Largest magnitude a decoded value of `msg` may have: what its declared dtype (and any of `dtypes` the
    values pass through, e.g. a message buffer's) holds as a finite number."""
    return min(torch.finfo(d).max for d in (torch_dtype(msg.dtype), *dtypes))


def check_wire_finite(x: torch.Tensor, field: str) -> None:
    """Refuses a received tensor with NaN or Inf, naming the field it came in."""
    if not all_finite(x):
        raise WireError(field, "tensor contains NaN or Inf")
