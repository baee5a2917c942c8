"""LOWRANK: a rank-r approximation P Q^T of a gradient viewed as a (rows, cols) matrix, PowerSGD-style (Vogels et
al. 2019): one power iteration a message, warm-started from the encoder's previous Q, with error feedback.

Why: the tied embedding's gradient (vocab x hidden) is the largest share of issue 13's best setting that no
codec touched: gradq4 moved ~20 KB a step for its 32,768 elements, and fewer bits an element trained worse
(3 bits +0.5-1.9% held-out, 2 bits +2.66%). A rank-4 message of a 256 x 128 matrix is (256 + 128) x 4 factor
elements: 3 KB in fp16 (0.75 bits an element), 1.5 KB in 8 bits; the error feedback (the residual is M minus
what was decoded) carries what the rank leaves out into the next step's message. Measured in `swarm experiment
convergence` (8 epochs; `BEST_TARGET_SETTING` has the rows): the tied sum moved 5.2 KB a step at rank 4 in fp16,
2.4 KB in 8 bits, no worse held-out (8-bit +1.99% / +2.01%, fp16 +2.07% / +2.27% with a gtern r100 backward, seeds
0 / 1); rank 2 cost +3.85%, rank 8 in 8 bits 4.4 KB. The factors' codes are one a byte or two: zstd shrinks
them little.

The encoder: M = the flat tensor (plus the residual) viewed row-major as (rows, cols); Q (cols x r) is its own
warm start (`LinkState.warm`: encoder-local, the receiver needs nothing but the message, so a dropped step or a
new peer desynchronises nothing; a seeded Gaussian when there is none of the right shape); P = M Q, orthonormalised
(`torch.linalg.qr`); Q = M^T P; it sends P and Q, each column scaled by its max |v| (fp32 scale) as fp16 codes in
[-1, 1] (`bits` 16) or int8 codes in -127..127 (`+f8`). With error feedback and int8 codes each column's step is
what its error costs instead (`powersgd_steps`): the rounding adds `ROUNDING_SHARE` of what the rank leaves out,
and the residual carries it into the next message. cols: the config's `group_size` when it divides the size
(the averager sets the tied weight's row length), else the size's largest divisor at most its square root.

The decoder reads rows, cols and r from the message alone and returns sum_k P[:, k] Q[:, k]^T, each term an
elementwise multiply and add in fp32 in k order (no matmul: BLAS kernels may sum in another order on another
CPU), so every member of a sum decodes the same bits from the same message.

On the wire: `quantized` is P^T (r groups of rows), `quantized_full` Q^T (r groups of cols), each with `bits` 16
or 8 (the same in both), `group_size` its column length, `numel` r x that, `scale_dtype` FLOAT32, r `scales`,
no `mins`; rows x cols must be the declared size, 1 <= r <= min(rows, cols, MAX_RANK); a code in a column whose
scale is 0, an fp16 code outside [-1, 1] or not finite, an int8 code of -128, a negative or non-finite scale,
or a product past what the declared dtype holds is refused. An empty tensor sends neither factor.
"""

from __future__ import annotations

import math

import torch

from swarm.compression.codec_base import Codec, check_wire_finite, decoded_bound
from swarm.compression.factors import (
    FACTOR_BITS,
    MAX_RANK,
    check_ranked,
    int8_steps,
    outer_sum,
    pack_factor,
    pair_nbytes,
    ranked_label,
    unpack_factor,
    warm_start,
)  # fmt: skip
from swarm.compression.subspace import MAX_SUBSPACE_STEP_PERCENT, encode_subspace
from swarm.compression.wire import WireError
from swarm.proto import wire_pb2


def matrix_shape(numel: int, cols: int | None) -> tuple[int, int]:
    """(rows, cols) of the row-major view: `cols` when it divides `numel`, else `numel`'s largest divisor at most
    its square root (an empty tensor: (0, 1))."""
    if numel == 0:
        return 0, 1
    if not cols or numel % cols:
        cols = next(d for d in range(math.isqrt(numel), 0, -1) if numel % d == 0)
    return numel // cols, cols


ROUNDING_SHARE = 0.03
"""With error feedback and int8 factors, how much the factors' rounding may add to what the rank leaves out of the
message (`powersgd_steps`). On 24 tied-sum messages captured from the default's 2-epoch run (256 x 128 at rank 16):
3,625 -> 2,622 bytes a message, the decoded message's squared error 1.80% -> 1.83% of its energy; 0.01 gave 2,887
bytes, 0.1 2,405 bytes at 1.89%. The error feedback carries the rounding into the next step's message."""


def powersgd_steps(mat: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 steps of PowerSGD's factors under error feedback: P (rows x r, orthonormal) and Q = M^T P. An error
    of e in an entry of P's column k moves the product by |q_k| e over a row, one in Q by e, so equal costs an entry
    (the high-rate optimal allocation of an entropy-coded uniform quantizer) put Q on one step T and P's column k on
    T / |q_k|; T makes the rounding's expected squared error, r (rows + cols) T^2 / 12, `ROUNDING_SHARE` of the
    residual |M - P Q^T|^2. Every step between the column's peak / 127 and peak / `COARSEST_CODE`."""
    rows, cols = mat.shape
    r = p.shape[1]
    residual = float((mat - p @ q.t()).double().pow(2).sum())
    common = (12 * ROUNDING_SHARE * residual / (r * (rows + cols))) ** 0.5
    norms = q.norm(dim=0).clamp_min(torch.finfo(torch.float32).tiny)
    return int8_steps(common / norms, p), int8_steps(torch.full((r,), common), q)


class LowRankCodec(Codec):
    """Rank-r PowerSGD factors with a warm-started Q and error feedback (`+ef`); rank in the label (`lowrank4`),
    8-bit factors with `+f8` (module doc)."""

    name, wire, error_feedback, ranked = "lowrank", wire_pb2.LOWRANK, True, True

    @classmethod
    def wire_bits(cls, config) -> int:
        return 1  # the planner's integer figure: (rows + cols) r bits / (rows cols) is under 1 at any useful rank

    @classmethod
    def nominal_bits(cls, config) -> float:
        return config.factor_bits  # the factors' codes

    @classmethod
    def check(cls, config) -> None:
        check_ranked(config)
        if not 0 <= config.subspace_step_percent <= MAX_SUBSPACE_STEP_PERCENT:
            raise ValueError(f"subspace_step_percent (+sN) is 0..{MAX_SUBSPACE_STEP_PERCENT}, got "
                             f"{config.subspace_step_percent}")  # fmt: skip
        if config.subspace_step_percent and config.factor_bits != 8:
            raise ValueError("subspace coding (+sN) sends int8 factors: add +f8")

    @classmethod
    def label(cls, config) -> str:
        """`lowrank4`, `lowrank4+ef+f8`: the rank where a quantized codec writes its bits."""
        return ranked_label(cls.name, config) + (
            f"+s{config.subspace_step_percent}" if config.subspace_step_percent else ""
        )

    def _shape(self, numel: int, cols: int | None = None) -> tuple[int, int, int]:
        rows, cols = matrix_shape(numel, cols or self.config.group_size)
        return rows, cols, min(self.config.rank, rows, cols)

    def _cols(self, x: torch.Tensor) -> int | None:
        """The matrix's row length: the config's group size; in subspace mode the tensor's last dimension whatever
        the group size (an activation's or its gradient's hidden size: a row is a token; a group size is a local
        option a peer sets for its quantizing codecs, and rows of it would split tokens)."""
        if not self.config.subspace_step_percent or x.dim() < 2:
            return self.config.group_size
        return x.shape[-1]

    def payload_nbytes(self, numel: int) -> int:
        rows, cols, r = self._shape(numel)
        return pair_nbytes(rows, cols, r, self.config.factor_bits)

    def _encode_body(self, x, msg, state):
        use_feedback = self.config.error_feedback and state is not None
        m = x.float().reshape(-1)
        if use_feedback and state.residual is not None and state.residual.shape == x.shape:
            m = m + state.residual.reshape(-1)
        rows, cols, r = self._shape(m.numel(), self._cols(x))
        if r == 0:
            if use_feedback:
                state.residual = torch.zeros(x.shape)
            return
        mat = m.view(rows, cols)
        if self.config.subspace_step_percent:
            sent = self._encode_subspace(mat, r, msg)
        else:
            start = warm_start(getattr(state, "warm", None), cols, r, self.config.seed)
            p = torch.linalg.qr(mat @ start).Q  # one power iteration from the warm start
            q = mat.t() @ p
            if state is not None:
                state.warm = q
            bits = self.config.factor_bits
            p_steps, q_steps = powersgd_steps(mat, p, q) if use_feedback and bits == 8 else (None, None)
            sent = outer_sum(
                pack_factor(p, bits, msg.quantized, p_steps), pack_factor(q, bits, msg.quantized_full, q_steps)
            )  # fmt: skip
        if use_feedback:
            state.residual = (m - sent.reshape(-1)).view(x.shape)

    def _encode_subspace(self, mat: torch.Tensor, r: int, msg) -> torch.Tensor:
        """`+sN`: P (`quantized`) and Q (`quantized_full`) of subspace coding (`swarm.compression.subspace`);
        returns what the receiver decodes."""
        return encode_subspace(mat, r, self.config.subspace_step_percent, msg.quantized, msg.quantized_full)

    def _decode_body(self, msg, numel, state):
        has_p, has_q = msg.HasField("quantized"), msg.HasField("quantized_full")
        if numel == 0 or not (has_p or has_q):
            if numel or has_p or has_q:
                raise WireError("quantized", f"{numel} elements need both factors, an empty tensor neither")
            return torch.zeros(0)
        if not (has_p and has_q):
            raise WireError("quantized_full", "both factors (quantized: P, quantized_full: Q) must be set")
        rows, cols = msg.quantized.group_size, msg.quantized_full.group_size
        if rows < 1 or cols < 1 or rows * cols != numel:
            raise WireError("quantized.group_size", f"a {rows} x {cols} matrix is not the declared {numel} elements")
        r = msg.quantized.numel // rows
        if not 1 <= r <= min(MAX_RANK, rows, cols):
            raise WireError("quantized.numel", f"rank {r} is outside 1..min({MAX_RANK}, {rows}, {cols})")
        bits = msg.quantized.bits
        if bits not in FACTOR_BITS:
            raise WireError("quantized.bits", f"{bits}, not one of {FACTOR_BITS}")
        p = unpack_factor(msg.quantized, rows, r, bits, "quantized")
        q = unpack_factor(msg.quantized_full, cols, r, bits, "quantized_full")
        out = outer_sum(p, q).reshape(-1)
        check_wire_finite(out, "quantized.scales")
        if bool((out.abs() > decoded_bound(msg)).any()):
            raise WireError("quantized.scales", "the product exceeds what the declared dtype holds")
        return out


CODECS = (LowRankCodec,)
