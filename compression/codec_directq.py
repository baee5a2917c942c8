"""DirectQ: per-group quantization of the tensor itself (the AQ-SGD paper's baseline)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from swarm.compression.codec_base import Codec, decoded_bound
from swarm.compression.layout import from_groups, group_for, layout_for, read_layout, to_groups, write_layout
from swarm.compression.quantized import group_size, pack_quantized, quantized_nbytes, unpack_quantized
from swarm.kernels import QuantizedTensor, dequantize, quantize
from swarm.proto import wire_pb2

if TYPE_CHECKING:
    from swarm.compression.state import LinkState


class DirectQCodec(Codec):
    """Per-group quantization of the tensor itself (the AQ-SGD paper's DirectQ baseline), in the config's group
    layout (`compression.layout`: flat, or one group per channel of a sample across its tokens)."""

    name, wire, quantized = "directq", wire_pb2.DIRECTQ, True

    def payload_nbytes(self, numel: int) -> int:
        return quantized_nbytes(numel, self.config.bits, group_size(self.config))

    def _quantize(self, x: torch.Tensor, state: LinkState | None, group: int | None = None) -> QuantizedTensor:
        seed = state.next_seed() if state is not None else None
        group = group or group_size(self.config)
        return quantize(x, self.config.bits, group, stochastic=self.config.stochastic, seed=seed)

    def _quantize_laid_out(self, x: torch.Tensor, msg, state: LinkState | None) -> tuple[QuantizedTensor, str]:
        """`x` quantized in the layout the config asks for (and `x` fits); marks `msg` with it. Returns the
        codes (in group order: `from_groups` puts their dequantized values back in `x`'s shape) and the layout."""
        layout = layout_for(self.config, x.shape)
        write_layout(msg, layout)
        return self._quantize(to_groups(x, layout), state, group_for(self.config, layout, x.shape)), layout

    def _encode_body(self, x, msg, state):
        pack_quantized(self._quantize_laid_out(x, msg, state)[0], msg.quantized)

    def _decode_body(self, msg, numel, state):
        shape = list(msg.shape)
        layout = read_layout(msg, shape, msg.quantized)
        y = dequantize(unpack_quantized(msg.quantized, numel, "quantized", decoded_bound(msg)))
        return from_groups(y, layout, shape)


CODECS = (DirectQCodec,)
