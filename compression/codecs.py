"""The codecs: one small interface (encode, decode, ratio) and a registry keyed by the wire enum.

Codecs are stateless; whatever must persist between messages (AQ-SGD message buffers, the error-feedback
residual) lives in an explicit `LinkState` that the runtime owns, one per link end and direction.
"""

from __future__ import annotations

import functools
import math

import torch

from swarm.compression.config import CodecConfig
from swarm.compression.state import LinkState
from swarm.compression.wire import (
    DEFAULT_LIMITS,
    WireError,
    WireLimits,
    bytes_to_tensor,
    check_shape,
    codec_name,
    tensor_to_bytes,
    torch_dtype,
    wire_dtype,
)
from swarm.kernels import (
    DEFAULT_GROUP_SIZE,
    QuantizedTensor,
    apply_delta,
    aqsgd_update,
    dequantize,
    packed_nbytes,
    quantize,
)
from swarm.proto import wire_pb2


class BufferMissError(LookupError):
    """The receiver holds no message buffer for these sample ids (e.g. it restarted): resend them in full."""

    def __init__(self, sample_ids: list[int]):
        super().__init__(f"no AQ-SGD buffer for sample ids {sample_ids[:8]}{'...' if len(sample_ids) > 8 else ''}")
        self.sample_ids = sample_ids


def _check_finite(x: torch.Tensor, what: str) -> None:
    if x.numel() and not bool(torch.isfinite(x).all()):
        raise ValueError(f"{what} contains NaN or Inf; refusing to send garbage")


# ---- quantized parts -------------------------------------------------------------------------------------


def _pack_quantized(q: QuantizedTensor, out: wire_pb2.Quantized) -> None:
    out.bits, out.group_size, out.numel = q.bits, q.group_size, q.numel
    out.scale_dtype = wire_dtype(q.scales.dtype)
    out.scales = tensor_to_bytes(q.scales)
    out.mins = tensor_to_bytes(q.mins)
    out.payload = q.packed.numpy().tobytes()


def _unpack_quantized(msg: wire_pb2.Quantized, numel: int, field: str) -> QuantizedTensor:
    if msg.bits not in (2, 3, 4, 8):
        raise WireError(f"{field}.bits", f"unsupported bit width {msg.bits}")
    if not 1 <= msg.group_size <= 65536:
        raise WireError(f"{field}.group_size", f"{msg.group_size} is outside 1..65536")
    if msg.numel != numel:
        raise WireError(f"{field}.numel", f"{msg.numel} does not match the {numel} elements the shape implies")
    if len(msg.payload) != packed_nbytes(numel, msg.bits):
        raise WireError(
            f"{field}.payload",
            f"{len(msg.payload)} bytes, expected {packed_nbytes(numel, msg.bits)} for {numel} x {msg.bits} bits",
        )
    groups = math.ceil(numel / msg.group_size)
    scale_dtype = torch_dtype(msg.scale_dtype, f"{field}.scale_dtype")
    scales = bytes_to_tensor(msg.scales, scale_dtype, groups, f"{field}.scales")
    mins = bytes_to_tensor(msg.mins, scale_dtype, groups, f"{field}.mins")
    if groups and not (bool(torch.isfinite(scales).all()) and bool(torch.isfinite(mins).all())):
        raise WireError(f"{field}.scales", "contains NaN or Inf")
    packed = bytes_to_tensor(msg.payload, torch.uint8, len(msg.payload), f"{field}.payload")
    return QuantizedTensor(packed, scales, mins, msg.bits, msg.group_size, numel)


def _group_size(config: CodecConfig) -> int:
    return config.group_size or DEFAULT_GROUP_SIZE


@functools.cache
def _scale_itemsize() -> int:
    return quantize(torch.zeros(1), 8, 1, stochastic=False).scales.element_size()


def quantized_nbytes(numel: int, bits: int, group_size: int) -> int:
    """Wire bytes of a quantized tensor: the packed payload plus a scale and a minimum per group."""
    return packed_nbytes(numel, bits) + 2 * math.ceil(numel / group_size) * _scale_itemsize()


# ---- codecs -------------------------------------------------------------------------------------------------


class Codec:
    """encode a tensor into a wire message; decode a checked wire message into a tensor; estimate the ratio."""

    wire: int = wire_pb2.CODEC_UNSPECIFIED

    def __init__(self, config: CodecConfig):
        self.config = config

    def encode(
        self, x: torch.Tensor, *, sample_ids: list[int] | None = None, state: LinkState | None = None
    ) -> wire_pb2.TensorMessage:
        _check_finite(x, "tensor to encode")
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
        numel = check_shape(list(msg.shape), limits)
        dtype = torch_dtype(msg.dtype)
        return self._decode_body(msg, numel, state).to(dtype).view(*msg.shape)

    def ratio(self, numel: int) -> float:
        """fp32 bytes over this codec's payload bytes for a tensor of `numel` elements (before zstd)."""
        return 4 * numel / max(1, self.payload_nbytes(numel))

    def payload_nbytes(self, numel: int) -> int:
        raise NotImplementedError

    def _encode_body(self, x: torch.Tensor, msg: wire_pb2.TensorMessage, state: LinkState | None) -> None:
        raise NotImplementedError

    def _decode_body(self, msg: wire_pb2.TensorMessage, numel: int, state: LinkState | None) -> torch.Tensor:
        raise NotImplementedError


class _RawCodec(Codec):
    """The tensor cast to one float dtype."""

    dtype: torch.dtype = torch.float32

    def payload_nbytes(self, numel: int) -> int:
        return numel * self.dtype.itemsize

    def _encode_body(self, x, msg, state):
        msg.raw_dtype = wire_dtype(self.dtype)
        msg.raw = tensor_to_bytes(x.to(self.dtype))

    def _decode_body(self, msg, numel, state):
        if msg.raw_dtype != wire_dtype(self.dtype):
            raise WireError("raw_dtype", f"expected {self.dtype} for {codec_name(self.wire)}")
        x = bytes_to_tensor(msg.raw, self.dtype, numel, "raw")
        _check_wire_finite(x, "raw")
        return x


def _check_wire_finite(x: torch.Tensor, field: str) -> None:
    if x.numel() and not bool(torch.isfinite(x).all()):
        raise WireError(field, "tensor contains NaN or Inf")


class FP32Codec(_RawCodec):
    wire, dtype = wire_pb2.FP32, torch.float32


class FP16Codec(_RawCodec):
    wire, dtype = wire_pb2.FP16, torch.float16


class BF16Codec(_RawCodec):
    wire, dtype = wire_pb2.BF16, torch.bfloat16


class DirectQCodec(Codec):
    """Per-group quantization of the tensor itself (the AQ-SGD paper's DirectQ baseline)."""

    wire = wire_pb2.DIRECTQ

    def payload_nbytes(self, numel: int) -> int:
        return quantized_nbytes(numel, self.config.bits, _group_size(self.config))

    def _quantize(self, x: torch.Tensor, state: LinkState | None) -> QuantizedTensor:
        seed = state.next_seed() if state is not None else None
        return quantize(x, self.config.bits, _group_size(self.config), stochastic=self.config.stochastic, seed=seed)

    def _encode_body(self, x, msg, state):
        _pack_quantized(self._quantize(x, state), msg.quantized)

    def _decode_body(self, msg, numel, state):
        return dequantize(_unpack_quantized(msg.quantized, numel, "quantized"))


class GradQCodec(DirectQCodec):
    """Quantized activation gradients; with error feedback, each micro-batch's quantization error is added to
    the next micro-batch's gradient within the same step (Optimus-CC's lazy error propagation)."""

    wire = wire_pb2.GRADQ

    def _encode_body(self, x, msg, state):
        use_feedback = self.config.error_feedback and state is not None
        if use_feedback and state.residual is not None and state.residual.shape == x.shape:
            x = x.float() + state.residual
        q = self._quantize(x, state)
        if use_feedback:
            state.residual = x.float() - dequantize(q).view(x.shape)
        _pack_quantized(q, msg.quantized)


class AQSGDCodec(Codec):
    """AQ-SGD: per sample, the quantized change since the sample was last seen, against a message buffer `m`
    held identically by sender and receiver; a sample's first sight travels in full and initialises `m`.
    The receiver computes on `m`, not on the true activation."""

    wire = wire_pb2.AQSGD

    def payload_nbytes(self, numel: int) -> int:  # steady state: every sample is a delta
        return quantized_nbytes(numel, self.config.bits, _group_size(self.config))

    def _encode_body(self, x, msg, state):
        if state is None or state.buffers is None:
            raise ValueError("the aqsgd codec needs a LinkState with message buffers")
        if len(msg.sample_ids) != x.shape[0]:
            raise ValueError(f"aqsgd needs one sample id per row: {len(msg.sample_ids)} ids for {x.shape[0]} rows")
        ids = list(msg.sample_ids)
        if len(set(ids)) != len(ids):
            raise ValueError("aqsgd needs distinct sample ids within a message")
        store, cfg = state.buffers, self.config
        slots = store.lookup(ids)
        is_delta = [s >= 0 for s in slots]
        msg.sample_is_delta.extend(is_delta)
        delta_rows = [i for i, d in enumerate(is_delta) if d]
        full_rows = [i for i, d in enumerate(is_delta) if not d]
        if delta_rows:
            # communication: only the quantized change of each seen sample; m moves by exactly what was sent
            m = store.gather([slots[i] for i in delta_rows])
            q = aqsgd_update(
                x[delta_rows], m, cfg.bits, _group_size(cfg), stochastic=cfg.stochastic, seed=state.next_seed()
            )
            store.scatter([slots[i] for i in delta_rows], m)
            _pack_quantized(q, msg.quantized)
        if full_rows:
            first = self._first_sight(x[full_rows], state, msg)
            store.admit([ids[i] for i in full_rows], first)

    def _first_sight(self, x: torch.Tensor, state: LinkState, msg: wire_pb2.TensorMessage) -> torch.Tensor:
        """Sends new samples in full (buffer dtype) or directly quantized; returns what both ends buffer."""
        cfg, buffer_dtype = self.config, state.buffers.dtype
        msg.raw_dtype = wire_dtype(buffer_dtype)
        if cfg.first_sight_bits == 16:
            first = x.to(buffer_dtype)
            msg.raw = tensor_to_bytes(first)
            return first
        q = quantize(x, cfg.first_sight_bits, _group_size(cfg), stochastic=cfg.stochastic, seed=state.next_seed())
        _pack_quantized(q, msg.quantized_full)
        return dequantize(q).view(x.shape).to(buffer_dtype)

    def _decode_body(self, msg, numel, state):
        if state is None or state.buffers is None:
            raise ValueError("the aqsgd codec needs a LinkState with message buffers")
        shape = list(msg.shape)
        if not shape or len(msg.sample_ids) != shape[0]:
            raise WireError("sample_ids", f"{len(msg.sample_ids)} ids for a tensor of shape {shape}")
        if len(msg.sample_is_delta) != len(msg.sample_ids):
            raise WireError("sample_is_delta", f"{len(msg.sample_is_delta)} flags for {len(msg.sample_ids)} ids")
        ids = list(msg.sample_ids)
        if len(set(ids)) != len(ids):
            raise WireError("sample_ids", "ids repeat within one message")
        per_sample = numel // shape[0] if shape[0] else 0
        store = state.buffers
        delta_rows = [i for i, d in enumerate(msg.sample_is_delta) if d]
        full_rows = [i for i, d in enumerate(msg.sample_is_delta) if not d]
        slots = store.lookup(ids)
        missing = [ids[i] for i in delta_rows if slots[i] < 0]
        if missing:
            raise BufferMissError(missing)
        out = torch.empty((shape[0], *shape[1:]), dtype=store.dtype)
        if delta_rows:
            q = _unpack_quantized(msg.quantized, len(delta_rows) * per_sample, "quantized")
            m = store.gather([slots[i] for i in delta_rows])
            apply_delta(m, q)
            store.scatter([slots[i] for i in delta_rows], m)
            out[delta_rows] = m
        if full_rows:
            n_full = len(full_rows) * per_sample
            if msg.HasField("quantized_full"):
                first = dequantize(_unpack_quantized(msg.quantized_full, n_full, "quantized_full"))
            else:
                if msg.raw_dtype != wire_dtype(store.dtype):
                    raise WireError("raw_dtype", f"expected the buffer dtype {store.dtype}")
                first = bytes_to_tensor(msg.raw, store.dtype, n_full, "raw")
                _check_wire_finite(first, "raw")
            first = first.view(len(full_rows), *shape[1:]).to(store.dtype)
            store.admit([ids[i] for i in full_rows], first)
            out[full_rows] = first
        return out


REGISTRY: dict[int, type[Codec]] = {
    wire_pb2.FP32: FP32Codec,
    wire_pb2.FP16: FP16Codec,
    wire_pb2.BF16: BF16Codec,
    wire_pb2.DIRECTQ: DirectQCodec,
    wire_pb2.AQSGD: AQSGDCodec,
    wire_pb2.GRADQ: GradQCodec,
}
BY_NAME = {cls.__name__.removesuffix("Codec").lower(): cls for cls in REGISTRY.values()}

_missing = set(wire_pb2.Codec.values()) - {wire_pb2.CODEC_UNSPECIFIED} - set(REGISTRY)
if _missing:  # checked at import: every wire enum has a codec
    raise ImportError(f"codecs missing for wire enums {[wire_pb2.Codec.Name(v) for v in _missing]}")


def make_codec(config: CodecConfig) -> Codec:
    return BY_NAME[config.name](config)


def decoder_for(msg: wire_pb2.TensorMessage, config: CodecConfig | None = None) -> Codec:
    """The codec that reads `msg`; an unknown enum is a clear error."""
    if msg.codec not in REGISTRY:
        raise WireError("codec", f"unknown codec enum {msg.codec}")
    cls = REGISTRY[msg.codec]
    return cls(config if config is not None and BY_NAME[config.name] is cls else CodecConfig(name=_name(cls)))


def _name(cls: type[Codec]) -> str:
    return cls.__name__.removesuffix("Codec").lower()


__all__ = ["REGISTRY", "BufferMissError", "Codec", "decoder_for", "make_codec", "quantized_nbytes"]
