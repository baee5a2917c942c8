"""MLOWRANK: the replicas' gradient sum of a stage, each parameter on its own: a weight matrix as PowerSGD's rank-r
factors (Vogels et al. 2019: one power iteration a message, warm-started from the encoder's previous Q), anything
else (a norm's vector, a matrix too small for factors to pay) whole, with error feedback over the whole sum.

Why: with replicas, the stage sum was most of what a run sent (issue 29 item 5): 2 bits an element every step
(`gradq2+ef+rot+nr+cs+g1024`, quantized in AdamW's units), 52% of the churn experiment's bytes. One low-rank basis
shared by every matrix of the stage (`lowrank8+ef+f8+g128`, the flat gradient in rows of the hidden size) cost
+3.27% held-out (docs/reports/replicas.md, s52): the attention, MLP and embedding matrices have unrelated
subspaces. Factored one matrix at a time, as PowerSGD factors a network, rank 8 in int8 ended below the 2-bit
sum's loss in two seeds at about half its bytes (docs/reports/replicas.md, s55), but 1.40% above fp32 in a fourth
(s56); rank 12 was within 1% in all five seeds, in int8 at 0.74 of the 2-bit sum's bytes (s56) and in 4-bit codes
(`+f4`, s57) at 0.33 of them. Over 8 epochs such a sum was best coded as it is (rank 8 in int8 in AdamW's units:
+1.03% against +0.41%, one run), but in a single pass every sum coded as it is missed 1% (rank 12 in 4 bits: +3.00%)
and in AdamW's units rank 16 in 4 bits holds both regimes better (s58: `swarm.runtime.average.SUM_CODEC`,
`GradientAverager.precondition_ranked`): the averager scales the flat gradient before this codec sees it.

The layout: `CodecConfig.layout`, the shapes of the parameters the flat gradient concatenates, in order (the
averager sets it from the stage's trained parameters; every replica of a stage has the same). A parameter of 2+
dimensions is a (shape[0], rest) matrix, factored at rank min(r, rows, cols) where the factors are fewer codes than
the matrix (r (rows + cols) < rows cols); every other parameter travels whole, as one column of codes with one fp32
step (`compression.factors`). So the codec pays at a width: at hidden 128 and rank 8 in int8 a transformer layer's
message is 17.1 KB, 0.69 bits an element (1.39 at hidden 64, 0.34 at 256; rank 12 in 4 bits: 0.53 at hidden 128);
at hidden 32 it is 2.9, more than the 2-bit sum's (`swarm.runtime.average.QUANTIZED_SUM_CODEC`, which a plan may name).

The encoder: M = the flat gradient plus the residual; per factored matrix P = M_i Q_warm orthonormalised
(`torch.linalg.qr`), Q = M_i^T P, both packed; per whole parameter its values packed; the residual is M minus what
the receiver decodes. Q (fp32, unquantized) is the matrix's warm start for the next message: encoder-local
(`LinkState.warm`, a tuple with one entry per parameter, None for whole ones), so a dropped step or a new replica
desynchronises nothing (a missing or misshapen warm start is a seeded Gaussian).

The decoder reads the factors against the layout of its own config: one `factors` entry per whole parameter, two
per factored one, each of exactly its column length and rank; every product summed term by term (`outer_sum`, no
matmul), so every replica decodes the same bits. A message with another count, sizes, rank or bits, a code out of
range, a bad scale or a product past the declared dtype is refused naming `factors`, as is one that sets
`quantized`, `quantized_full` or `sparse`. A config without a layout (a benchmark, the planner's estimate) views
the tensor as one matrix in rows of `DEFAULT_ROW`.
"""

from __future__ import annotations

import math

import torch

from swarm.compression.codec_base import Codec, check_wire_finite, decoded_bound
from swarm.compression.factors import (
    FACTOR_BITS,
    check_ranked,
    outer_sum,
    pack_factor,
    pair_nbytes,
    ranked_label,
    unpack_factor,
    warm_start,
)  # fmt: skip
from swarm.compression.wire import WireError
from swarm.kernels import packed_nbytes
from swarm.proto import wire_pb2

DEFAULT_ROW = 128
"""Row length of the one matrix a config without a layout views its tensor as (`+gN` sets another): what the
planner's estimate of a stage it does not list and the codec benchmarks code."""


def layout_of(params) -> tuple[tuple[int, ...], ...]:
    """The layout of `params` (tensors, or anything with a `shape`): their shapes, in order."""
    return tuple(tuple(int(d) for d in p.shape) for p in params)


def matrix_view(shape: tuple[int, ...]) -> tuple[int, int] | None:
    """(rows, cols) of a parameter of 2+ dimensions (its first dimension by the rest); None for a vector or scalar."""
    return (shape[0], math.prod(shape[1:])) if len(shape) >= 2 else None


def factor_plan(layout: tuple[tuple[int, ...], ...], rank: int) -> list[tuple[int, int, int]]:
    """Per parameter (rows, cols, r): r > 0 for a matrix sent as rank-r factors, (numel, 1, 0) for one sent whole."""
    plan = []
    for shape in layout:
        view = matrix_view(shape)
        if view is not None and min(view) > 0:
            rows, cols = view
            r = min(rank, rows, cols)
            if r * (rows + cols) < rows * cols:  # the factors are fewer codes than the matrix whole
                plan.append((rows, cols, r))
                continue
        plan.append((math.prod(shape), 1, 0))
    return plan


class MatrixLowRankCodec(Codec):
    """Per-parameter rank-r PowerSGD factors with encoder-local warm starts and error feedback (`+ef`); rank in the
    label (`mlowrank8`), 8-bit codes with `+f8`, 4-bit with `+f4` (module doc)."""

    name, wire, error_feedback, ranked, per_parameter = "mlowrank", wire_pb2.MLOWRANK, True, True, True

    @classmethod
    def wire_bits(cls, config) -> int:
        return 1  # the planner's integer figure; `payload_nbytes` has the real one (well under 1 at useful ranks)

    @classmethod
    def nominal_bits(cls, config) -> float:
        return config.factor_bits

    @classmethod
    def check(cls, config) -> None:
        check_ranked(config)
        if config.subspace_step_percent:
            raise ValueError("mlowrank sends PowerSGD's factors: subspace coding (+sN) is lowrank's")

    @classmethod
    def label(cls, config) -> str:
        return ranked_label(cls.name, config)

    def _layout(self, numel: int) -> tuple[tuple[int, ...], ...]:
        """The config's layout; without one (a benchmark, the planner's estimate), `numel` as one matrix in rows of
        the group size or `DEFAULT_ROW`, any remainder whole."""
        if self.config.layout:
            return self.config.layout
        cols = self.config.group_size or DEFAULT_ROW
        rows, rest = divmod(numel, cols)
        return ((rows, cols),) * bool(rows) + ((rest,),) * bool(rest)

    def _plan(self, numel: int) -> list[tuple[int, int, int]]:
        plan = factor_plan(self._layout(numel), self.config.rank)
        held = sum(rows * cols for rows, cols, _ in plan)
        if held != numel:
            raise WireError("shape", f"{numel} elements, but the parameters' layout holds {held}")
        return plan

    def payload_nbytes(self, numel: int) -> int:
        """Codes and scales of a message of `numel` elements, by the layout (`_layout`)."""
        bits = self.config.factor_bits
        plan = factor_plan(self._layout(numel), self.config.rank)
        return sum(pair_nbytes(rows, cols, r, bits) if r else packed_nbytes(rows, bits) + 4 for rows, cols, r in plan)

    def _encode_body(self, x, msg, state):
        use_feedback = self.config.error_feedback and state is not None
        m = x.float().reshape(-1)
        if use_feedback and state.residual is not None and state.residual.shape == x.shape:
            m = m + state.residual.reshape(-1)
        plan = self._plan(m.numel())
        bits, offset = self.config.factor_bits, 0
        sent = torch.empty_like(m)
        warm_out: list[torch.Tensor | None] = []
        warm_in = getattr(state, "warm", None)
        for i, (rows, cols, r) in enumerate(plan):
            part = m[offset : offset + rows * cols]
            if r:
                mat = part.view(rows, cols)
                last = warm_in[i] if isinstance(warm_in, tuple) and i < len(warm_in) else None
                start = warm_start(last, cols, r, self.config.seed * 1009 + i)
                p = torch.linalg.qr(mat @ start).Q  # one power iteration from the warm start
                q = mat.t() @ p
                warm_out.append(q)
                decoded = outer_sum(pack_factor(p, bits, msg.factors.add()), pack_factor(q, bits, msg.factors.add()))
            else:
                warm_out.append(None)
                decoded = pack_factor(part.view(-1, 1), bits, msg.factors.add())
            sent[offset : offset + rows * cols] = decoded.reshape(-1)
            offset += rows * cols
        if state is not None:
            state.warm = tuple(warm_out)
        if use_feedback:
            state.residual = (m - sent).view(x.shape)

    def _decode_body(self, msg, numel, state):
        if msg.HasField("quantized") or msg.HasField("quantized_full") or msg.HasField("sparse"):
            raise WireError("quantized", "an mlowrank message carries its codes in `factors` only")
        plan = self._plan(numel)
        wanted = sum(2 if r else 1 for _, _, r in plan)
        if len(msg.factors) != wanted:
            raise WireError("factors", f"{len(msg.factors)} entries; this layout needs {wanted}")
        bits = msg.factors[0].bits if msg.factors else self.config.factor_bits
        if bits not in FACTOR_BITS:
            raise WireError("factors.bits", f"{bits}, not one of {FACTOR_BITS}")
        out, k = torch.empty(numel), 0
        offset = 0
        for i, (rows, cols, r) in enumerate(plan):
            if r:
                got = msg.factors[k].numel // max(1, msg.factors[k].group_size)
                if got != r:
                    raise WireError("factors", f"parameter {i} came at rank {got}, not {r}")
                p = unpack_factor(msg.factors[k], rows, r, bits, f"factors[{k}]")
                q = unpack_factor(msg.factors[k + 1], cols, r, bits, f"factors[{k + 1}]")
                part, k = outer_sum(p, q), k + 2
            else:
                part, k = unpack_factor(msg.factors[k], rows, 1, bits, f"factors[{k}]"), k + 1
            out[offset : offset + rows * cols] = part.reshape(-1)
            offset += rows * cols
        check_wire_finite(out, "factors.scales")
        if bool((out.abs() > decoded_bound(msg)).any()):
            raise WireError("factors.scales", "the product exceeds what the declared dtype holds")
        return out


CODECS = (MatrixLowRankCodec,)
