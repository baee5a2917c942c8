"""AQ-SGD message buffers: one activation per sample id, per link and direction, held identically on both ends.

A store maps sample ids to slots of a preallocated [capacity, *sample_shape] tensor in fp16/bf16, in RAM
(`MemoryBufferStore`) or in a memory-mapped file for data sets larger than memory (`MmapBufferStore`).

A store holds at most `capacity` samples, and at most `budget_bytes` of rows once it knows the sample shape
(`limit_bytes`; the capacity becomes budget // bytes per sample). At capacity it follows its eviction policy:
"lru" (`CodecConfig.buffer_eviction`'s default, set by `LinkState`) evicts the least recently seen sample (seen =
admitted, or moved by a delta: `touch`) to admit a new one, which is then simply a first sight again when it comes
back; "none" (a bare store's default) admits no new samples, so those travel in full every time. Both policies
depend only on the sequence of ids a link's messages carry, so two ends with the same capacity that decode the
messages in the order they were encoded agree on which samples are buffered without talking about it. Where they
do not agree (different budgets, a restarted peer, a receiving end shared by several senders, messages decoded
out of order, ids released by the runtime), the receiver reports the miss of a delta's reference (it never
decodes against nothing) and the sender re-sends those samples in full: disagreement costs bytes, never values.

Transactions: between `begin` and `commit`/`rollback` a store journals what it changes (the first prior value of
each row it writes, the first prior slot of each id it admits or forgets, and its slot allocation), so that a
step that is abandoned leaves the store exactly as the step found it (on both ends of a link alike) and a retry
sends what a clean run sends. The journal holds only the rows the step touched and is dropped at commit.

A buffer directory belongs to one process (`lock_buffer_dir`, claimed by swarm-peer at start): two stages given the
same one would overwrite each other's receive buffers, so the second refuses to start.
"""

from __future__ import annotations

import fcntl
import math
import os
import threading
import warnings
from collections import OrderedDict, deque
from pathlib import Path

import torch

from swarm.compression.wire import WireError

MAX_SAMPLE_ID = 1 << 53
"""Sample ids lie in [0, MAX_SAMPLE_ID): exact as floats in every metric and log, and far beyond any data set.
An id outside is refused before it reaches a buffer store, a label table or a step's record."""


def check_sample_ids(ids, field: str = "sample_ids") -> None:
    """Refuses (WireError naming `field`) sample ids outside [0, MAX_SAMPLE_ID); changes nothing."""
    if len(ids) and not (min(ids) >= 0 and max(ids) < MAX_SAMPLE_ID):
        bad = next(int(i) for i in ids if not 0 <= i < MAX_SAMPLE_ID)
        raise WireError(field, f"{bad} is outside [0, 2^53)")


class BufferDirInUse(RuntimeError):
    """Another process holds this buffer directory: its stores would overwrite this one's."""


BUFFER_DIR_LOCK = ".swarm-buffers.lock"
"""The lock file a process holds (fcntl.flock) in each buffer directory it uses, for its whole life."""
_held_dirs: dict[str, int] = {}
_held_dirs_lock = threading.Lock()


def lock_buffer_dir(directory: str | os.PathLike) -> Path:
    """Claims `directory` for this process's memory-mapped buffer stores until the process ends (the kernel
    drops the lock when it dies, however it dies). Claiming it again from the same process is a no-op: a stage
    rebuilt on a plan change maps the same files. Returns the directory, resolved.

    Raises:
        BufferDirInUse: another process holds it (its pid, from the lock file, is named).
    """
    path = Path(directory).resolve()
    with _held_dirs_lock:
        if str(path) in _held_dirs:
            return path
        path.mkdir(parents=True, exist_ok=True)
        fd = os.open(path / BUFFER_DIR_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise BufferDirInUse(
                f"buffer directory {path} is in use by another process (pid {holder}): two stages on one directory "
                "overwrite each other's AQ-SGD buffers; give each its own --buffer-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        _held_dirs[str(path)] = fd
    return path


EVICTIONS = ("lru", "none")
"""What a full store does with a new sample: evict the least recently seen one, or not admit the new one."""


class BufferStore:
    """Slots of sample activations keyed by sample id. Subclasses decide where the slots live."""

    def __init__(self, capacity: int, dtype: torch.dtype, eviction: str = "none"):
        if eviction not in EVICTIONS:
            raise ValueError(f"eviction must be one of {EVICTIONS}, got {eviction!r}")
        self.capacity = capacity
        self.dtype = dtype
        self.eviction = eviction
        self.budget_bytes: int | None = None
        """the most bytes of rows this store holds (`limit_bytes`); None: `capacity` samples"""
        self._recent: OrderedDict[int, int] = OrderedDict()
        """buffered ids, least recently seen first, each with the clock of its last sight (the LRU order)"""
        self._clock = 0
        self.evicted = 0
        """samples evicted so far (a metric: each comes back as a first sight)"""
        self.sample_shape: tuple[int, ...] | None = None
        self._slots: dict[int, int] = {}
        self._next_slot = 0
        """slots ever handed out: the next fresh one when no forgotten slot waits for reuse"""
        self._free: deque[int] = deque()
        """slots of forgotten ids, reused first (FIFO), so a live id never shares its slot"""
        self._data: torch.Tensor | None = None
        self._warned_full = False
        self._journal: _Journal | None = None
        """the open transaction's undo record (None: changes are permanent at once)"""

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, sample_id: int) -> bool:
        return sample_id in self._slots

    def _allocate(self, sample_shape: tuple[int, ...]) -> torch.Tensor:
        raise NotImplementedError

    def limit_bytes(self, budget_bytes: int | None) -> None:
        """Holds at most `budget_bytes` of rows (None or 0: no budget beyond the capacity); set before the first
        sample arrives, as the capacity in samples follows from the sample shape then."""
        if self.sample_shape is not None:
            raise RuntimeError("a buffer store's budget is set before its first sample")
        if budget_bytes is not None and budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.budget_bytes = budget_bytes or None

    def sample_nbytes(self) -> int:
        """Bytes of one buffered sample (0 until the first sample sets the shape)."""
        if self.sample_shape is None:
            return 0
        return math.prod(self.sample_shape) * torch.empty((), dtype=self.dtype).element_size()

    def _check_shape(self, sample_shape: tuple[int, ...]) -> None:
        if self.sample_shape is None:
            self.sample_shape = sample_shape
            if self.budget_bytes is not None:
                self.capacity = min(self.capacity, self.budget_bytes // max(1, self.sample_nbytes()))
            self._data = self._allocate(sample_shape)
        elif sample_shape != self.sample_shape:
            raise ValueError(f"sample shape {sample_shape} differs from this buffer's {self.sample_shape}")

    def ids(self) -> list[int]:
        """The buffered sample ids, in the order they were admitted."""
        return list(self._slots)

    def recency(self) -> list[int]:
        """The buffered sample ids, least recently seen first: the order a full "lru" store evicts them in."""
        return list(self._recent)

    def touch(self, sample_ids: list[int]) -> None:
        """Marks buffered ids as just seen (a delta moved them), in the given order; unknown ids are ignored."""
        for sample_id in sample_ids:
            if int(sample_id) in self._slots:
                self._seen(int(sample_id))

    def _seen(self, sample_id: int) -> None:
        journal = self._journal
        if journal is not None and sample_id not in journal.ticks:
            journal.ticks[sample_id] = self._recent.get(sample_id)
        self._clock += 1
        self._recent[sample_id] = self._clock
        self._recent.move_to_end(sample_id)

    def _unseen(self, sample_id: int) -> None:
        journal = self._journal
        if journal is not None and sample_id not in journal.ticks:
            journal.ticks[sample_id] = self._recent.get(sample_id)
        self._recent.pop(sample_id, None)

    def lookup(self, sample_ids: list[int]) -> list[int]:
        """Slot of each id, -1 where the id is not buffered."""
        return [self._slots.get(int(s), -1) for s in sample_ids]

    def gather(self, slots: list[int]) -> torch.Tensor:
        """A contiguous copy of the given slots, [len(slots), *sample_shape]."""
        assert self._data is not None or not slots
        if not slots:
            return torch.empty((0, *(self.sample_shape or ())), dtype=self.dtype)
        return self._data[torch.tensor(slots, dtype=torch.long)]

    def scatter(self, slots: list[int], values: torch.Tensor) -> None:
        if slots:
            self._save_rows(slots)
            self._data[torch.tensor(slots, dtype=torch.long)] = values.to(self.dtype)

    # ---- transactions -------------------------------------------------------------------------------------

    def begin(self) -> None:
        """Starts journalling (an open transaction is committed first)."""
        self._journal = _Journal()
        self._journal.clock = (self._clock, self.evicted)

    def commit(self) -> None:
        """Makes the transaction's changes permanent and drops its journal."""
        self._journal = None

    def rollback(self) -> None:
        """Undoes every change since `begin`: ids, slots, the free list and the rows' bits, exactly."""
        journal, self._journal = self._journal, None
        if journal is None:
            return
        for sample_id, slot in journal.slots.items():
            if slot is None:
                self._slots.pop(sample_id, None)
            else:
                self._slots[sample_id] = slot
        if journal.alloc is not None:
            self._next_slot, free = journal.alloc
            self._free = deque(free)
        if journal.ticks:
            for sample_id, tick in journal.ticks.items():
                if tick is None:
                    self._recent.pop(sample_id, None)
                else:
                    self._recent[sample_id] = tick
            self._recent = OrderedDict(sorted(self._recent.items(), key=lambda item: item[1]))  # rare: O(n log n)
        self._clock, self.evicted = journal.clock
        if journal.rows:
            index = list(journal.rows)
            self._data[torch.tensor(index, dtype=torch.long, device=_rows_of(self._data).device)] = torch.stack(
                [journal.rows[i] for i in index]
            )

    def journalled(self) -> int:
        """Rows and ids the open transaction holds (0 when none is open): what it costs in memory."""
        return 0 if self._journal is None else len(self._journal.rows) + len(self._journal.slots)

    def _save_rows(self, slots: list[int]) -> None:
        """Journals the prior bits of rows about to be written (the first write of a transaction only)."""
        journal = self._journal
        if journal is None:
            return
        held = _rows_of(self._data)
        new = [s for s in dict.fromkeys(slots) if s not in journal.rows and held is not None and s < held.shape[0]]
        if new:
            old = self._data[torch.tensor(new, dtype=torch.long, device=held.device)].clone()
            journal.rows.update(zip(new, old, strict=True))
        # rows never written before hold nothing to restore: an id that owns one was admitted in this step

    def _save_slot(self, sample_id: int) -> None:
        """Journals an id's prior slot (None: not buffered) and the allocator, before its mapping changes."""
        journal = self._journal
        if journal is None:
            return
        if journal.alloc is None:
            journal.alloc = (self._next_slot, tuple(self._free))
            journal.free = frozenset(self._free)
        if sample_id not in journal.slots:
            journal.slots[sample_id] = self._slots.get(sample_id)

    def admit(self, sample_ids: list[int], values: torch.Tensor) -> list[bool]:
        """Stores `values[i]` for each new id while there is room; returns which ids are now buffered."""
        self._check_shape(tuple(values.shape[1:]))
        stored = []
        for i, sample_id in enumerate(sample_ids):
            slot = self._slots.get(int(sample_id))
            if slot is None and len(self._slots) >= self.capacity and self.eviction == "lru" and self._recent:
                self.forget([next(iter(self._recent))])  # the least recently seen sample: a first sight again
                self.evicted += 1
            if slot is None and len(self._slots) < self.capacity:
                self._save_slot(int(sample_id))
                slot = self._slots[int(sample_id)] = self._take_slot()
                if self._journal is not None and not self._journal.fresh(slot):
                    self._save_rows([slot])  # a slot an id held when the step began (forgotten since)
            elif slot is not None:
                self._save_rows([slot])
            if slot is None:
                if not self._warned_full and self.capacity == 0:
                    warnings.warn(
                        f"AQ-SGD buffer store holds no sample (budget {self.budget_bytes} bytes, a sample "
                        f"{self.sample_nbytes()}): every sample travels as a first sight",
                        stacklevel=2,
                    )
                    self._warned_full = True
                if not self._warned_full:
                    warnings.warn(
                        f"AQ-SGD buffer store is full ({self.capacity} samples) and evicts nothing: further new "
                        "samples travel in full every time; raise buffer_capacity or use a memory-mapped store",
                        stacklevel=2,
                    )
                    self._warned_full = True
                stored.append(False)
                continue
            self._data[slot] = values[i].to(self.dtype)
            self._seen(int(sample_id))
            stored.append(True)
        return stored

    def _take_slot(self) -> int:
        """A slot no live id holds: a forgotten one first, else the next never used (below the capacity, as
        live ids + free slots = slots handed out)."""
        if self._free:
            return self._free.popleft()
        self._next_slot += 1
        return self._next_slot - 1

    def forget(self, sample_ids: list[int]) -> None:
        """Drops ids; their slots go to the free list for later admissions. Which slot an id gets is local to
        each end: only the id -> value mapping has to agree between the two ends."""
        for sample_id in sample_ids:
            if int(sample_id) in self._slots:
                self._save_slot(int(sample_id))
            slot = self._slots.pop(int(sample_id), None)
            if slot is not None:
                self._free.append(slot)
                self._unseen(int(sample_id))

    def get(self, sample_id: int) -> torch.Tensor | None:
        slot = self._slots.get(int(sample_id))
        return None if slot is None else self._data[slot]


class _Journal:
    """One transaction's undo record: prior rows by slot, prior slots by id, the allocator as it was."""

    __slots__ = ("alloc", "clock", "free", "rows", "slots", "ticks")

    def __init__(self) -> None:
        self.rows: dict[int, torch.Tensor] = {}
        self.slots: dict[int, int | None] = {}
        self.ticks: dict[int, int | None] = {}
        """prior LRU clock of each id whose recency changed (None: it was not buffered)"""
        self.clock: tuple[int, int] = (0, 0)
        """the store's clock and eviction count when the transaction began"""
        self.alloc: tuple[int, tuple[int, ...]] | None = None
        self.free: frozenset[int] = frozenset()

    def fresh(self, slot: int) -> bool:
        """Whether no id held `slot` when the transaction began (never handed out, or free): nothing to restore."""
        return self.alloc is not None and (slot >= self.alloc[0] or slot in self.free)


def _rows_of(data) -> torch.Tensor | None:
    """The rows a store's data holds now (a growing store allocates lazily: rows past them were never written)."""
    return None if data is None else getattr(data, "_rows", data)


class MemoryBufferStore(BufferStore):
    """Slots in RAM, allocated in growing blocks up to the capacity."""

    def _allocate(self, sample_shape: tuple[int, ...]) -> torch.Tensor:
        return _GrowingRows(sample_shape, self.capacity, self.dtype)


class MmapBufferStore(BufferStore):
    """Slots in a memory-mapped file of capacity x sample size, so the OS pages them in and out."""

    def __init__(self, capacity: int, dtype: torch.dtype, path: str | os.PathLike, eviction: str = "none"):
        super().__init__(capacity, dtype, eviction)
        self.path = Path(path)

    def _allocate(self, sample_shape: tuple[int, ...]) -> torch.Tensor:
        per_sample = 1
        for d in sample_shape:
            per_sample *= d
        nbytes = self.capacity * per_sample * torch.empty((), dtype=self.dtype).element_size()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "wb") as f:
            f.truncate(nbytes)  # sparse: disk is used only as slots fill
        flat = torch.from_file(str(self.path), shared=True, size=self.capacity * per_sample, dtype=self.dtype)
        return flat.view(self.capacity, *sample_shape)


class _GrowingRows:
    """A [capacity, *shape] row store that allocates rows in doubling blocks, indexable like a tensor."""

    def __init__(self, sample_shape: tuple[int, ...], capacity: int, dtype: torch.dtype):
        self._shape, self._capacity, self._dtype = sample_shape, capacity, dtype
        self._rows = torch.empty((0, *sample_shape), dtype=dtype)

    def _ensure(self, max_row: int) -> None:
        if max_row < self._rows.shape[0]:
            return
        size = min(self._capacity, max(64, 2 * (max_row + 1)))
        grown = torch.empty((size, *self._shape), dtype=self._dtype)
        grown[: self._rows.shape[0]] = self._rows
        self._rows = grown

    def __getitem__(self, index):
        return self._rows[index]

    def __setitem__(self, index, value) -> None:
        top = int(index.max()) if isinstance(index, torch.Tensor) else int(index)
        self._ensure(top)
        self._rows[index] = value


def make_store(capacity: int, dtype: torch.dtype, path: str | None, eviction: str = "none") -> BufferStore:
    if path is None:
        return MemoryBufferStore(capacity, dtype, eviction)
    return MmapBufferStore(capacity, dtype, path, eviction)
