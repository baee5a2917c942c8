"""A run's manifest and its owner's delegations: who may plan and train a run, signed by the run's owner.

An owned run is defined by its `RunManifest`: the model (its flags, and the digest of its starting weights), a
description of the data, the links' codecs, the optimizer schedule, the planners and trainers the owner
delegates (peer ids: hashes of their public keys, `swarm.peers.entries.peer_id_of`), a name, a time, the
owner's RSA public key and the owner's signature over all of it. The run id is a hash of the content and the
owner key (`run_id_of`): a manifest is self-verifying, anyone holding it (or fetching it from the DHT by id)
checks it without trusting whoever handed it over, and no other content or key has the same id.

The owner changes the delegates with a `RunDelegation`: a sequence number, the planners and trainers, the ids
revoked, signed by the owner key. It carries the owner key and the manifest content's digest, so a DHT node
checks it against the run id without the manifest. `RunAuthority.of` folds a manifest and the delegations
seen so far into who may act now: the highest valid sequence names the delegates, a revoked id is never
accepted again (whatever a later delegation says), and an old delegation replayed changes nothing.

Signatures are RSA-PSS over SHA-256 (`cryptography`, as hivemind's `RSAPrivateKey` signs DHT records),
each over a domain-separated canonical JSON encoding (sorted keys, no whitespace, ASCII), so a manifest's
signature is never a delegation's. Everything parsed here comes from untrusted hands: sizes are bounded, each
bad field is named, and an unknown field is refused (a signed document has no room for fields a reader
ignores).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import math
import re
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa

from swarm.peers.fields import PEER_ID_RE, fail, float_field, int_field, set_field, str_field

__all__ = [
    "MAX_DELEGATES",
    "MAX_MANIFEST_BYTES",
    "MAX_REVOKED",
    "RUN_ID_RE",
    "AuthorityTracker",
    "RunAuthority",
    "RunDelegation",
    "RunManifest",
    "canonical",
    "run_id_of",
]

MAX_MANIFEST_BYTES = 16 * 1024
"""Largest manifest (or delegation) accepted, as JSON text."""
MAX_DELEGATES = 16
"""Most planners, and most trainers, a manifest or a delegation may name (a plan names at most 16 trainers)."""
MAX_REVOKED = 256
"""Most ids one delegation may revoke."""
RUN_ID_RE = re.compile(r"[0-9a-f]{32}")
"""A run id: 32 hex digits (128 bits of a SHA-256), a valid DHT namespace (`DHTConfig.run_name`)."""

_MANIFEST_DOMAIN = b"swarm-run-manifest/1\n"
_DELEGATION_DOMAIN = b"swarm-run-delegation/1\n"
_ID_DOMAIN = b"swarm-run-id/1\n"
_MIN_KEY_BITS, _MAX_KEY_BITS = 2048, 8192
_MAX_KEY_CHARS = 2048
_MAX_SIGNATURE_CHARS = 2048
_MAX_TIME_S = 1e11
_MAX_MODEL_FLAGS = 32
_MAX_TEXT = 1024
_MAX_STEPS = 1 << 40
_FLAG_RE = re.compile(r"[a-z][a-z0-9-]{0,31}")
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9 ._-]{0,63}")
_CODEC_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:+-]{0,63}")
_DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")
_HEX64_RE = re.compile(r"[0-9a-f]{64}")
_CODEC_KEYS = ("fw_codec", "bw_codec")
_HASH = hashes.SHA256()
_PADDING = padding.PSS(mgf=padding.MGF1(_HASH), salt_length=padding.PSS.MAX_LENGTH)  # hivemind's, for its keys


def canonical(obj: dict[str, Any]) -> bytes:
    """The one byte encoding of a document that is hashed and signed: JSON, sorted keys, no spaces, ASCII."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def run_id_of(owner_key: str, content_digest: str) -> str:
    """The run id of a manifest content (its `content_digest`, hex SHA-256) under `owner_key` (OpenSSH text)."""
    owner = hashlib.sha256(owner_key.encode()).digest()
    return hashlib.sha256(_ID_DOMAIN + owner + bytes.fromhex(content_digest)).hexdigest()[:32]


def _public_key(record: str, text: Any) -> rsa.RSAPublicKey:
    what = f"an RSA public key of {_MIN_KEY_BITS}-{_MAX_KEY_BITS} bits in OpenSSH text ('ssh-rsa AAAA...')"
    if type(text) is not str or not 0 < len(text) <= _MAX_KEY_CHARS or not text.startswith("ssh-rsa "):
        raise fail(record, "owner_key", what, text)
    try:
        key = serialization.load_ssh_public_key(text.encode())
    except (ValueError, TypeError, binascii.Error, UnicodeError):
        raise fail(record, "owner_key", what, text) from None
    if not isinstance(key, rsa.RSAPublicKey) or not _MIN_KEY_BITS <= key.key_size <= _MAX_KEY_BITS:
        raise fail(record, "owner_key", what, text)
    return key


def _verify(record: str, owner_key: str, signature: Any, message: bytes) -> None:
    key = _public_key(record, owner_key)
    if type(signature) is not str or not 0 < len(signature) <= _MAX_SIGNATURE_CHARS:
        raise fail(record, "signature", "the owner's signature in base64", signature)
    try:
        key.verify(base64.b64decode(signature, validate=True), message, _PADDING, _HASH)
    except (InvalidSignature, ValueError, binascii.Error):
        raise ValueError(f"{record}.signature: bad signature: not made by the owner key over this content") from None


def _sign(private_key: Any, message: bytes) -> str:
    """`private_key` (hivemind's `RSAPrivateKey`, as `swarm.peers.dht_config.load_or_create_key` gives) signs
    `message`."""
    return private_key.sign(message).decode()  # base64 of RSA-PSS over SHA-256 (cryptography)


def _owner_text(private_key: Any) -> str:
    return private_key.get_public_key().to_bytes().decode()


def _ids(record: str, name: str, value: Any, most: int) -> tuple[str, ...]:
    what = f"a list of at most {most} distinct peer ids"
    if not isinstance(value, (list, tuple)) or len(value) > most:
        raise fail(record, name, what, value)
    for pid in value:
        str_field(record, name, pid, PEER_ID_RE, "peer ids of 1-64 characters [A-Za-z0-9._-]")
    if len(set(value)) != len(value):
        raise fail(record, name, what, value)
    return tuple(sorted(value))


def _model_flags(record: str, value: Any) -> tuple[tuple[str, Any], ...]:
    what = f"a dict of at most {_MAX_MODEL_FLAGS} model flags (name -> str, int, float, bool or null)"
    if isinstance(value, (list, tuple)):
        value = dict(value)
    if not isinstance(value, dict) or len(value) > _MAX_MODEL_FLAGS:
        raise fail(record, "model", what, value)
    for key, item in value.items():
        str_field(record, "model", key, _FLAG_RE, "flag names of 1-32 characters [a-z0-9-]")
        ok = item is None or type(item) in (str, bool) or type(item) is int and abs(item) <= 1 << 53
        ok = ok or type(item) is float and math.isfinite(item)
        if not ok or type(item) is str and len(item) > _MAX_TEXT:
            what = "a str of at most 1024 characters, an int, a float, a bool or null"
            raise fail(record, f"model[{key!r}]", what, item)
    return tuple(sorted(value.items()))


def _loads(record: str, text: Any) -> dict[str, Any]:
    if isinstance(text, (bytes, bytearray)):
        if len(text) > MAX_MANIFEST_BYTES:
            raise ValueError(f"{record}: {len(text)} bytes, more than the {MAX_MANIFEST_BYTES} bound")
        try:
            text = bytes(text).decode()
        except UnicodeDecodeError:
            raise ValueError(f"{record}: not UTF-8 text") from None
    if type(text) is not str:
        raise ValueError(f"{record}: expected JSON text, got {type(text).__name__}")
    if len(text) > MAX_MANIFEST_BYTES or len(text.encode()) > MAX_MANIFEST_BYTES:
        raise ValueError(f"{record}: {len(text.encode())} bytes, more than the {MAX_MANIFEST_BYTES} bound")
    try:
        wire = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{record}: not JSON ({e})") from None
    if not isinstance(wire, dict):
        raise ValueError(f"{record}: expected a JSON object, got {type(wire).__name__}")
    return wire


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _fields_of(cls: type, wire: dict[str, Any]) -> dict[str, Any]:
    """`wire`'s fields, each a field of `cls`: an unknown one is refused by name, a missing one too."""
    names = [f.name for f in fields(cls)]
    for key in wire:
        if key not in names:
            raise ValueError(f"{cls.__name__}: unknown field {str(key)[:64]!r}")
    for name in names:
        if name not in wire:
            raise ValueError(f"{cls.__name__}.{name}: missing")
    return dict(wire)


@dataclass(frozen=True)
class RunManifest:
    """What an owned run is, signed by its owner: build with `create`, read with `from_json` (both verify)."""

    name: str
    """A human name for the run (1-64 characters [A-Za-z0-9 ._-]); not unique: the run id is."""
    created_at: float
    """When the owner made it, seconds since the epoch."""
    model: tuple[tuple[str, Any], ...]
    """The model's flags (`swarm.options.ModelFlags`, names without dashes: "layers", "seq-len"...) -> value;
    given as a dict, kept sorted."""
    weights_digest: str | None
    """"sha256:HEX" of the starting weights when the run starts from a checkpoint; None: the seeded init."""
    data: str
    """What the run trains on, in words (at most 1024 characters)."""
    codecs: tuple[tuple[str, str], ...]
    """The links' codec labels: (("bw_codec", label), ("fw_codec", label)); given as a dict."""
    lr: float
    """Peak learning rate of the stages' optimizer."""
    warmup_steps: int
    """Steps of linear learning-rate warm-up."""
    total_steps: int
    """Steps the learning-rate decay spans."""
    planners: tuple[str, ...]
    """Peer ids the owner delegates planning to (sorted): only their plans count, failover among them."""
    trainers: tuple[str, ...]
    """Peer ids of the trainers the owner delegates (sorted): the only ones a plan may name."""
    owner_key: str
    """The owner's RSA public key, OpenSSH text ('ssh-rsa AAAA...')."""
    run_id: str
    """`run_id_of(owner_key, content_digest)`: checked, never trusted."""
    signature: str = field(repr=False)
    """The owner's signature (base64) over the canonical encoding of every other field."""

    def __post_init__(self) -> None:
        r = type(self).__name__
        str_field(r, "name", self.name, _NAME_RE, "1-64 characters [A-Za-z0-9 ._-]")
        set_field(self, "created_at", float_field(r, "created_at", self.created_at, 0.0, _MAX_TIME_S))
        set_field(self, "model", _model_flags(r, self.model))
        if self.weights_digest is not None:
            str_field(r, "weights_digest", self.weights_digest, _DIGEST_RE, "'sha256:' and 64 hex digits, or null")
        if type(self.data) is not str or len(self.data) > _MAX_TEXT:
            raise fail(r, "data", f"a str of at most {_MAX_TEXT} characters", self.data)
        codecs = dict(self.codecs) if isinstance(self.codecs, (list, tuple)) else self.codecs
        if not isinstance(codecs, dict) or sorted(codecs) != sorted(_CODEC_KEYS):
            raise fail(r, "codecs", f"a dict of exactly {list(_CODEC_KEYS)}", self.codecs)
        for key in _CODEC_KEYS:
            str_field(r, f"codecs[{key!r}]", codecs[key], _CODEC_RE, "a codec label")
        set_field(self, "codecs", tuple(sorted(codecs.items())))
        set_field(self, "lr", float_field(r, "lr", self.lr, 1e-12, 10.0))
        if self.lr <= 0:
            raise fail(r, "lr", "a positive learning rate", self.lr)
        int_field(r, "warmup_steps", self.warmup_steps, 0, _MAX_STEPS)
        int_field(r, "total_steps", self.total_steps, 1, _MAX_STEPS)
        set_field(self, "planners", _ids(r, "planners", self.planners, MAX_DELEGATES))
        set_field(self, "trainers", _ids(r, "trainers", self.trainers, MAX_DELEGATES))
        _public_key(r, self.owner_key)
        str_field(r, "run_id", self.run_id, RUN_ID_RE, "32 hex digits")
        derived = run_id_of(self.owner_key, self.content_digest)
        if self.run_id != derived:
            raise ValueError(f"{r}.run_id: {self.run_id} does not match its content and owner key (that is {derived})")
        _verify(r, self.owner_key, self.signature, _MANIFEST_DOMAIN + canonical(self._signed()))

    # -- content ------------------------------------------------------------------------------------------------

    def _content(self) -> dict[str, Any]:
        """Every field the run id hashes besides the owner key."""
        return {
            "name": self.name, "created_at": self.created_at, "model": dict(self.model),
            "weights_digest": self.weights_digest, "data": self.data, "codecs": dict(self.codecs), "lr": self.lr,
            "warmup_steps": self.warmup_steps, "total_steps": self.total_steps, "planners": list(self.planners),
            "trainers": list(self.trainers),
        }  # fmt: skip

    def _signed(self) -> dict[str, Any]:
        return {**self._content(), "owner_key": self.owner_key, "run_id": self.run_id}

    @property
    def content_digest(self) -> str:
        """SHA-256 (hex) of the canonical content: with the owner key, what the run id is a hash of."""
        return hashlib.sha256(canonical(self._content())).hexdigest()

    @property
    def owner_id(self) -> str:
        """The owner key's peer id (as `peer_id_of` gives a peer's)."""
        return hashlib.sha256(self.owner_key.encode()).hexdigest()[:24]

    @property
    def model_flags(self) -> dict[str, Any]:
        return dict(self.model)

    @property
    def codec_labels(self) -> dict[str, str]:
        return dict(self.codecs)

    # -- making and reading -------------------------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        owner: Any,
        *,
        name: str,
        created_at: float,
        model: dict[str, Any],
        codecs: dict[str, str],
        lr: float,
        warmup_steps: int,
        total_steps: int,
        planners: Iterable[str],
        trainers: Iterable[str],
        data: str = "",
        weights_digest: str | None = None,
    ) -> RunManifest:
        """A manifest signed by `owner` (hivemind's `RSAPrivateKey`: `swarm.peers.dht_config.load_or_create_key`'s)."""
        draft = dict(
            name=name, created_at=float(created_at), model=_model_flags(cls.__name__, model),
            weights_digest=weights_digest, data=data, codecs=tuple(sorted(dict(codecs).items())), lr=float(lr),
            warmup_steps=warmup_steps, total_steps=total_steps, planners=tuple(sorted(planners)),
            trainers=tuple(sorted(trainers)), owner_key=_owner_text(owner),
        )  # fmt: skip
        unsigned = object.__new__(cls)  # the content's canonical form, to hash and sign before the checks run
        for key, value in draft.items():
            object.__setattr__(unsigned, key, value)
        run_id = run_id_of(draft["owner_key"], unsigned.content_digest)
        object.__setattr__(unsigned, "run_id", run_id)
        signature = _sign(owner, _MANIFEST_DOMAIN + canonical(unsigned._signed()))
        return cls(**draft, run_id=run_id, signature=signature)

    def to_wire(self) -> dict[str, Any]:
        return {**self._signed(), "signature": self.signature}

    def to_json(self) -> str:
        """The manifest file's text (indented; any JSON layout of the same fields verifies)."""
        return json.dumps(self.to_wire(), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_wire(cls, wire: Any) -> RunManifest:
        """A manifest from an untrusted dict. Raises ValueError naming the bad field (unknown ones too)."""
        if not isinstance(wire, dict):
            raise ValueError(f"{cls.__name__}: expected a JSON object, got {type(wire).__name__}")
        return cls(**_fields_of(cls, wire))

    @classmethod
    def from_json(cls, text: str | bytes, run_id: str | None = None) -> RunManifest:
        """A manifest from untrusted JSON text, verified; with `run_id`, it must be that run's.

        Raises:
            ValueError: oversized, not JSON, an unknown or bad field, a bad signature, an id that does not match
                the content, or another run's manifest; the message names which.
        """
        manifest = cls.from_wire(_loads(cls.__name__, text))
        if run_id is not None and manifest.run_id != run_id:
            raise ValueError(f"{cls.__name__}: the manifest of run {manifest.run_id}, not of run {run_id}")
        return manifest

    @classmethod
    def load(cls, path: str, run_id: str | None = None) -> RunManifest:
        """The verified manifest in file `path`. Raises ValueError naming the file."""
        try:
            with open(path, "rb") as f:
                data = f.read(MAX_MANIFEST_BYTES + 1)
        except OSError as e:
            raise ValueError(f"manifest {path}: cannot read it: {e.strerror or e}") from None
        try:
            return cls.from_json(data, run_id)
        except ValueError as e:
            raise ValueError(f"manifest {path}: {e}") from None


@dataclass(frozen=True)
class RunDelegation:
    """The owner's change of a run's delegates: the highest valid `sequence` names them (`RunAuthority.of`)."""

    run_id: str
    """The run it is for."""
    sequence: int
    """>= 1; a higher one supersedes (the manifest's own delegates are sequence 0)."""
    planners: tuple[str, ...]
    """Peer ids that may plan from this sequence on (sorted)."""
    trainers: tuple[str, ...]
    """Peer ids of the trainers from this sequence on (sorted)."""
    revoked: tuple[str, ...]
    """Peer ids never accepted again, as planners or trainers (sorted; keep every earlier one)."""
    created_at: float
    """When the owner signed it, seconds since the epoch."""
    owner_key: str
    """The owner's public key (OpenSSH text): with `content_digest`, checked against `run_id` without the
    manifest."""
    content_digest: str
    """The manifest's `content_digest`."""
    signature: str = field(repr=False)
    """The owner's signature (base64) over every other field."""

    def __post_init__(self) -> None:
        r = type(self).__name__
        str_field(r, "run_id", self.run_id, RUN_ID_RE, "32 hex digits")
        int_field(r, "sequence", self.sequence, 1, 1 << 53)
        set_field(self, "planners", _ids(r, "planners", self.planners, MAX_DELEGATES))
        set_field(self, "trainers", _ids(r, "trainers", self.trainers, MAX_DELEGATES))
        set_field(self, "revoked", _ids(r, "revoked", self.revoked, MAX_REVOKED))
        set_field(self, "created_at", float_field(r, "created_at", self.created_at, 0.0, _MAX_TIME_S))
        str_field(r, "content_digest", self.content_digest, _HEX64_RE, "64 hex digits")
        _public_key(r, self.owner_key)
        if run_id_of(self.owner_key, self.content_digest) != self.run_id:
            raise ValueError(f"{r}: signed by a foreign owner: its key and content digest are not run {self.run_id}'s")
        _verify(r, self.owner_key, self.signature, _DELEGATION_DOMAIN + canonical(self._signed()))

    def _signed(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id, "sequence": self.sequence, "planners": list(self.planners),
            "trainers": list(self.trainers), "revoked": list(self.revoked), "created_at": self.created_at,
            "owner_key": self.owner_key, "content_digest": self.content_digest,
        }  # fmt: skip

    @classmethod
    def create(
        cls,
        owner: Any,
        manifest: RunManifest,
        sequence: int,
        *,
        planners: Iterable[str],
        trainers: Iterable[str],
        revoked: Iterable[str] = (),
        created_at: float,
    ) -> RunDelegation:
        """The next delegation of `manifest`'s run, signed by `owner` (it must be the manifest's owner key)."""
        if _owner_text(owner) != manifest.owner_key:
            raise ValueError(f"RunDelegation: this key is not the owner of run {manifest.run_id}")
        draft = dict(
            run_id=manifest.run_id, sequence=sequence, planners=tuple(sorted(set(planners))),
            trainers=tuple(sorted(set(trainers))), revoked=tuple(sorted(set(revoked))), created_at=float(created_at),
            owner_key=manifest.owner_key, content_digest=manifest.content_digest,
        )  # fmt: skip
        unsigned = object.__new__(cls)
        for key, value in draft.items():
            object.__setattr__(unsigned, key, value)
        return cls(**draft, signature=_sign(owner, _DELEGATION_DOMAIN + canonical(unsigned._signed())))

    def check_for(self, manifest: RunManifest) -> RunDelegation:
        """Itself, if it belongs to `manifest`'s run and owner; ValueError naming what differs."""
        if self.run_id != manifest.run_id:
            raise ValueError(f"RunDelegation {self.sequence}: for run {self.run_id}, not {manifest.run_id}")
        if self.owner_key != manifest.owner_key or self.content_digest != manifest.content_digest:
            raise ValueError(f"RunDelegation {self.sequence}: signed by a foreign owner, not run {manifest.run_id}'s")
        return self

    def to_wire(self) -> dict[str, Any]:
        return {**self._signed(), "signature": self.signature}

    def to_json(self) -> str:
        return json.dumps(self.to_wire(), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_wire(cls, wire: Any) -> RunDelegation:
        if not isinstance(wire, dict):
            raise ValueError(f"{cls.__name__}: expected a JSON object, got {type(wire).__name__}")
        return cls(**_fields_of(cls, wire))

    @classmethod
    def from_json(cls, text: str | bytes) -> RunDelegation:
        """A delegation from untrusted JSON text, verified against its own run id (`check_for` ties it to a
        manifest). Raises ValueError naming what is wrong."""
        return cls.from_wire(_loads(cls.__name__, text))


@dataclass(frozen=True)
class RunAuthority:
    """Who may act in an owned run now: the manifest's delegates, as the newest valid delegation changed them."""

    planners: frozenset[str]
    """Peer ids whose plans count, and who may plan (by lease among them: `elected_planner`'s `trusted`)."""
    trainers: frozenset[str]
    """Peer ids of the trainers a plan may name."""
    revoked: frozenset[str]
    """Peer ids refused for good."""
    sequence: int = 0
    """The delegation these come from (0: the manifest's own)."""

    @classmethod
    def of(
        cls, manifest: RunManifest, delegations: Iterable[RunDelegation] = (), revoked: Iterable[str] = ()
    ) -> RunAuthority:
        """The authority of `manifest` after `delegations` (each must be `check_for` it: others raise), with the
        `revoked` ids known from earlier reads (a revocation outlives the delegation that carried it)."""
        newest: RunDelegation | None = None
        gone = set(revoked)
        for d in delegations:
            d.check_for(manifest)
            gone.update(d.revoked)
            if newest is None or (d.sequence, d.signature) > (newest.sequence, newest.signature):
                newest = d
        source = manifest if newest is None else newest
        return cls(
            frozenset(source.planners) - gone,
            frozenset(source.trainers) - gone,
            frozenset(gone),
            0 if newest is None else newest.sequence,
        )


class AuthorityTracker:
    """A reader's running view of an owned run's authority, fed the delegations it reads, read after read.

    It keeps the newest delegation seen (so a delegation that expired from the DHT, or that a dishonest node
    withholds, still counts: the peer also re-publishes it) and every id ever revoked (so a revocation holds
    even when an older delegation is all a reader is shown later). Thread-safe: `authority` and `newest` are
    replaced whole, under a lock.
    """

    def __init__(self, manifest: RunManifest):
        self.manifest = manifest
        self.newest: RunDelegation | None = None
        self.authority = RunAuthority.of(manifest)
        self._lock = threading.Lock()

    def update(self, delegations: Iterable[RunDelegation]) -> bool:
        """Folds in `delegations` (each must be `check_for` this run: others raise ValueError, and change
        nothing); whether the authority changed."""
        with self._lock:
            seen = [*delegations, *([self.newest] if self.newest is not None else [])]
            before = self.authority
            after = RunAuthority.of(self.manifest, seen, before.revoked)
            newest = max(seen, key=lambda d: (d.sequence, d.signature), default=None)
            self.authority, self.newest = after, newest
            return after != before
