"""AQ-SGD: per sample, the quantized change of its activation against a message buffer both ends hold."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from swarm.compression.codec_base import Codec, check_wire_finite
from swarm.compression.quantized import group_size, pack_quantized, quantized_nbytes, unpack_quantized
from swarm.compression.wire import WireError, bytes_to_tensor, tensor_to_bytes, wire_dtype
from swarm.kernels import apply_delta, aqsgd_update, dequantize, quantize
from swarm.proto import wire_pb2

if TYPE_CHECKING:
    from swarm.compression.state import LinkState


class BufferMissError(LookupError):
    """The receiver holds no message buffer for these sample ids (e.g. it restarted): resend them in full."""

    def __init__(self, sample_ids: list[int]):
        super().__init__(f"no AQ-SGD buffer for sample ids {sample_ids[:8]}{'...' if len(sample_ids) > 8 else ''}")
        self.sample_ids = sample_ids


class AQSGDCodec(Codec):
    """AQ-SGD: per sample, the quantized change since the sample was last seen, against a message buffer `m`
    held identically by sender and receiver; a sample's first sight travels in full and initialises `m`.
    The receiver computes on `m`, not on the true activation."""

    name, wire, quantized, uses_buffers = "aqsgd", wire_pb2.AQSGD, True, True

    def payload_nbytes(self, numel: int) -> int:  # steady state: every sample is a delta
        return quantized_nbytes(numel, self.config.bits, group_size(self.config))

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
                x[delta_rows], m, cfg.bits, group_size(cfg), stochastic=cfg.stochastic, seed=state.next_seed()
            )
            store.scatter([slots[i] for i in delta_rows], m)
            pack_quantized(q, msg.quantized)
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
        q = quantize(x, cfg.first_sight_bits, group_size(cfg), stochastic=cfg.stochastic, seed=state.next_seed())
        pack_quantized(q, msg.quantized_full)
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
            q = unpack_quantized(msg.quantized, len(delta_rows) * per_sample, "quantized")
            m = store.gather([slots[i] for i in delta_rows])
            apply_delta(m, q)
            store.scatter([slots[i] for i in delta_rows], m)
            out[delta_rows] = m
        if full_rows:
            n_full = len(full_rows) * per_sample
            if msg.HasField("quantized_full"):
                first = dequantize(unpack_quantized(msg.quantized_full, n_full, "quantized_full"))
            else:
                if msg.raw_dtype != wire_dtype(store.dtype):
                    raise WireError("raw_dtype", f"expected the buffer dtype {store.dtype}")
                first = bytes_to_tensor(msg.raw, store.dtype, n_full, "raw")
                check_wire_finite(first, "raw")
            first = first.view(len(full_rows), *shape[1:]).to(store.dtype)
            store.admit([ids[i] for i in full_rows], first)
            out[full_rows] = first
        return out


CODECS = (AQSGDCodec,)
