"""Remembered verdicts of the DHT's record validators: a record already found valid is not checked again.

Every DHT read checks every record it returns, and every record a node stores or serves: an RSA signature per
subkey (hivemind's `RSASignatureValidator`, which also parses the owner's public key each time) and the run's
record rules (`swarm.peers.entries.RunRecordValidator`: a msgpack decode and the record's own parse). A swarm's
peers read the same few records over and over (the announcements and the plan, twice a second while a role may
change), so most checks repeat one already made. In a profiled quick attacks run the two validators took about a
fifth of a peer's CPU, most of it on records that had not changed.

Only a "valid" verdict is remembered, keyed by the record's exact bytes (key, subkey, value and expiration time),
so a record that differs in any byte is checked in full. Both verdicts are pure functions of those bytes, except
the run's rules' bounds against the clock (an expiry or timestamp too far ahead), which only a record from the
future can fail and which time can only turn from false to true: a remembered "valid" stays right. Refusals are
not remembered, so a record refused now is checked again later, and a stranger's stream of distinct records costs
a check each, as before, and evicts older verdicts at worst (bounded by `MAX_ENTRIES` and `MAX_BYTES`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import DHTRecord

__all__ = ["MAX_BYTES", "MAX_ENTRIES", "CachedSignatureValidator", "VerdictCache"]

MAX_ENTRIES = 4096
"""Records whose "valid" verdict one validator remembers (a swarm's live records: announcements, links, plans)."""
MAX_BYTES = 8 << 20
"""... and at most this many bytes of them (keys and values held as the cache's keys)."""


class VerdictCache:
    """The records found valid, least recently seen evicted first; safe from any thread."""

    def __init__(self, max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES):
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._valid: OrderedDict[tuple, int] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        """records found valid before, not checked again"""

    @staticmethod
    def _key(record: DHTRecord) -> tuple:
        return (record.key, record.subkey, record.value, record.expiration_time)

    def check(self, record: DHTRecord, validate) -> bool:
        """`validate(record)`, or True at once where these exact bytes were found valid before."""
        key = self._key(record)
        with self._lock:
            if key in self._valid:
                self._valid.move_to_end(key)
                self.hits += 1
                return True
        if not validate(record):
            return False
        size = sum(len(part) for part in key[:3] if isinstance(part, bytes)) + 64
        if size > self.max_bytes:
            return True  # valid, but too large to remember
        with self._lock:
            if key not in self._valid:
                self._valid[key] = size
                self._bytes += size
                while len(self._valid) > self.max_entries or self._bytes > self.max_bytes:
                    _, dropped = self._valid.popitem(last=False)
                    self._bytes -= dropped
        return True

    def __len__(self) -> int:
        return len(self._valid)


class CachedSignatureValidator(RSASignatureValidator):
    """hivemind's owner-signature validator (signs this peer's records, checks everyone's) that checks a record's
    signature once: see the module's docstring."""

    def __init__(self, private_key=None, cache: VerdictCache | None = None):
        super().__init__(private_key)
        self.verdicts = cache if cache is not None else VerdictCache()

    def validate(self, record: DHTRecord) -> bool:
        return self.verdicts.check(record, super().validate)
