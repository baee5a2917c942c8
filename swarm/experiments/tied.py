"""The tied embedding's sum in `swarm experiment convergence`: a setting's last part, `@tN` (the sum at N bits) or
`@lrN[+f8]` (the sum as rank-N PowerSGD factors, `swarm.compression.codec_lowrank`, fp16 or 8-bit factors)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from swarm.runtime.inprocess import LocalPipeline

__all__ = ["apply_tied", "split_tied"]


def split_tied(text: str) -> tuple[str, int | None, str | None]:
    """`FW/BW@t3` -> (`FW/BW`, 3, None); `FW/BW@lr4+f8` -> (`FW/BW`, None, `lowrank4+ef+f8`): the tied sum's bits
    (one of the quantized codecs' widths) or its low-rank codec label, after every other part."""
    from swarm.compression import CodecConfig
    from swarm.compression.quantized import SUPPORTED_BITS

    head, sep, rest = text.partition("@lr")
    if sep:
        rank, plus, suffixes = rest.partition("+")
        if not rank.isdigit() or "@" in rest or (plus and suffixes != "f8"):
            raise ValueError(f"setting {text!r}: @lrN[+f8] takes a rank N (and +f8 for 8-bit factors), last")
        label = f"lowrank{rank}+ef" + (f"+{suffixes}" if plus else "")
        CodecConfig.parse(label)  # the rank's range is the codec's to check
        return head, None, label
    head, sep, bits = text.partition("@t")
    if not sep:
        return text, None, None
    if not bits.isdigit() or int(bits) not in SUPPORTED_BITS:
        raise ValueError(f"setting {text!r}: @tN takes N in {SUPPORTED_BITS}, after every other part")
    return head, int(bits), None


def apply_tied(pipe: LocalPipeline, tied_bits: int | None, tied_codec: str | None, zstd_level: int) -> None:
    """Sets the tied sum's floor of bits, or its codec, on this run's hosts only (instance attributes, as a
    plan's epilogue codecs would: each host's stage-group codec stays what it was)."""
    from swarm.compression import CodecConfig

    for host in (h for replicas in pipe.replica_hosts for h in replicas):
        if tied_bits is not None:  # instance attributes over the class's: the backward codec at these bits
            host.averager.tied_min_bits, host.averager.tied_codec = tied_bits, None
        if tied_codec is not None:
            tied = CodecConfig.parse(tied_codec, zstd_level=zstd_level)
            host.averager.set_codecs(host.averager.codecs[False], tied)
