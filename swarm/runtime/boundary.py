"""One stage's ends of its boundaries: codec state per direction, and the data path out and in.

Stage k holds the receiving end of the activations from stage k-1 and the sending end of the gradients back
to it, and the sending end of its activations to stage k+1 and the receiving end of the gradients from it
(sending ends per destination address).
The way out is `LinkEnds.outgoing` (encode, then `tensor_items`: frame -> stream items -> pace) and the way
in its mirror (`read_stream`: stream items -> unframe, checked; then `LinkEnds.incoming`: decode); both run
the same in one process and across peers.

What comes in is checked before anything computes on it (`LinkWatch`): a decoded activation or gradient must be
finite, and its RMS within `LinkWatch.ratio` times the median RMS of the last messages of that receiving end
(and under an absolute ceiling). A message that breaks either is refused (INVALID_ARGUMENT) naming its sender,
the route's neighbour the call came from, with `swarm.runtime.suspects.blame_tag` for the trainer's strikes. The
check costs one reduction per message.
"""

from __future__ import annotations

import logging
import math
import re
import threading
import zlib
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch

from swarm.compression import (
    BufferStore,
    CodecConfig,
    LinkState,
    MmapBufferStore,
    WireError,
    WireLimits,
    ZstdPolicy,
    codec_class,
    make_codec,
)
from swarm.kernels.host_copy import to_host
from swarm.net.stream import CallRefused, tensor_items
from swarm.peers.shaper import LinkShaping
from swarm.proto import stage_pb2, wire_pb2
from swarm.runtime.device import DeviceBufferStore, resolve_device, to_device
from swarm.runtime.epilogue import EpiloguePlan
from swarm.runtime.gate import GateError
from swarm.runtime.messages import StageCall
from swarm.runtime.suspects import blame_tag

__all__ = ["MAX_DESTINATIONS", "EpilogueOnly", "LinkEnd", "LinkEnds", "LinkWatch", "need_message", "send_file"]

log = logging.getLogger(__name__)


MAX_DESTINATIONS = 8
"""Sending ends a stage keeps per kind (one per destination address); past it the least recently used is
dropped (its destination is then sent first sights in full again), so no caller can grow them without bound."""

KINDS = ("fw", "bw", "bwp")
"""The kinds of a boundary's sending ends: activations forward, activation gradients backward, and the gradients
that epilogue-only compression leaves at the precise codec (`swarm.runtime.epilogue`: those a forward hides)."""
GRADIENT_WATCH_RATIO = 100.0
"""`LinkWatch.ratio` of a receiving end of gradients: they follow the loss, and a loss spike moves them far more than
normalized activations move (an honest 3 x 2 attacks run, clean: 30-42 x the link's median for three steps after
one, each a refused step and a strike for an honest peer under the activations' 30); 100 x is the trainer's
bound on a stage's gradient norm against its history (`SuspectConfig.norm_ratio` 1e4 on the squared norm)."""


class LinkWatch:
    """The magnitude of what one receiving end decodes: the RMS of its last `history` messages.

    `check` refuses a message whose values are not all finite, whose RMS exceeds `ceiling`, or, once
    `min_history` messages were accepted, exceeds `ratio` times the largest RMS among the last ones. The largest,
    not the median: an honest link's gradients grow by more than 30x over a few steps as the warm-up ends (the
    demo's backward link, median 5.6e-5, was struck out by the median rule), while no honest message jumps 30x
    past every one before it (see docs/SECURITY.md "Lying peers").

    Args:
        ratio: largest ratio of a message's RMS to the largest RMS of the last ones.
        history: messages whose RMS make that reference.
        min_history: accepted messages before the ratio applies (only finiteness and `ceiling` before).
        ceiling: largest RMS at all (fp16 holds at most 65504).
    """

    def __init__(self, ratio: float = 30.0, history: int = 32, min_history: int = 8, ceiling: float = 1e4):
        if not (ratio > 1 and history >= min_history >= 1 and ceiling > 0):
            raise ValueError("LinkWatch: need ratio > 1, history >= min_history >= 1, ceiling > 0")
        self.ratio, self.min_history, self.ceiling = ratio, min_history, ceiling
        self._rms: deque[float] = deque(maxlen=history)
        self.peak_ratio = 0.0
        """the largest ratio of an accepted message's RMS to the largest before it (this link's margin)"""

    def check(self, x: torch.Tensor) -> str | None:
        """Why `x` must be refused (None: accepted, and counted in the history). One reduction over `x`."""
        if x.numel() == 0:
            return None
        rms = float(torch.linalg.vector_norm(x.detach(), dtype=torch.float32)) / math.sqrt(x.numel())
        if not math.isfinite(rms):
            return "holds Inf/NaN values (or overflows fp32)"
        if rms > self.ceiling:
            return f"RMS {rms:.4g} exceeds the ceiling {self.ceiling:g}"
        if len(self._rms) >= self.min_history:
            largest = max(self._rms)
            if largest > 0:
                if rms > self.ratio * largest:
                    last = f"the largest of this link's last {len(self._rms)} ({largest:.4g})"
                    return f"RMS {rms:.4g} is more than {self.ratio:g} x {last}"
                self.peak_ratio = max(self.peak_ratio, rms / largest)
        if rms > 0:  # an fp16 stage's zeros after an overflow say nothing of the link's magnitude
            self._rms.append(rms)
        return None


@dataclass(frozen=True)
class EpilogueOnly:
    """Optimus-CC's epilogue-only compression on a stage's backward sends: the messages `plan` marks as exposed go
    at the links' backward codec (its error feedback carries each one's error into the next compressed one: lazy
    error propagation), the others at `precise`."""

    precise: CodecConfig
    """Codec of the backward messages a forward hides (e.g. fp32)."""
    plan: EpiloguePlan = field(default_factory=EpiloguePlan)
    """Which messages are exposed (`swarm.runtime.epilogue`)."""

    @classmethod
    def parse(cls, text: str) -> EpilogueOnly | None:
        """`PRECISE:TAILS[:SCHEDULE:MICRO_BATCHES]` (`swarm-peer --bw-epilogue`), e.g. `fp32:1,1:1f1b:4`: the precise
        codec's label, each boundary's compressed tail, and the step shape they were derived for (any shape
        without); "" is None (every message at the backward codec). ValueError names what is wrong."""
        if not text:
            return None
        parts = text.split(":")
        if len(parts) not in (2, 4):
            raise ValueError(f"--bw-epilogue {text!r}: expected PRECISE:TAILS[:SCHEDULE:MICRO_BATCHES]")
        try:
            tails = tuple(int(t) for t in parts[1].split(","))
            schedule, n_micro = (parts[2], int(parts[3])) if len(parts) == 4 else ("", 0)
            return cls(CodecConfig.parse(parts[0]), EpiloguePlan(tails, schedule, n_micro))
        except ValueError as e:
            raise ValueError(f"--bw-epilogue {text!r}: {e}") from None

    def label(self) -> str:
        """The `parse` form of this choice."""
        plan = self.plan
        tails = ",".join(map(str, plan.tails or ()))
        shape = f":{plan.schedule}:{plan.n_micro}" if plan.schedule or plan.n_micro else ""
        return f"{self.precise.label}:{tails}{shape}"


@dataclass
class LinkEnd:
    """This stage's end of one direction of one boundary: the codec and its state (AQ-SGD buffers, error
    feedback, rounding draws).

    `buffer_file` names this end's memory-mapped buffer store in the codec's `buffer_dir`: every end maps a
    file of its own (two ends on one file overwrite each other's buffers)."""

    config: CodecConfig
    buffer_file: str = ""
    device: torch.device = torch.device("cpu")
    """Where this end encodes: a CUDA device for a sending end of a device-encoded codec (its buffers live
    there), else the CPU."""
    state: LinkState = field(init=False)

    def __post_init__(self) -> None:
        if not codec_class(self.config.name).device_encoded:
            self.device = torch.device("cpu")
        self.codec = make_codec(self.config)
        self.state = LinkState(self.config, self._store())
        self.watch = LinkWatch()
        """what a receiving end accepts (a sending end never uses it)"""

    def _store(self) -> BufferStore | None:
        cfg = self.config
        if self.device.type != "cpu" and codec_class(cfg.name).uses_buffers:
            return DeviceBufferStore(cfg.buffer_capacity, cfg.torch_buffer_dtype, self.device)
        if not (cfg.buffer_dir and codec_class(cfg.name).uses_buffers):
            return None
        if not self.buffer_file:
            raise ValueError("an end with buffers in buffer_dir needs a buffer_file of its own")
        return MmapBufferStore(cfg.buffer_capacity, cfg.torch_buffer_dtype, Path(cfg.buffer_dir) / self.buffer_file)

    @property
    def buffers(self):
        """The AQ-SGD message buffers of this end (None for other codecs)."""
        return self.state.buffers


def send_file(kind: str, address: str) -> str:
    """The buffer file of the sending end of `kind` to `address`: the address made safe for a file name, and
    its CRC so that two addresses that read the same once made safe still get their own files."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", address)[:64]
    return f"{kind}-send-{safe}-{zlib.crc32(address.encode()):08x}.buf"


class LinkEnds:
    """A stage's ends of its two boundaries, their zstd decisions per destination, and the links' shapers.

    The receiving ends are one per kind; the sending ends one per kind and destination address, created on
    first use (`send_end`), so a send to another address never moves the buffers of the real next stage.

    Args:
        forward: codec of the activations (both boundaries).
        backward: codec of the activation gradients (both boundaries).
        shaping: the application's link shaping per destination (None: unshaped).
        adaptive_zstd: decide zstd per link from its rate (the swarm); False compresses every message, as an
            in-process pipeline standing for a slow link does.
    """

    def __init__(
        self,
        forward: CodecConfig,
        backward: CodecConfig,
        shaping: LinkShaping | None = None,
        adaptive_zstd: bool = True,
        recv: tuple[CodecConfig, CodecConfig] | None = None,
        epilogue: EpilogueOnly | None = None,
    ):
        self.epilogue = epilogue
        """Epilogue-only compression of the backward messages (None: every one at `backward`)."""
        precise = epilogue.precise if epilogue is not None else backward
        self._configs = {"fw": forward, "bw": backward, "bwp": precise}
        # a plan's per-link codecs: the other boundary's codecs
        forward_recv, backward_recv = recv or (forward, backward)
        self.forward_recv = LinkEnd(forward_recv, "fw-recv.buf")
        self.backward_recv = LinkEnd(backward_recv, "bw-recv.buf")
        self.backward_recv.watch = LinkWatch(ratio=GRADIENT_WATCH_RATIO)
        self.precise_recv: LinkEnd | None = None
        """The receiving end of the precise gradients epilogue-only compression sends (None without it)."""
        if epilogue is not None:
            self.precise_recv = LinkEnd(epilogue.precise, "bwp-recv.buf")
            self.precise_recv.watch = self.backward_recv.watch  # one link, one history of magnitudes
        self._send: OrderedDict[tuple[str, str], LinkEnd] = OrderedDict()
        """sending ends by (kind, destination address), least recently used first"""
        self.shaping = shaping or LinkShaping()
        self.adaptive_zstd = adaptive_zstd
        self.lock = threading.Lock()
        """Held while a codec state changes: decodes run in the callers' threads, encodes in schedule order."""
        self._zstd: dict[str, ZstdPolicy] = {}
        self.device = torch.device("cpu")
        """The stage's device: decoded tensors go there; sending ends of device-encoded codecs encode there."""
        self.step: int | None = None
        """The step whose codec-state changes are journalled now (`begin_step`); None between steps."""
        self._undo: list[Callable[[], None]] = []
        """the open step's other undo actions (`on_abandon`), run in reverse order when it is abandoned"""

    def with_epilogue(self, epilogue: EpilogueOnly | None) -> LinkEnds:
        """Fresh ends of the same codecs and shaping with epilogue-only compression set (codec state starts over:
        for a host between steps, as `StageHost.apply` takes new links)."""
        return LinkEnds(
            self._configs["fw"],
            self._configs["bw"],
            self.shaping,
            adaptive_zstd=self.adaptive_zstd,
            recv=(self.forward_recv.config, self.backward_recv.config),
            epilogue=epilogue,
        )

    def place_on(self, device: str | torch.device) -> torch.device:
        """Sets the stage's device (DeviceError when it is absent) before any end sends; returns it."""
        resolved = resolve_device(str(device))
        with self.lock:
            if self._send and resolved != self.device:
                raise RuntimeError("the stage's device must be set before its first send")
            self.device = resolved
        return resolved

    def send_end(self, kind: str, address: str) -> LinkEnd:
        """The sending end of `kind` ("fw" or "bw") to `address`, created on first use."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        with self.lock:
            key = (kind, address)
            end = self._send.get(key)
            if end is not None:
                self._send.move_to_end(key)
                return end
            same_kind = [k for k in self._send if k[0] == kind]
            if len(same_kind) >= MAX_DESTINATIONS:
                dropped = self._send.pop(same_kind[0])
                log.warning(
                    "dropping the %s sending end to %s (%d destinations)", kind, same_kind[0][1], MAX_DESTINATIONS
                )
                _unlink_store(dropped)
            end = self._send[key] = LinkEnd(self._configs[kind], send_file(kind, address), self.device)
            if self.step is not None:  # created mid-step: its changes belong to the open step too
                end.state.begin_step()
            return end

    def send_ends(self, kind: str) -> list[LinkEnd]:
        """The sending ends of `kind`, least recently used first."""
        with self.lock:
            return [end for (k, _), end in self._send.items() if k == kind]

    def send_buffers(self, kind: str) -> int | None:
        """Samples buffered over all sending ends of `kind`; None when its codec keeps no buffers."""
        if not codec_class(self._configs[kind].name).uses_buffers:
            return None
        return sum(len(end.buffers) for end in self.send_ends(kind))

    def _ends(self) -> list[LinkEnd]:
        with self.lock:
            return self._ends_held()

    def _ends_held(self) -> list[LinkEnd]:
        """Every end (the lock held)."""
        precise = [self.precise_recv] if self.precise_recv is not None else []
        return [self.forward_recv, self.backward_recv, *precise, *self._send.values()]

    def backward_kind(self, info) -> str:
        """The sending end ("bw" compressed, "bwp" precise) of the backward message of the call `info` names for
        the previous stage (`info.stage`): compressed unless epilogue-only compression leaves it precise."""
        if self.epilogue is None or len(info.stage_micro) or len(info.route) < 2:  # uneven replica counts: all
            return "bw"
        sender = info.stage + 1
        n_micro = int(info.num_micro_batches or 1)
        schedule = info.schedule or "1f1b"
        compress = self.epilogue.plan.compress_backward(schedule, len(info.route), n_micro, sender, info.micro_batch)
        return "bw" if compress else "bwp"

    def backward_recv_for(self, msg: wire_pb2.TensorMessage) -> LinkEnd:
        """The receiving end of a backward message: the precise end for a message at the precise codec (where the
        two differ), else the compressed one (whose decoder refuses any other codec)."""
        precise = self.precise_recv
        if precise is not None and msg.codec == precise.codec.wire and msg.codec != self.backward_recv.codec.wire:
            return precise
        return self.backward_recv

    def begin_step(self, step: int) -> None:
        """`step` opens on this stage: every codec-state change from here on is journalled per end until
        `end_step` (an open step is abandoned first)."""
        with self.lock:
            if self.step is not None:
                self._end(False)
            self.step = step
            for end in self._ends_held():
                end.state.begin_step()

    def end_step(self, commit: bool = True) -> None:
        """The open step ends: applied (`commit`: its changes stay, its journals go) or abandoned (every end
        goes back to the state the step found, bit for bit, so the peer on the other side of each link, which
        abandons the same step, holds the same buffers again, and a retry computes what a clean run does)."""
        with self.lock:
            self._end(commit)

    def _end(self, commit: bool) -> None:
        for end in self._ends_held():
            end.state.end_step(commit)
        undo, self._undo, self.step = self._undo, [], None
        if not commit:
            for action in reversed(undo):
                action()

    def on_abandon(self, action: Callable[[], None]) -> None:
        """Runs `action` if the open step is abandoned (state kept beside the codecs: e.g. the frozen cache's
        sent sets); dropped when it commits. Outside a step it is never run."""
        with self.lock:
            if self.step is not None:
                self._undo.append(action)

    def journalled(self) -> int:
        """Rows and ids every end's journal holds, plus pending undo actions: 0 between steps."""
        return sum(end.state.journalled() for end in self._ends()) + len(self._undo)

    def _check_step(self, step: int | None) -> None:
        """Refuses a codec-state change for a step that is not the open one (a late call of an abandoned step),
        so that nothing outside the open step's journal moves the buffers."""
        if step is not None and step != self.step:
            raise GateError(f"step {step} is not open on this stage's links (open: {self.step})")

    def buffered_samples(self) -> int:
        """Samples held in every AQ-SGD buffer store of this stage, receiving and sending ends."""
        return sum(len(end.buffers) for end in self._ends() if end.buffers is not None)

    def forget(self, sample_ids: list[int], address: str) -> None:
        """Drops the AQ-SGD buffers of these samples in the sending end to `address` (the receiver there lost
        them, or they drifted): they go in full next."""
        with self.lock:
            end = self._send.get(("fw", address))
            if end is not None and end.buffers is not None:
                end.buffers.forget(sample_ids)

    def outgoing(
        self,
        end: LinkEnd,
        tensor: torch.Tensor,
        sample_ids: list[int] | None,
        info: stage_pb2.CallInfo,
        address: str,
        step: int | None = None,
    ) -> Iterator[bytes]:
        """The way out: one tensor as the serialized stream items of a call to `address`.

        Encoding happens now, in the caller's (schedule) order; the rest runs as the transport pulls items.
        With `step`, refuses (GateError) unless it is the open step, whose journal records the change.
        """
        # encode: AQ-SGD quantizes the change since the sample's last sight and moves the sender's buffer;
        # on the device for a device-encoded codec (only codes and scales come back), else on the host
        if tensor.device != end.device:
            (tensor,) = to_host(tensor) if end.device.type == "cpu" else to_device(end.device, tensor)
        with self.lock:
            self._check_step(step)
            msg = end.codec.encode(tensor, sample_ids=sample_ids, state=end.state)
        # frame (zstd where it pays on this link) -> stream items (the call info with the first chunk) -> pace
        policy = self._policy(address, end.config.zstd_level)
        return tensor_items(info, msg, end.config.zstd_level, self.shaping.for_destination(address), policy)

    def incoming(
        self,
        end: LinkEnd,
        msg: wire_pb2.TensorMessage,
        limits: WireLimits,
        step: int | None = None,
        sender: str = "",
    ) -> torch.Tensor:
        """The way in, the mirror of `outgoing` from the message on (`read_stream` has unframed it, bounds
        checked): decode, then check (`LinkWatch`). AQ-SGD returns the receiver's buffer m for these samples.
        Runs only after the call was admitted, so a refused call changes no codec state; with `step`, only while
        it is the open step. A message the check refuses raises CallRefused naming `sender` (the peer it came
        from); the buffers it moved are the open step's, undone when the trainer abandons the step."""
        with self.lock:
            self._check_step(step)
            out = end.codec.decode(msg, state=end.state, limits=limits)
            why = end.watch.check(out)
        if why is not None:
            what = "activation" if end is self.forward_recv else "gradient"
            raise CallRefused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"refused the {what} from peer {sender or '?'}: {why} {blame_tag(sender)}",
            )
        return to_device(self.device, out)[0]

    def _policy(self, address: str, level: int) -> ZstdPolicy:
        with self.lock:
            return self._zstd.setdefault(address, ZstdPolicy(level=level, adaptive=self.adaptive_zstd))


def need_message(call: StageCall) -> wire_pb2.TensorMessage:
    if call.message is None:
        raise WireError("chunk", "the call carries no tensor")
    return call.message


def _unlink_store(end: LinkEnd) -> None:
    """Removes a dropped end's buffer file, so a later end to that address maps a fresh one (an encode still
    running on the dropped end keeps its mapping until it ends)."""
    store = end.buffers
    if isinstance(store, MmapBufferStore):
        store.path.unlink(missing_ok=True)
