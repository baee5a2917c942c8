"""Subspace coding of activations: a message's rows (tokens) in the top-r eigenbasis of its own Gram matrix, the
coefficients on one common step that zstd entropy-codes; the encoder of `lowrank`'s `+sN` mode.

Why: the residual stream is far from white across its channels. On stage-0 outputs captured from a single pass of
the default model (hidden 128), 10 of 128 principal directions hold 90% of the energy and 22 hold 99%: the
eigenvalues' arithmetic over geometric mean is 111, a transform-coding gain of 3.4 bits an element that channel
scales (`acsgd+ch`, one scale per channel, each channel coded alone) cannot reach. Coded in that basis with one
step for every coefficient, the loud directions get many levels and the quiet ones mostly zero codes, which zstd
shrinks to almost nothing (the MSE-optimal allocation of an entropy-coded uniform quantizer): rank 24 at a step of
0.3 x the message's rms gave a relative error of 0.057 at 1.19 bits an element, against 0.18 at 2.9 bits for
3-bit channel-scaled first sights (`acsgd2+ch+fs3`; docs/reports/single-pass.md has the table).

What travels is `lowrank`'s message, unchanged: P (rows x r) and Q (cols x r) as int8 codes with one fp32 scale a
column, decoded as sum_k P[:, k] Q[:, k]^T. Here Q is the basis (orthonormal eigenvectors of M^T M, each column on
its own int8 step, coarser the quieter its direction: `basis_steps`) and P the least-squares coefficients of M on
the basis the receiver decodes, each column on the step max(common step, its peak / 127). So a receiver needs
nothing new and checks what it checks for any `lowrank` message; only the encoder differs.

The basis is the message's own (eigh of a cols x cols matrix: 128 x 128 at hidden 128), so it leaks across the
message's tokens the way channel scales do: a token's decoded value depends on the others only through Q, r x cols
numbers fitted to all of them.
"""

from __future__ import annotations

import torch

from swarm.compression.factors import INT8_MAX, int8_steps, outer_sum, pack_factor, unpack_factor
from swarm.compression.wire import WireError
from swarm.proto import wire_pb2

__all__ = [
    "BASIS_SHARE", "GRAM_ITERATIONS", "MAX_SUBSPACE_STEP_PERCENT", "basis_steps", "coefficient_steps",
    "decode_subspace", "encode_subspace", "energy_rank", "least_squares_coefficients", "subspace_basis",
]  # fmt: skip

MAX_SUBSPACE_STEP_PERCENT = 1000
"""Largest common step of subspace coding (`+sN`), in percent of the message's rms."""


EXACT_MAX_COLS = 512
"""Widest message whose basis is an exact eigendecomposition of its Gram matrix; wider ones take a randomized
subspace iteration (`_top_eigenvectors`): a dense eigh of a 768-wide Gram matrix took 0.4-1.1 s a message here."""
POWER_ITERATIONS = 4
"""Subspace iterations of the randomized basis (each multiplies by M^T M once, then re-orthonormalizes)."""
OVERSAMPLING = 8
"""Extra directions the randomized basis iterates beyond the rank, for the r-th direction's accuracy."""


GRAM_ITERATIONS = 4
"""Subspace iterations of a basis taken from the Gram matrix (`iterations` of `subspace_basis`; acsgd's `+dslR`
deltas). On spectra falling 10x, 100x and 1000x over 128 directions, 4 left at most 0.06 points more of the energy
outside a rank-16 basis than the exact eigendecomposition (0.01 on the steeper two), at a third of its time here
(0.4-0.6 against 1.2-1.8 ms at 128 columns); 3 left up to 0.15 points on the flattest."""


def subspace_basis(
    mat: torch.Tensor, r: int, *, most: int = 0, leave_out: float = 0.0, iterations: int = 0
) -> torch.Tensor:
    """The top-`r` eigenvectors of mat^T mat (cols x r, orthonormal columns, the loudest first), each column's sign
    fixed so that its largest-magnitude entry is positive (the same basis whatever sign eigh returns). Exact up to
    `EXACT_MAX_COLS` columns, randomized above (the sender's choice only: the basis travels in the message).

    With `leave_out` > 0, `r` is the least rank: the basis grows, up to `most`, until the eigenvalues beyond it
    sum to at most `leave_out` of mat's energy (its squared Frobenius norm, the Gram matrix's trace).

    With `iterations` > 0 (and no growth), up to `EXACT_MAX_COLS` columns: that many subspace iterations on the
    Gram matrix instead of its full eigendecomposition (`_gram_eigenvectors`), nearly the same basis in a third
    of the time where r + `OVERSAMPLING` is well below the columns."""
    grows = leave_out > 0 and most > r
    width = min(most, mat.shape[1]) if grows else r
    if iterations > 0 and not grows and 2 * (r + OVERSAMPLING) <= mat.shape[1] <= EXACT_MAX_COLS:
        values, vectors = _gram_eigenvectors(mat, width, iterations)
    elif mat.shape[1] <= EXACT_MAX_COLS:
        values, vectors = torch.linalg.eigh((mat.t() @ mat).double())  # ascending; double: the Gram squares M's range
        values, vectors = values.flip(0)[:width], vectors.flip(1)[:, :width]
    else:
        values, vectors = _top_eigenvectors(mat.double(), width)
    if grows:
        r = energy_rank(values, float(mat.double().pow(2).sum()), r, leave_out)
    basis = vectors[:, :r].float()
    peak = basis.gather(0, basis.abs().argmax(dim=0, keepdim=True))
    return basis * torch.where(peak < 0, -1.0, 1.0)


def energy_rank(values: torch.Tensor, energy: float, least: int, leave_out: float) -> int:
    """The smallest rank, at least `least` and at most len(`values`), whose eigenvalues (descending) leave at most
    `leave_out` x `energy` outside them."""
    outside = energy - torch.cumsum(values.clamp(min=0), 0)  # outside[k]: what ranks 1..k+1 leave out
    enough = (outside <= leave_out * energy).nonzero()
    needed = int(enough[0]) + 1 if len(enough) else len(values)
    return min(len(values), max(least, needed))


def _top_eigenvectors(m: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-`r` eigenvalues (descending) and eigenvectors of m^T m by a seeded randomized subspace iteration
    (Halko, Martinsson and Tropp 2011, algorithm 4.4) and a Rayleigh-Ritz step, never forming the cols x cols Gram
    matrix: O(rows x cols x r) a pass instead of O(cols^3)."""
    k = min(m.shape[1], r + OVERSAMPLING)
    gen = torch.Generator().manual_seed(0)
    q = torch.linalg.qr(m.t() @ (m @ torch.randn(m.shape[1], k, generator=gen, dtype=m.dtype))).Q
    for _ in range(POWER_ITERATIONS):
        q = torch.linalg.qr(m.t() @ (m @ q)).Q
    projected = m @ q
    return _ritz(q, projected.t() @ projected, r)


def _gram_eigenvectors(m: torch.Tensor, r: int, iterations: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-`r` eigenvalues (descending) and eigenvectors of G = m^T m by `iterations` subspace iterations on G
    (float32, cols x cols), started from G's `r + OVERSAMPLING` columns of the largest diagonal (they lie in its
    loud directions; no random draw), then a Rayleigh-Ritz step in float64. Deterministic for a given `m`."""
    gram = m.t() @ m
    k = min(gram.shape[0], r + OVERSAMPLING)
    q = torch.linalg.qr(gram[:, gram.diagonal().topk(k).indices]).Q
    for _ in range(iterations):
        q = torch.linalg.qr(gram @ q).Q
    return _ritz(q.double(), (q.t() @ gram @ q).double(), r)


def _ritz(q: torch.Tensor, within: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The Rayleigh-Ritz step of both iterations: the top-`r` eigenvalues (descending) of `within`, the Gram matrix
    seen in the orthonormal columns `q` (k x k), and their eigenvectors mapped back through `q`."""
    values, vectors = torch.linalg.eigh(within)
    return values.flip(0)[:r], q @ vectors.flip(1)[:, :r]


def least_squares_coefficients(mat: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """P (rows x r) minimising ||mat - P basis^T||: the coefficients on the basis as the receiver decodes it (its
    int8 codes are nearly, not exactly, orthonormal)."""
    gram = basis.t() @ basis
    return torch.linalg.solve(gram.double(), (basis.t() @ mat.t()).double()).t().float()


def coefficient_steps(coefficients: torch.Tensor, step: float) -> torch.Tensor:
    """Each column's int8 step: the common `step`, or the column's peak / 127 where that is larger (a code never
    passes 127, so a loud column gets a coarser step rather than clipped codes)."""
    peak = coefficients.abs().amax(dim=0)
    return torch.maximum(torch.full_like(peak, step), peak / INT8_MAX)


BASIS_SHARE = 0.5
"""How coarse each basis column's int8 step is, in units of the step at which a basis entry's quantization error
costs as much as a coefficient's (`basis_steps`): 0.5 gives each entry a quarter of a coefficient's. On the default's
captured messages (s69) that took 17% off first sights (rank 32-64) and 7% off deltas (rank 16) at a relative
squared error 1% higher; with a 0.85x coefficient step as well, 13% and 3% off at a lower error than before."""
BASIS_MIN_GRAM_EIGENVALUE = 0.5
"""A decoded basis whose Gram matrix has an eigenvalue below this is sent on the columns' finest steps instead."""


def basis_steps(mat: torch.Tensor, basis: torch.Tensor, step: float) -> torch.Tensor:
    """Each basis column's int8 step, from what its error costs: an error e in column k moves every row's decoded
    value by its coefficient on k times e, outside the basis, so over the message it costs Lambda_k (the rows'
    energy along k) x |e|^2 x (cols - r) / cols, against step^2 / 12 a coefficient. Equal costs at equal rates
    (the high-rate optimal allocation of an entropy-coded uniform quantizer) give t_k = step / sqrt(Lambda_k x
    (cols - r) / cols): loud directions get fine columns, quiet ones coarse ones, which zstd then shrinks.
    `BASIS_SHARE` scales that; every step lies between peak / 127 (no clipped code) and peak / `COARSEST_CODE`, where
    columns of quiet directions stay far from each other and the decoded basis well conditioned for the
    least-squares coefficients."""
    cols, r = basis.shape
    energy = (mat @ basis).double().pow(2).sum(0) * max(cols - r, 1) / cols
    return int8_steps(BASIS_SHARE * step / energy.clamp_min(1e-300).sqrt(), basis)


def _pack_basis(mat: torch.Tensor, basis: torch.Tensor, step: float, q_out: wire_pb2.Quantized) -> torch.Tensor:
    """The basis into `q_out` on `basis_steps`; on the finest steps where those decode to a basis too far from
    orthonormal for the coefficients' least squares. Returns the basis as the receiver decodes it."""
    if step > 0:
        sent = pack_factor(basis, 8, q_out, basis_steps(mat, basis, step))
        if float(torch.linalg.eigvalsh((sent.t() @ sent).double()).min()) >= BASIS_MIN_GRAM_EIGENVALUE:
            return sent
    return pack_factor(basis, 8, q_out)


def encode_subspace(
    mat: torch.Tensor, r: int, step_percent: int, p_out: wire_pb2.Quantized, q_out: wire_pb2.Quantized,
    *, most: int = 0, leave_out: float = 0.0, iterations: int = 0,
) -> torch.Tensor:  # fmt: skip
    """Codes `mat` (rows x cols, float) in its top-`r` eigenbasis (with `leave_out`, a basis that grows from `r` up
    to `most` until it leaves out at most that share of mat's energy; with `iterations`, a basis by subspace iteration:
    `subspace_basis`): Q (the basis, int8
    columns) into `q_out`, P (the least-squares coefficients on the decoded Q, each column on a step of at least
    `step_percent`% of mat's rms) into `p_out`, each basis column on a step its direction's energy sets
    (`basis_steps`). Returns what the receiver decodes (fp32, rows x cols, on the host), bit for bit."""
    mat = mat.detach().float().cpu()
    step = float(mat.pow(2).mean().sqrt()) * step_percent / 100
    basis = subspace_basis(mat, r, most=most, leave_out=leave_out, iterations=iterations)
    q_sent = _pack_basis(mat, basis, step, q_out)
    coefficients = least_squares_coefficients(mat, q_sent)
    p_sent = pack_factor(coefficients, 8, p_out, coefficient_steps(coefficients, step))
    return outer_sum(p_sent, q_sent)


def decode_subspace(
    p_msg: wire_pb2.Quantized, q_msg: wire_pb2.Quantized, rows: int, cols: int, max_rank: int, fields: tuple[str, str]
) -> torch.Tensor:
    """The rows x cols matrix a subspace-coded pair of factors decodes to (fp32), every field checked first: int8
    codes, P's columns of `rows`, Q's of `cols`, the same rank 1..min(`max_rank`, rows, cols) in both."""
    p_field, q_field = fields
    if rows < 1 or cols < 1:
        raise WireError(p_field, f"a {rows} x {cols} matrix has nothing to code")
    if p_msg.group_size != rows or not p_msg.numel or p_msg.numel % rows:
        raise WireError(f"{p_field}.group_size", f"{p_msg.group_size} with numel {p_msg.numel}: expected columns "
                        f"of the {rows} rows")  # fmt: skip
    r = p_msg.numel // rows
    if not 1 <= r <= min(max_rank, rows, cols):
        raise WireError(f"{p_field}.numel", f"rank {r} is outside 1..min({max_rank}, {rows}, {cols})")
    p = unpack_factor(p_msg, rows, r, 8, p_field)
    q = unpack_factor(q_msg, cols, r, 8, q_field)
    return outer_sum(p, q)
