"""DirectQ: per-group quantization of the tensor itself (the AQ-SGD paper's baseline)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from swarm.compression.codec_base import Codec, decoded_bound
from swarm.compression.quantized import group_size, pack_quantized, quantized_nbytes, unpack_quantized
from swarm.kernels import QuantizedTensor, dequantize, quantize
from swarm.proto import wire_pb2

if TYPE_CHECKING:
    from swarm.compression.state import LinkState


class DirectQCodec(Codec):
    """Per-group quantization of the tensor itself (the AQ-SGD paper's DirectQ baseline)."""

    name, wire, quantized = "directq", wire_pb2.DIRECTQ, True

    def payload_nbytes(self, numel: int) -> int:
        return quantized_nbytes(numel, self.config.bits, group_size(self.config))

    def _quantize(self, x: torch.Tensor, state: LinkState | None) -> QuantizedTensor:
        seed = state.next_seed() if state is not None else None
        return quantize(x, self.config.bits, group_size(self.config), stochastic=self.config.stochastic, seed=seed)

    def _encode_body(self, x, msg, state):
        pack_quantized(self._quantize(x, state), msg.quantized)

    def _decode_body(self, msg, numel, state):
        return dequantize(unpack_quantized(msg.quantized, numel, "quantized", decoded_bound(msg)))


CODECS = (DirectQCodec,)
