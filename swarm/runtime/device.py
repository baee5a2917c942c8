"""Where a stage computes: the `--device` argument, its checks, and the moves between host and device.

A stage on "cuda[:N]" holds its module and optimizer state on that GPU (`StageConfig.device`). Its sending
ends of an acsgd boundary keep their AQ-SGD buffers on the GPU (`DeviceBufferStore`) so the fused update runs
there (the Triton kernels) and only the packed codes and fp16 scales travel to the host
(`swarm.kernels.host_copy`: pinned memory, a copy stream of its own, so the copy overlaps the next
micro-batch's compute). Other codecs encode on the host: the tensor is copied the same way first. Receiving ends
decode on the host and hand the result to the GPU (`to_device`). On "cpu" every function here is the identity.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import re
import time
from collections.abc import Callable

import torch

from swarm.compression import MemoryBufferStore

__all__ = [
    "DeviceBufferStore",
    "DeviceError",
    "add_device_argument",
    "check_cpus",
    "check_device",
    "compute_key",
    "fastest_seconds",
    "parse_cpus",
    "parse_device",
    "pin_cpus",
    "render_cpus",
    "resolve_device",
    "synchronize",
    "to_device",
]

_PATTERN = re.compile(r"cpu|cuda(?::(0|[1-9][0-9]{0,3}))?")


class DeviceError(RuntimeError):
    """A device was asked for that this machine does not have."""


def parse_device(text: str) -> str:
    """The device name ("cpu", "cuda" or "cuda:N"), checked for form only (an argparse type; see `resolve_device`)."""
    value = text.strip().lower()
    if not _PATTERN.fullmatch(value):
        raise argparse.ArgumentTypeError(f"device must be cpu, cuda or cuda:N, got {text!r}")
    return value


def parse_cpus(text: str) -> tuple[int, ...] | None:
    """A CPU list as Linux writes one ("0-3", "0,2", "1,4-5"): the CPUs, sorted, each once; "none": None (an
    argparse type: form only; `pin_cpus` checks the machine has them). `render_cpus` writes it back."""
    if text.strip().lower() == "none":
        return None
    cpus: set[int] = set()
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d{1,4})\s*(?:-\s*(\d{1,4})\s*)?", part)
        if m is None or (m[2] is not None and int(m[2]) < int(m[1])):
            raise argparse.ArgumentTypeError(f"cpus must be a CPU list like 0-3 or 0,2, got {text!r}")
        cpus.update(range(int(m[1]), int(m[2] or m[1]) + 1))
    return tuple(sorted(cpus))


def compute_key(device: str, cpus: tuple[int, ...] | None = None, group: str | None = None) -> str:
    """16 hex digits naming the hardware a peer computes on. `group` (`--compute-group`) names it outright;
    otherwise this machine's kernel (its boot id, which every network namespace and container on it shares)
    and the device, and for "cpu" the CPUs this process may run on (`cpus`, or its affinity), so peers pinned to
    CPUs of their own (`--cpus`) have keys of their own. Hashed: the boot id is not announced. "" where the
    machine has no boot id to read and no group is given."""
    if group is not None:
        where = f"group/{group}"
    else:
        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                where = f"{f.read().strip()}/{device}"
        except OSError:
            return ""
        if device == "cpu":
            where += ":" + ",".join(map(str, sorted(cpus if cpus is not None else os.sched_getaffinity(0))))
    return hashlib.blake2b(where.encode(), digest_size=8, person=b"swarm-compute").hexdigest()


def render_cpus(cpus: tuple[int, ...] | None) -> str:
    """`parse_cpus`'s text for `cpus`."""
    return "none" if cpus is None else ",".join(map(str, cpus))


def check_cpus(cpus: tuple[int, ...]) -> None:
    """Raises ValueError naming the CPUs of `cpus` this process may not run on (not on the machine, or outside its
    cgroup's set)."""
    allowed = os.sched_getaffinity(0)
    missing = sorted(set(cpus) - allowed)
    if missing:
        usable = render_cpus(tuple(sorted(allowed)))
        raise ValueError(f"--cpus {render_cpus(cpus)}: no CPU {missing} here (this process may use {usable})")


def pin_cpus(cpus: tuple[int, ...]) -> None:
    """Runs this process, and every process it starts from now on (children inherit it), on `cpus` only (checked
    first: `check_cpus`)."""
    check_cpus(cpus)
    os.sched_setaffinity(0, cpus)


def add_device_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup, default: str = "cpu") -> None:
    """Adds `--device {cpu,cuda,cuda:N}` (checked when parsed; `check_device` checks the device is there)."""
    parser.add_argument(
        "--device",
        type=parse_device,
        default=default,
        metavar="{cpu,cuda,cuda:N}",
        help=f"where the stage computes: module, optimizer state and boundary encoding (default {default})",
    )


def resolve_device(name: str) -> torch.device:
    """The torch device for `name`; DeviceError with what is missing when CUDA is asked for and absent."""
    value = parse_device(name) if not isinstance(name, torch.device) else str(name)
    device = torch.device(value)
    if device.type == "cpu":
        return device
    if not torch.cuda.is_available():
        raise DeviceError(
            f"--device {value}: CUDA is not available here (torch {torch.__version__}, built with CUDA "
            f"{torch.version.cuda or 'none'}); run with --device cpu or on a machine with an NVIDIA GPU"
        )
    count = torch.cuda.device_count()
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index >= count:
        raise DeviceError(f"--device {value}: this machine has {count} CUDA device(s) (cuda:0..cuda:{count - 1})")
    return torch.device("cuda", index)


def check_device(name: str) -> str:
    """`name` normalized ("cuda" -> "cuda:I"), or DeviceError: for entry points to fail early and clearly."""
    return str(resolve_device(name))


def synchronize(device: torch.device | str) -> None:
    """Waits until the work queued on `device` is done (CUDA launches return before their kernels run, so a host
    clock read after a launch times the launch, not the kernel). Nothing to wait for on "cpu"."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


_clock = time.perf_counter  # the host clock `fastest_seconds` reads (a test replaces it to see the order of calls)


def fastest_seconds(work: Callable[[], object], device: torch.device | str, iters: int, warmup: int = 2) -> float:
    """The fastest of `iters` timed calls of `work` after `warmup` untimed ones, in seconds, with the device
    synchronized before each clock read: the start excludes work queued earlier, the end includes this call's
    kernels. The fastest, not the median: a peer measures while others start beside it on a shared machine."""
    for _ in range(warmup):  # allocator, kernel selection, Triton/cuBLAS autotuning
        work()
    fastest = math.inf
    for _ in range(iters):
        synchronize(device)
        start = _clock()
        work()
        synchronize(device)
        fastest = min(fastest, _clock() - start)
    return fastest


def to_device(device: torch.device | str, *tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """The tensors on `device` (None stays None; a CPU tensor to a CUDA device goes through pinned memory
    without blocking the host). On "cpu" the tensors themselves."""
    device = torch.device(device)
    return tuple(t if t is None or t.device == device else _move(t, device) for t in tensors)


def _move(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class DeviceBufferStore(MemoryBufferStore):
    """AQ-SGD message buffers in the device's memory (rows allocated in doubling blocks up to the capacity), so a
    sending end's fused update runs where the activation is."""

    def __init__(self, capacity: int, dtype: torch.dtype, device: torch.device | str):
        super().__init__(capacity, dtype)
        self.device = torch.device(device)

    def _allocate(self, sample_shape: tuple[int, ...]):
        return _DeviceRows(sample_shape, self.capacity, self.dtype, self.device)

    def gather(self, slots: list[int]) -> torch.Tensor:
        if not slots:
            return torch.empty((0, *(self.sample_shape or ())), dtype=self.dtype, device=self.device)
        return self._data[torch.tensor(slots, dtype=torch.long, device=self.device)]

    def scatter(self, slots: list[int], values: torch.Tensor) -> None:
        if slots:
            self._save_rows(slots)  # the open transaction's journal (compression.buffers)
            self._data[torch.tensor(slots, dtype=torch.long, device=self.device)] = values.to(self.device, self.dtype)

    def admit(self, sample_ids: list[int], values: torch.Tensor) -> list[bool]:
        return super().admit(sample_ids, values.to(self.device))


class _DeviceRows:
    """A [capacity, *shape] row store on a device, growing in doubling blocks, indexable like a tensor."""

    def __init__(self, sample_shape: tuple[int, ...], capacity: int, dtype: torch.dtype, device: torch.device):
        self._shape, self._capacity, self._dtype, self._device = sample_shape, capacity, dtype, device
        self._rows = torch.empty((0, *sample_shape), dtype=dtype, device=device)

    def __getitem__(self, index):
        return self._rows[index]

    def __setitem__(self, index, value) -> None:
        top = int(index.max()) if isinstance(index, torch.Tensor) else int(index)
        if top >= self._rows.shape[0]:
            size = min(self._capacity, max(64, 2 * (top + 1)))
            grown = torch.empty((size, *self._shape), dtype=self._dtype, device=self._device)
            grown[: self._rows.shape[0]] = self._rows
            self._rows = grown
        self._rows[index] = value
