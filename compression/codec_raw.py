"""The raw codecs: the tensor cast to one float dtype (fp32, fp16, bf16)."""

from __future__ import annotations

import torch

from swarm.compression.codec_base import Codec, check_wire_finite
from swarm.compression.wire import WireError, bytes_to_tensor, codec_name, tensor_to_bytes, wire_dtype
from swarm.proto import wire_pb2


class _RawCodec(Codec):
    """The tensor cast to one float dtype."""

    dtype: torch.dtype = torch.float32

    @classmethod
    def wire_bits(cls, config) -> int:
        return 8 * cls.dtype.itemsize

    @classmethod
    def nominal_bits(cls, config) -> float:
        return 8 * cls.dtype.itemsize

    def payload_nbytes(self, numel: int) -> int:
        return numel * self.dtype.itemsize

    def _encode_body(self, x, msg, state):
        msg.raw_dtype = wire_dtype(self.dtype)
        msg.raw = tensor_to_bytes(x.to(self.dtype))

    def _decode_body(self, msg, numel, state):
        if msg.raw_dtype != wire_dtype(self.dtype):
            raise WireError("raw_dtype", f"expected {self.dtype} for {codec_name(self.wire)}")
        x = bytes_to_tensor(msg.raw, self.dtype, numel, "raw")
        check_wire_finite(x, "raw")
        return x


class FP32Codec(_RawCodec):
    name, wire, dtype = "fp32", wire_pb2.FP32, torch.float32


class FP16Codec(_RawCodec):
    name, wire, dtype = "fp16", wire_pb2.FP16, torch.float16


class BF16Codec(_RawCodec):
    name, wire, dtype = "bf16", wire_pb2.BF16, torch.bfloat16


CODECS = (FP32Codec, FP16Codec, BF16Codec)
