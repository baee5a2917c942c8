"""Configuration of one codec on one link direction (frozen, validated on construction)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from swarm.compression.buffers import EVICTIONS
from swarm.compression.codecs import BY_NAME, CODEC_NAMES, codec_class
from swarm.compression.factors import MAX_RANK
from swarm.compression.quantized import SCALE_DTYPES, SUPPORTED_BITS, group_size
from swarm.compression.rotation import is_power_of_two
from swarm.compression.subspace import MAX_SUBSPACE_STEP_PERCENT

GROUP_LAYOUTS = ("flat", "channel")
ROTATIONS = ("none", "hadamard")
LABEL_SUFFIXES = {
    "ef": {"error_feedback": True},
    "sr": {"stochastic": True},
    "nr": {"stochastic": False},
    "ch": {"group_layout": "channel"},
    "rot": {"rotation": "hadamard"},
    "cs": {"scale_dtype": "auto"},
    "bs": {"scale_dtype": "bfloat16"},
    "fsd": {"first_sight_delta_code": True},
    "clip": {"first_sight_clip": True},
}
"""Label suffixes after a codec's name and bits (`aqsgd2+ch`, `gradq2+ef+rot`) and the fields each sets; `+gN`
(group size), `+rN` (rate), `+fN` (factor bits), `+fsN` (first-sight bits), `+fslN` (first-sight rank), `+dslN` (delta
rank) and `+sN` (subspace step) carry a number."""

LOCAL_FIELDS = (
    "group_size",
    "seed",
    "zstd_level",
    "buffer_dir",
    "buffer_path",
    "buffer_capacity",
    "buffer_budget_bytes",
    "buffer_eviction",
    "buffer_dtype",
)
"""`CodecConfig` fields that are a peer's own rather than its codec's: no label suffix sets them (`+gN` sets
`group_size` where a label has it)."""

MAX_WIDTH_DIVISOR = 1024
"""Largest N of `+fslwN` (a rank of width / N)."""

MAX_FIRST_SIGHT_ENERGY = 9999
"""Largest N of `+fsleN` (first sights' ranks grown until they leave out at most N / 10,000 of the energy)."""

DEFAULT_FORWARD_CODEC = "acsgd2+ch+nr+fsl32+fslw4+fsle10+dsl16+s20"
"""AQ-SGD's buffer protocol with a sample's first sight subspace-coded at rank 32 or a quarter of the message's width
where that is more (`+fsl32+fslw4`: 32 up to hidden 128, 64 from 256 on, at most 64), the rank grown further, up to
64, until it leaves out at most 0.1% of the rows' energy (`+fsle10`, s59), and its later visits' changes too
(`+dsl16`: rank 16), both on one step of 20% of the rows' rms, int8 codes that zstd shrinks
(`swarm.compression.subspace`); `+ch+nr` quantize nothing here but name the paper's 2-bit channel deltas a receiver
also decodes. With the default backward and the tied sum's default (`GradientAverager.tied_codec`, rank-16 int8
factors), in `swarm experiment convergence` (512 held-out windows; docs/reports/single-pass.md, s59), seeds 0 / 1:
one pass of 6,144 samples +0.47% / +0.35% held-out vs fp32 at 16.5x / 16.8x fewer total bytes; one of 24,576 samples
+1.42% / +1.54% at 13.2x / 13.3x, where s53's default (rank 32 throughout, the backward with error feedback) read
+3.77% / +4.50%; 8 epochs +0.63% / -0.31% at 22.0x fewer total bytes after epoch 1 (20.2x / 20.3x over the run);
with 2 replicas (8 epochs, seed 0) +0.45% at 34.2x. On gpt-mid (hidden 256, rank-64 first sights from the width
alone): one pass of 6,144 samples +1.18% (seed 0; s53's default +1.17%)."""
DEFAULT_BACKWARD_CODEC = "gradq2+rot+nr+cs+g256"
"""2-bit gradients, Hadamard rotation, round to nearest, 16-bit scales, groups of 256 (with groups of 1024 the same
forward sent 8% fewer bytes but missed 1% on one seed of the single pass, +1.35%). No error feedback (`+ef`, the
default until s59): a micro-batch's quantization error carried into the next micro-batch's message lands on other
samples' gradients, so the previous stage's weight gradient takes it through the wrong activations. It lowers each
message's error against the running sum, not the weights' error: over a 24,576-sample pass with fp32 activations
the same gradients ended +1.23% held-out with it and -0.11% without (`scripts/simulate_boundary_codecs.py`, seed 0)."""


@dataclass(frozen=True)
class CodecConfig:
    """What a link direction sends and how."""

    name: str = "fp32"
    """codec: a name in the codec registry (`swarm.compression.codecs.CODEC_NAMES`)"""
    bits: int = 4
    """bits per element of the quantized codecs (2, 3, 4 or 8)"""
    group_size: int | None = None
    """elements per quantization group (None: the kernels' measured default)"""
    stochastic: bool = True
    """stochastic (unbiased) rounding; False rounds to nearest"""
    seed: int = 0
    """seed of the stochastic rounding, so runs repeat"""
    error_feedback: bool = False
    """codecs with error feedback (gradq): carry each micro-batch's quantization error into the next micro-batch
    of the same step"""
    buffer_dtype: str = "float16"
    """aqsgd: dtype of the message buffers (float16 or bfloat16)"""
    buffer_capacity: int = 1 << 20
    """aqsgd: samples a link end's buffer store holds at most (see `buffer_eviction` for what happens past it)"""
    buffer_budget_bytes: int = 0
    """aqsgd: bytes of message buffers a link end may hold, in RAM or on disk (0: no budget, `buffer_capacity`
    samples); with samples of seq x hidden fp16 values it holds budget // (seq x hidden x 2) samples. Both ends of a
    link need the same budget to agree on what is buffered (a disagreement costs resends, never wrong values)"""
    buffer_eviction: str = "lru"
    """aqsgd: what a full buffer store does with a new sample: "lru" evicts the least recently seen sample (which
    is a first sight again when it comes back), "none" admits nothing more (new samples travel as first sights
    every time, and the buffered ones stay: the better choice when whole epochs repeat through a small budget)"""
    buffer_path: str | None = None
    """aqsgd: a file for the memory-mapped buffer store of one `LinkState` (data sets larger than memory); None
    keeps it in RAM"""
    buffer_dir: str | None = None
    """aqsgd: a directory for the memory-mapped buffer stores of a stage's link ends, one file per end (the
    runtime's `LinkEnd` names them: `fw-recv.buf`, `fw-send-<destination>.buf`); None keeps them in RAM"""
    first_sight_bits: int = 16
    """aqsgd, acsgd and the codecs built on them: how a sample's first sight (a sample its link has not buffered)
    travels: 16 = in the buffer dtype, 2, 3, 4 or 8 = quantized directly in the codec's groups (label suffix
    `+fsN`); both ends buffer what the receiver decodes"""
    first_sight_delta_code: bool = False
    """tern, bilevel: a sample's first sight travels in the codec's own delta code (ternary, or 1 bit on two levels
    a group), a delta against zero, in the codec's groups (label suffix `+fsd`): about 1.4 (tern) or 1.2 (bilevel)
    bits an element after zstd instead of `first_sight_bits`; both ends buffer what the receiver decodes"""
    first_sight_clip: bool = False
    """acsgd with `+fsN`: each group's scale of a quantized first sight is the one of least squared error among
    1.0, 0.95, ..., 0.5 x its max |x| (a few loud values clip, the rest get a finer step), rounded to nearest
    whatever `stochastic` says (label suffix `+clip`; `compression.clipping`). The sender's choice only: the wire
    and the receiver are those of `+fsN`"""
    first_sight_rank: int = 0
    """acsgd: 0, or a sample's first sight travels subspace-coded (`compression.subspace`, label suffix `+fslR`
    with its step as `+sN`): the first sights of a message, a row per token, in the top-R eigenbasis of their own
    Gram matrix, the coefficients on one step of N% of their rms, int8 codes zstd entropy-codes; later visits
    are the codec's deltas against what the receiver decoded. About 1.1-1.5 bits an element at hidden 128 with
    a third of 3-bit channel-scaled first sights' error (docs/reports/single-pass.md)"""
    first_sight_width_divisor: int = 0
    """acsgd: 0, or first sights subspace-coded as with `+fslR` at a rank that grows with the message's width: its
    last dimension divided by N, never below `+fslR`'s rank where both are given, at most 64 and the width (label
    suffix `+fslwN`; `+fsl32+fslw4` is rank 32 up to hidden 128, 64 from hidden 256 on)"""
    first_sight_energy: int = 0
    """acsgd with `+fslR` or `+fslwN`: 0, or the first sights' rank grows from that rank, up to 64 and the width,
    until the directions left out hold at most N ten-thousandths of the rows' energy (label suffix `+fsleN`;
    `+fsle10`: at most 0.1%). The sender's choice only: a receiver reads the rank from the message. Over a long
    single pass the boundary's activations spread over more directions as the model trains (rank 32 left out 0.1%
    of their energy at step 320 of seed 0's 24,576-sample pass, 5% at step 1,216; docs/reports/single-pass.md)"""
    delta_rank: int = 0
    """acsgd: 0, or a buffered sample's later visits travel subspace-coded too (label suffix `+dslR`, on the step of
    `+sN`): the change of the message's delta samples, a row per token, in the top-R eigenbasis of its own Gram
    matrix (as `+fslR` codes first sights), decoded as P Q^T and added to the message buffers on both ends"""
    zstd_level: int = 1
    """zstd level of the framing (0 turns zstd off); skipped per message when it does not shrink it"""
    group_layout: str = "flat"
    """quantized codecs: which elements share a (min, scale) group. "flat": `group_size` consecutive elements of
    the flattened tensor; "channel": one group per channel of a sample across its tokens (a [B, T, D] tensor
    gets B x D groups of T elements: the layout of the AQ-SGD paper's own compressor), `group_size` unused.
    Label suffix `+ch`."""
    rotation: str = "none"
    """quantized codecs: "hadamard" rotates each group by a seeded randomized Hadamard transform before quantizing
    (and back after decoding), spreading an outlier over its group. Label suffix `+rot`."""
    scale_dtype: str = "float32"
    """gradq: how the per-group (min, scale) pairs travel: "float32", "bfloat16" (`+bs`), or "auto" (`+cs`: float16
    when every pair of a message is a normal float16, else bfloat16), stated per message on the wire."""

    rate_percent: int = 0
    """tern: weight of the rate in the choice of each group's nonzero codes, in percent of the message's mean
    square delta per kept code (`+rN`); 0 keeps the MSE-optimal code, larger zeroes more codes (fewer bytes
    after zstd)."""

    rank: int = 4
    """lowrank: rank of the factors P (rows x rank) and Q (cols x rank); written in its label (`lowrank4`)."""
    factor_bits: int = 16
    """lowrank, mlowrank: how the factors travel, fp16 codes (16), int8 codes (8, label suffix `+f8`) or 4-bit codes
    (4, `+f4`), fp32 column scales."""

    subspace_step_percent: int = 0
    """lowrank (`+f8`): 0 sends PowerSGD's factors; N > 0 codes the message in the top-r eigenbasis of its own
    Gram matrix (Q, cols x r) with the coefficients (P) on one step of at least N% of its rms, which zstd
    entropy-codes (`swarm.compression.subspace`; label suffix `+sN`). For activations: a row is a token, cols the
    hidden size (the tensor's last dimension unless `+gN` says otherwise). The wire and the receiver are
    `lowrank`'s"""

    keep: int = 0
    """topk: elements kept per group of `group_size` (label suffix `+kN`; 0: the codec's default, 1/64 of a group);
    0 for every other codec."""

    layout: tuple[tuple[int, ...], ...] = ()
    """per-parameter codecs (mlowrank): the shapes of the parameters the flat tensor concatenates, in order (no
    label names it: the averager sets the stage's trained parameters', the same on every replica); () for every
    other codec."""

    def __post_init__(self) -> None:
        codec = codec_class(self.name)
        if codec.quantized and self.bits not in SUPPORTED_BITS:
            raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {self.bits}")
        if self.group_size is not None and not 1 <= self.group_size <= 65536:
            raise ValueError(f"group_size must be in 1..65536, got {self.group_size}")
        if self.buffer_dtype not in ("float16", "bfloat16"):
            raise ValueError(f"buffer_dtype must be float16 or bfloat16, got {self.buffer_dtype!r}")
        if self.first_sight_bits not in (16, *SUPPORTED_BITS):
            raise ValueError(f"first_sight_bits must be 16 or one of {SUPPORTED_BITS}")
        if self.first_sight_bits != 16 and not codec.uses_buffers:
            raise ValueError(f"first_sight_bits (+fsN) applies to {_having('uses_buffers')} only")
        if self.first_sight_delta_code and not codec.low_bit_first_sights:
            raise ValueError(f"first_sight_delta_code (+fsd) applies to {_having('low_bit_first_sights')} only")
        if self.first_sight_delta_code and self.first_sight_bits != 16:
            raise ValueError("give first sights a bit width (+fsN) or the deltas' code (+fsd), not both")
        if self.first_sight_delta_code and self.rotation != "none":
            raise ValueError("first sights in the deltas' code (+fsd) are never rotated: drop +rot")
        if self.first_sight_clip and not codec.clipped_first_sights:
            raise ValueError(f"first_sight_clip (+clip) applies to {_having('clipped_first_sights')} only")
        if self.first_sight_clip and self.first_sight_bits == 16:
            raise ValueError("first_sight_clip (+clip) clips quantized first sights: give them bits (+fsN)")
        if self.first_sight_rank or self.first_sight_width_divisor:
            if not codec.subspace_first_sights:
                raise ValueError(f"first_sight_rank (+fslR) applies to {_having('subspace_first_sights')} only")
            if self.first_sight_rank and not 1 <= self.first_sight_rank <= MAX_RANK:
                raise ValueError(f"first_sight_rank (+fslR) is 1..{MAX_RANK}, got {self.first_sight_rank}")
            if not 0 <= self.first_sight_width_divisor <= MAX_WIDTH_DIVISOR:
                raise ValueError(f"first_sight_width_divisor (+fslwN) is 1..{MAX_WIDTH_DIVISOR}, got "
                                 f"{self.first_sight_width_divisor}")  # fmt: skip
            if not 0 <= self.first_sight_energy <= MAX_FIRST_SIGHT_ENERGY:
                raise ValueError(f"first_sight_energy (+fsleN) is 1..{MAX_FIRST_SIGHT_ENERGY} ten-thousandths of the "
                                 f"energy, got {self.first_sight_energy}")  # fmt: skip
            if not self.subspace_step_percent:
                raise ValueError("subspace-coded first sights (+fslR) need their step (+sN, in percent of the rms)")
            if not 1 <= self.subspace_step_percent <= MAX_SUBSPACE_STEP_PERCENT:
                raise ValueError(f"subspace_step_percent (+sN) is 1..{MAX_SUBSPACE_STEP_PERCENT}, got "
                                 f"{self.subspace_step_percent}")  # fmt: skip
            if self.first_sight_bits != 16 or self.first_sight_delta_code or self.first_sight_clip:
                raise ValueError("first sights are subspace-coded (+fslR) or quantized (+fsN, +fsd, +clip), not both")
            if self.rotation != "none":
                raise ValueError("acsgd's +rot rotates first sights only, and subspace-coded ones (+fslR) are never "
                                 "rotated: drop +rot")  # fmt: skip
        elif self.first_sight_energy:
            raise ValueError("first_sight_energy (+fsleN) grows subspace-coded first sights: give their rank (+fslR "
                             "or +fslwN)")  # fmt: skip
        if self.delta_rank:
            if not codec.subspace_deltas:
                raise ValueError(f"delta_rank (+dslR) applies to {_having('subspace_deltas')} only")
            if not 1 <= self.delta_rank <= MAX_RANK:
                raise ValueError(f"delta_rank (+dslR) is 1..{MAX_RANK}, got {self.delta_rank}")
            if not self.subspace_step_percent:
                raise ValueError("subspace-coded deltas (+dslR) need their step (+sN, in percent of the rms)")
        if self.buffer_path is not None and self.buffer_dir is not None:
            raise ValueError("give buffer_path (one store) or buffer_dir (one file per link end), not both")
        if self.buffer_capacity < 0:
            raise ValueError("buffer_capacity must be >= 0")
        if self.buffer_budget_bytes < 0:
            raise ValueError(f"buffer_budget_bytes must be >= 0, got {self.buffer_budget_bytes}")
        if self.buffer_eviction not in EVICTIONS:
            raise ValueError(f"buffer_eviction must be one of {EVICTIONS}, got {self.buffer_eviction!r}")
        if not 0 <= self.zstd_level <= 22:
            raise ValueError(f"zstd_level must be in 0..22, got {self.zstd_level}")
        if self.group_layout not in GROUP_LAYOUTS:
            raise ValueError(f"group_layout must be one of {GROUP_LAYOUTS}, got {self.group_layout!r}")
        if self.rotation not in ROTATIONS:
            raise ValueError(f"rotation must be one of {ROTATIONS}, got {self.rotation!r}")
        if not 0 <= self.rate_percent <= 1000 or (self.rate_percent and not codec.rated):
            raise ValueError(
                f"rate_percent (+rN) is 0..1000 and applies to {_having('rated')} only, got {self.rate_percent}"
            )
        if self.rank != 4 and not codec.ranked:
            raise ValueError(f"rank applies to ranked codecs ({_having('ranked')}) only, got {self.rank}")
        subspace = self.first_sight_rank or self.first_sight_width_divisor or self.delta_rank
        if self.subspace_step_percent and not (codec.ranked or subspace):
            raise ValueError(f"subspace_step_percent (+sN) applies to ranked codecs ({_having('ranked')}) and "
                             "subspace-coded first sights and deltas (+fslR, +fslwN, +dslR) only")  # fmt: skip
        if self.factor_bits != 16 and not codec.ranked:
            raise ValueError(f"factor_bits (+fN) applies to ranked codecs ({_having('ranked')}) only")
        if self.keep < 0 or (self.keep and not codec.sparse):
            raise ValueError(
                f"keep (+kN) is >= 0 and for the sparse codecs ({_having('sparse')}) only, got {self.keep}"
            )
        if self.layout and not codec.per_parameter:
            raise ValueError(f"layout applies to {_having('per_parameter')} only, not {self.name}")
        if any(not isinstance(d, int) or d < 0 for shape in self.layout for d in shape):
            raise ValueError(f"layout holds shapes of non-negative ints, got {self.layout!r}")
        codec.check(self)  # the codec's own parameters (a rank's range, the factors' bits)
        if self.scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"scale_dtype must be one of {SCALE_DTYPES}, got {self.scale_dtype!r}")
        if self.scale_dtype != "float32" and not codec.compact_scales:
            having = _having("compact_scales")
            the = f"the {having} codec" if "," not in having else f"the {having} codecs"
            raise ValueError(f"compact scales (scale_dtype, +cs, +bs) apply to {the} only")
        if self.rotation == "hadamard" and not is_power_of_two(group_size(self)):
            raise ValueError(f"rotation needs a power-of-two group_size, got {self.group_size}")
        if self.error_feedback and not codec.error_feedback:
            raise ValueError(f"error_feedback applies to these codecs only: {_having('error_feedback')}")

    @property
    def torch_buffer_dtype(self) -> torch.dtype:
        return torch.float16 if self.buffer_dtype == "float16" else torch.bfloat16

    @property
    def wire_bits(self) -> int:
        """Bits per element the codec puts on the wire in steady state (scales and framing aside)."""
        return codec_class(self.name).wire_bits(self)

    @property
    def label(self) -> str:
        """Short name for tables and plots, e.g. `aqsgd2`, `gradq4+ef`, `aqsgd2+ch`, `gradq2+ef+rot`, in the codec's
        own grammar (`Codec.label`; rounding is not part of it: each codec family has its own default)."""
        return codec_class(self.name).label(self)

    def local_options(self) -> dict:
        """The fields no label names but `group_size` (set by `+gN` only where a label has it): a peer's own
        options (--group-size, --zstd-level, --codec-seed, --buffer-dir), which hold on a link whatever codec a
        plan names for it (`CodecConfig.parse(label, **config.local_options())`)."""
        return {name: getattr(self, name) for name in LOCAL_FIELDS}

    @classmethod
    def parse(cls, text: str, **defaults) -> CodecConfig:
        """Parses a label: `fp32`, `aqsgd2`, `gradq4+ef`, `aqsgd2+ch+nr`, `gradq2+ef+rot+g256` (suffixes in
        `LABEL_SUFFIXES` and `+gN`, a group size of N elements, in any order). `defaults` are fields the label does
        not set; a suffix wins over them. `label` does not print the group size."""
        head, *suffixes = text.split("+")
        name = head if head in CODEC_NAMES else head.rstrip("0123456789")
        digits = head[len(name) :]
        kwargs = dict(defaults)
        kwargs["name"] = name
        if digits:
            kwargs["rank" if name in BY_NAME and BY_NAME[name].ranked else "bits"] = int(digits)
        for suffix in suffixes:
            if suffix[:1] == "r" and suffix[1:].isdigit():  # +r50: tern's rate weight, in percent
                kwargs["rate_percent"] = int(suffix[1:])
                continue
            if suffix[:3] == "dsl" and suffix[3:].isdigit():  # +dsl16: deltas subspace-coded at rank 16
                kwargs["delta_rank"] = int(suffix[3:])
                continue
            if suffix[:4] == "fsle" and suffix[4:].isdigit():  # +fsle10: ranks grown to leave out at most 0.1%
                kwargs["first_sight_energy"] = int(suffix[4:])
                continue
            if suffix[:4] == "fslw" and suffix[4:].isdigit():  # +fslw4: first sights at a quarter of the width
                kwargs["first_sight_width_divisor"] = int(suffix[4:])
                continue
            if suffix[:3] == "fsl" and suffix[3:].isdigit():  # +fsl32: first sights subspace-coded at rank 32
                kwargs["first_sight_rank"] = int(suffix[3:])
                continue
            if suffix[:2] == "fs" and suffix[2:].isdigit():  # +fs4: AQ-SGD's first sights quantized at 4 bits
                kwargs["first_sight_bits"] = int(suffix[2:])
                continue
            if suffix[:1] == "f" and suffix[1:].isdigit():  # +f8: lowrank's factor bits
                kwargs["factor_bits"] = int(suffix[1:])
                continue
            if suffix[:1] == "s" and suffix[1:].isdigit():  # +s30: lowrank's subspace coding, step 30% of rms
                kwargs["subspace_step_percent"] = int(suffix[1:])
                continue
            if suffix[:1] == "k" and suffix[1:].isdigit():  # +k64: topk's elements kept per group
                kwargs["keep"] = int(suffix[1:])
                continue
            if suffix[:1] == "g" and suffix[1:].isdigit():  # +g256: this codec's group size, over any default
                kwargs["group_size"] = int(suffix[1:])
                continue
            if suffix not in LABEL_SUFFIXES:
                known = ", ".join("+" + k for k in LABEL_SUFFIXES)
                raise ValueError(f"unknown codec suffix +{suffix} in {text!r} (known: {known}, +gN for a group size)")
            kwargs.update(LABEL_SUFFIXES[suffix])
        return cls(**kwargs)


def _having(trait: str) -> str:
    """The registered codecs with `trait`, for error messages: `gradq, gsign, gtern`."""
    return ", ".join(n for n, c in BY_NAME.items() if getattr(c, trait))
