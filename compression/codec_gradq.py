"""GradQ: quantized activation gradients, optionally with error feedback on the sender."""

from __future__ import annotations

from swarm.compression.codec_directq import DirectQCodec
from swarm.compression.quantized import pack_quantized
from swarm.kernels import dequantize
from swarm.proto import wire_pb2


class GradQCodec(DirectQCodec):
    """Quantized activation gradients; with error feedback, each micro-batch's quantization error is added to
    the next micro-batch's gradient within the same step (Optimus-CC's lazy error propagation)."""

    name, wire, error_feedback = "gradq", wire_pb2.GRADQ, True

    def _encode_body(self, x, msg, state):
        use_feedback = self.config.error_feedback and state is not None
        if use_feedback and state.residual is not None and state.residual.shape == x.shape:
            x = x.float() + state.residual
        q = self._quantize(x, state)
        if use_feedback:
            state.residual = x.float() - dequantize(q).view(x.shape)
        pack_quantized(q, msg.quantized)


CODECS = (GradQCodec,)
