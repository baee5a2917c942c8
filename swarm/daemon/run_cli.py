"""`swarm run`: make an owned run (`init`), verify and print its manifest (`show`), delegate planners and trainers
(`delegate`) and revoke them (`revoke`); and how a peer or a trainer takes its settings from a run's manifest.

An owned run is a `swarm.peers.manifest.RunManifest` signed by the owner's key. `init_run` writes into one
directory the owner key, the manifest (`run.json`) and, unless told existing ids, a planner key and a trainer
key it delegates. Volunteers join with the run id alone (`swarm-peer --run ID --initial-peers ...`): the
manifest is fetched from the DHT and verified (`manifest_of`), and the model, codecs and schedule come from it
(`with_manifest`); a flag that contradicts the manifest is refused by name. The owner's later changes are
`RunDelegation`s written beside the manifest (`delegation-N.json`, N the sequence) and published with
`--initial-peers`; every member of the run re-publishes the newest one it knows.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass, field, fields, replace
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from swarm.compression import DEFAULT_BACKWARD_CODEC, DEFAULT_FORWARD_CODEC, CodecConfig
from swarm.flags import Flags, flag
from swarm.options import MODEL_GROUP, ModelFlags, peer_ids
from swarm.runtime.worker import OptimConfig

if TYPE_CHECKING:
    from swarm.peers.dht_config import DHTConfig
    from swarm.peers.manifest import RunDelegation, RunManifest

__all__ = [
    "RunFiles",
    "RunInitConfig",
    "add_arguments",
    "init_run",
    "latest_delegation",
    "manifest_of",
    "run",
    "run_flags",
    "weights_digest",
    "with_manifest",
]

C = TypeVar("C")

MANIFEST_FILE, OWNER_KEY_FILE = "run.json", "owner.key"
_LOCAL_MODEL_FLAGS = ("weights", "tokenizer")
"""ModelFlags that name local paths: not in the manifest (the weights' digest is), each volunteer gives its own."""
_DEFAULT_OPTIM = OptimConfig()


@dataclass(frozen=True)
class RunFiles:
    """What `init_run` wrote: the paths a run's owner, planner and trainer start from."""

    dir: Path
    manifest: RunManifest
    manifest_path: Path
    owner_key: Path
    planner_keys: tuple[Path, ...]
    """Keys of the planners `init_run` made (empty when it was given planner ids)."""
    trainer_keys: tuple[Path, ...]
    """Keys of the trainers `init_run` made (empty when it was given trainer ids)."""

    @property
    def run_id(self) -> str:
        return self.manifest.run_id


def weights_digest(path: str | os.PathLike) -> str:
    """ "sha256:HEX" over a checkpoint directory's files (names and bytes, in sorted order) or one file."""
    root = Path(path)
    files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
    h = hashlib.sha256()
    for p in files:
        h.update(str(p.relative_to(root) if root.is_dir() else p.name).encode() + b"\0")
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return "sha256:" + h.hexdigest()


def _model_flags(model: ModelFlags) -> dict[str, Any]:
    """`model`'s flags by flag name (`seq-len`), the local paths left out."""
    return {f.name.replace("_", "-"): getattr(model, f.name) for f in fields(model) if f.name not in _LOCAL_MODEL_FLAGS}


def init_run(
    out: str | os.PathLike,
    *,
    name: str = "run",
    model: ModelFlags | None = None,
    fw_codec: str = DEFAULT_FORWARD_CODEC,
    bw_codec: str = DEFAULT_BACKWARD_CODEC,
    lr: float = _DEFAULT_OPTIM.lr_peak,
    warmup_steps: int = _DEFAULT_OPTIM.warmup_steps,
    total_steps: int = _DEFAULT_OPTIM.total_steps,
    data: str = "",
    planners: tuple[str, ...] = (),
    trainers: tuple[str, ...] = (),
    n_planners: int = 1,
    n_trainers: int = 1,
) -> RunFiles:
    """Makes an owned run in `out`: the owner key (owner.key, 0600), `n_planners` planner keys (planner.key,
    planner2.key...) and `n_trainers` trainer keys (trainer.key, ...) unless `planners`/`trainers` name existing
    ids, and the signed manifest (run.json). The weights' digest is taken from `model.weights` when given.

    Raises:
        ValueError: a bad field (named), or `out` already holds a run (a run's owner key is never overwritten).
    """
    from swarm.peers.dht_config import load_or_create_key
    from swarm.peers.entries import peer_id_of
    from swarm.peers.manifest import RunManifest

    model = model if model is not None else ModelFlags()
    CodecConfig.parse(fw_codec), CodecConfig.parse(bw_codec)  # a bad label fails here, named
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if (out / OWNER_KEY_FILE).exists() or (out / MANIFEST_FILE).exists():
        raise ValueError(f"{out} already holds a run ({OWNER_KEY_FILE} or {MANIFEST_FILE}): choose another --out")
    owner = load_or_create_key(str(out / OWNER_KEY_FILE))

    def keys(role: str, n: int) -> tuple[tuple[Path, ...], tuple[str, ...]]:
        paths = tuple(out / f"{role}{i + 1 if i else ''}.key" for i in range(n))
        return paths, tuple(peer_id_of(load_or_create_key(str(p)).get_public_key().to_bytes()) for p in paths)

    planner_keys, made_planners = keys("planner", 0 if planners else n_planners)
    trainer_keys, made_trainers = keys("trainer", 0 if trainers else n_trainers)
    manifest = RunManifest.create(
        owner, name=name, created_at=time.time(), model=_model_flags(model),
        weights_digest=weights_digest(model.weights) if model.weights else None, data=data,
        codecs={"fw_codec": fw_codec, "bw_codec": bw_codec}, lr=lr, warmup_steps=warmup_steps,
        total_steps=total_steps, planners=planners or made_planners, trainers=trainers or made_trainers,
    )  # fmt: skip
    path = out / MANIFEST_FILE
    _write(path, manifest.to_json())
    return RunFiles(out, manifest, path, out / OWNER_KEY_FILE, planner_keys, trainer_keys)


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


# ---- a peer's or trainer's settings from the manifest ----------------------------------------------------------


def run_flags(manifest: RunManifest) -> dict[str, Any]:
    """The flags (names without dashes, parsed values) the manifest sets: the model's, the codecs', the schedule's."""
    codecs = manifest.codec_labels
    return {
        **manifest.model_flags, "fw-codec": codecs["fw_codec"], "bw-codec": codecs["bw_codec"], "lr": manifest.lr,
        "warmup-steps": manifest.warmup_steps, "total-steps": manifest.total_steps,
    }  # fmt: skip


def with_manifest(flags: Flags[C], args: argparse.Namespace, manifest: RunManifest) -> C:
    """The config of `args` with every setting `manifest` fixes that this command has a flag for.

    Raises:
        ValueError: a flag given (on the command line or in --config) contradicts the manifest; or --weights
            names a checkpoint whose digest is not the manifest's. The message names the flag and both values.
    """
    given = flags.given(args)
    fixed = {k: v for k, v in run_flags(manifest).items() if f"--{k}" in flags.by_name}
    for key, value in fixed.items():
        if key in given and given[key] != value:
            raise ValueError(
                f"--{key} {given[key]!r} contradicts run {manifest.run_id}'s manifest, which sets {value!r}: drop "
                "the flag (an owned run's model, codecs and schedule come from its manifest)"
            )
    weights = given.get("weights")
    if weights and manifest.weights_digest is not None and weights_digest(weights) != manifest.weights_digest:
        raise ValueError(f"--weights {weights}: its digest is not run {manifest.run_id}'s {manifest.weights_digest}")
    return flags.build({**given, **fixed})


def manifest_of(dht: DHTConfig) -> RunManifest | None:
    """The verified manifest of the run `dht.run` names: its file, or fetched by id from the DHT through a
    short-lived client node joined as `dht` says; None without `--run`.

    Raises:
        ValueError: the file is unreadable or its manifest does not verify, or no valid manifest of that id was
            found in the DHT in time (named).
    """
    if dht.run is None:
        return None
    manifest = dht.run_manifest()
    if manifest is not None:
        return manifest
    from swarm.peers.dht import SwarmDHT

    probe = replace(dht, client_mode=True, signing_key_path=None, identity_path=None, port=0, announce_host=None)
    try:
        with SwarmDHT(probe) as node:
            return node.manifest
    except (RuntimeError, TimeoutError) as e:
        raise ValueError(f"--run {dht.run}: {e}") from None


def latest_delegation(manifest_path: Path, manifest: RunManifest) -> RunDelegation | None:
    """The highest-sequence valid delegation of `manifest` among the delegation-N.json files beside it."""
    from swarm.peers.manifest import RunDelegation

    newest = None
    for path in sorted(manifest_path.parent.glob("delegation-*.json")):
        try:
            d = RunDelegation.from_json(path.read_bytes()).check_for(manifest)
        except (OSError, ValueError) as e:
            print(f"warning: {path}: {e}", file=sys.stderr)
            continue
        if newest is None or d.sequence > newest.sequence:
            newest = d
    return newest


# ---- the commands -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunInitConfig:
    """What `swarm run init` makes: its fields are its flags."""

    out: str = field(default="run", metadata=flag(metavar="DIR"))
    """directory to write the owner key, the manifest (run.json) and the delegated planner and trainer keys into"""
    name: str = "run"
    """a human name for the run (1-64 characters [A-Za-z0-9 ._-])"""
    data: str = ""
    """what the run trains on, in words (at most 1024 characters)"""
    planner: tuple[str, ...] = field(default=(), metadata=flag(parse=peer_ids, nargs=None, metavar="ID[,ID...]"))
    """delegate these existing peer ids (`--identity` keys' ids) to plan (none: make planner.key and delegate it)"""
    trainer: tuple[str, ...] = field(default=(), metadata=flag(parse=peer_ids, nargs=None, metavar="ID[,ID...]"))
    """delegate these existing peer ids as the run's trainers (none: make trainer.key and delegate it)"""
    planners: int = 1
    """planner keys to make when --planner is not given (failover among them is automatic)"""
    model: ModelFlags = field(default_factory=ModelFlags, metadata=flag(group=MODEL_GROUP))
    """The run's model (its --weights checkpoint is recorded by digest)."""
    fw_codec: str = DEFAULT_FORWARD_CODEC
    """activation codec of the run's links"""
    bw_codec: str = DEFAULT_BACKWARD_CODEC
    """gradient codec of the run's links"""
    lr: float = _DEFAULT_OPTIM.lr_peak
    """peak learning rate"""
    warmup_steps: int = _DEFAULT_OPTIM.warmup_steps
    """steps of linear learning-rate warm-up"""
    total_steps: int = _DEFAULT_OPTIM.total_steps
    """the run's length in optimizer steps: the stages' cosine decay ends there, and the run's trainer trains this
    many unless told fewer (`swarm train --steps/--epochs`)"""

    def __post_init__(self) -> None:
        if not 1 <= self.planners <= 16:
            raise ValueError(f"RunInitConfig.planners: expected 1 to 16, got {self.planners}")


@dataclass(frozen=True)
class RunChangeConfig:
    """What `swarm run delegate` and `swarm run revoke` are told besides the manifest file."""

    planner: tuple[str, ...] = field(default=(), metadata=flag(parse=peer_ids, nargs=None, metavar="ID[,ID...]"))
    """delegate: add these peer ids to the run's planners"""
    trainer: tuple[str, ...] = field(default=(), metadata=flag(parse=peer_ids, nargs=None, metavar="ID[,ID...]"))
    """delegate: add these peer ids to the run's trainers"""
    owner_key: str | None = field(default=None, metadata=flag(metavar="FILE"))
    """the owner's key (none: owner.key beside the manifest)"""
    initial_peers: tuple[str, ...] = field(default=(), metadata=flag(metavar="MADDR"))
    """publish the delegation into the run's DHT through these multiaddrs (none: only write the file)"""


@dataclass(frozen=True)
class RunShowConfig:
    """What `swarm run show` is told besides the run."""

    initial_peers: tuple[str, ...] = field(default=(), metadata=flag(metavar="MADDR"))
    """fetch the manifest (given a run id) and the newest delegation from the DHT through these multiaddrs"""
    json: bool = False
    """print one JSON object: the manifest, the newest delegation and who may plan and train now"""


@cache
def _flags(cls: type) -> Flags:
    return Flags(cls)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="run_command", metavar="{init,show,delegate,revoke}", required=True)
    init = sub.add_parser("init", help="make an owned run: owner key, manifest, a planner and a trainer key")
    _flags(RunInitConfig).add_to(init)
    show = sub.add_parser("show", help="verify a run's manifest (a file, or an id fetched from the DHT) and print it")
    show.add_argument("run", metavar="ID|FILE", help="the run's id or its manifest file")
    _flags(RunShowConfig).add_to(show)
    delegate = sub.add_parser("delegate", help="write (and publish) the owner's next delegation, adding delegates")
    delegate.add_argument("manifest", metavar="FILE", help="the run's manifest (run.json)")
    _flags(RunChangeConfig).add_to(delegate)
    revoke = sub.add_parser("revoke", help="write (and publish) the owner's next delegation, revoking an id for good")
    revoke.add_argument("manifest", metavar="FILE", help="the run's manifest (run.json)")
    revoke.add_argument("revoked", metavar="ID", type=lambda t: peer_ids(t)[0], help="the peer id to revoke")
    _flags(RunChangeConfig).add_to(revoke)


def run(args: argparse.Namespace) -> int:
    commands = {"init": _init, "show": _show, "delegate": _change, "revoke": _change}
    try:
        return commands[args.run_command](args)
    except (ValueError, RuntimeError, TimeoutError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _init(args: argparse.Namespace) -> int:
    cfg = _flags(RunInitConfig).from_args(args)
    files = init_run(
        cfg.out, name=cfg.name, model=cfg.model, fw_codec=cfg.fw_codec, bw_codec=cfg.bw_codec, lr=cfg.lr,
        warmup_steps=cfg.warmup_steps, total_steps=cfg.total_steps, data=cfg.data, planners=cfg.planner,
        trainers=cfg.trainer, n_planners=cfg.planners,
    )  # fmt: skip
    rid = files.run_id
    planner_key = files.planner_keys[0] if files.planner_keys else "PLANNER.key"
    trainer_key = files.trainer_keys[0] if files.trainer_keys else "TRAINER.key"
    print(f"run {rid} ({cfg.name}): manifest {files.manifest_path}, owner key {files.owner_key} (keep it private)")
    print(f"planners {', '.join(files.manifest.planners)}; trainers {', '.join(files.manifest.trainers)}")
    print("\nstart the run (MADDR: a multiaddr `swarm bootstrap` prints):")
    print("  swarm bootstrap --port 31337")
    print(f"  swarm-peer --run {files.manifest_path} --identity {planner_key} --initial-peers MADDR   # the planner")
    print(f"  swarm-peer --run {rid} --initial-peers MADDR   # each volunteer")
    print(f"  swarm train --run {rid} --identity {trainer_key} --initial-peers MADDR   # the trainer")
    print(f"\nchange the delegates: swarm run delegate {files.manifest_path} --planner ID --initial-peers MADDR")
    print(f"                      swarm run revoke {files.manifest_path} ID --initial-peers MADDR")
    return 0


def _show(args: argparse.Namespace) -> int:
    from swarm.peers.dht import SwarmDHT
    from swarm.peers.dht_config import DHTConfig
    from swarm.peers.manifest import RUN_ID_RE, RunAuthority, RunManifest

    cfg = _flags(RunShowConfig).from_args(args)
    manifest, newest, authority = None, None, None
    if not RUN_ID_RE.fullmatch(args.run):
        manifest = RunManifest.load(args.run)
        newest = latest_delegation(Path(args.run), manifest)
    elif not cfg.initial_peers:
        raise ValueError(f"run {args.run}: give --initial-peers to fetch its manifest from the DHT (or its file)")
    if cfg.initial_peers:
        dht_cfg = DHTConfig(initial_peers=cfg.initial_peers, client_mode=True, run=args.run)
        with SwarmDHT(dht_cfg) as dht:
            manifest, authority = dht.manifest, dht.authority(max_age_s=0.0)
            if newest is None or (dht.delegation is not None and dht.delegation.sequence > newest.sequence):
                newest = dht.delegation
    authority = RunAuthority.of(manifest, [newest] if newest else []) if authority is None else authority
    if cfg.json:
        now = {"planners": sorted(authority.planners), "trainers": sorted(authority.trainers),
               "revoked": sorted(authority.revoked), "sequence": authority.sequence}  # fmt: skip
        wire = {"manifest": manifest.to_wire(), "delegation": newest.to_wire() if newest else None, "authority": now}
        print(json.dumps(wire, sort_keys=True))
        return 0
    print(f"run {manifest.run_id} ({manifest.name}): verified, signed by owner {manifest.owner_id}")
    print(f"  created   {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(manifest.created_at))} UTC")
    print(f"  model     {' '.join(f'--{k} {v}' for k, v in manifest.model)}")
    if manifest.weights_digest:
        print(f"  weights   {manifest.weights_digest}")
    print(f"  data      {manifest.data or '-'}")
    print(f"  codecs    --fw-codec {manifest.codec_labels['fw_codec']} --bw-codec {manifest.codec_labels['bw_codec']}")
    print(f"  schedule  --lr {manifest.lr} --warmup-steps {manifest.warmup_steps} --total-steps {manifest.total_steps}")
    print(f"  delegation {authority.sequence} ({'the manifest' if not authority.sequence else 'the newest seen'}):")
    print(f"    planners {', '.join(sorted(authority.planners)) or '(none)'}")
    print(f"    trainers {', '.join(sorted(authority.trainers)) or '(none)'}")
    print(f"    revoked  {', '.join(sorted(authority.revoked)) or '(none)'}")
    return 0


def _change(args: argparse.Namespace) -> int:
    from swarm.peers.dht import SwarmDHT
    from swarm.peers.dht_config import DHTConfig

    cfg = _flags(RunChangeConfig).from_args(args)
    if not cfg.initial_peers:
        _next_delegation(args, cfg, None)
        return 0
    dht_cfg = DHTConfig(initial_peers=cfg.initial_peers, client_mode=True, run=args.manifest)
    with SwarmDHT(dht_cfg) as dht:  # the run's newest delegation may be newer than this directory's
        delegation = _next_delegation(args, cfg, dht.delegation)
        if not dht.publish_delegation(delegation):
            raise RuntimeError("no DHT node accepted the delegation")
    print("  published: every member of the run re-publishes it from now on")
    return 0


def _next_delegation(args: argparse.Namespace, cfg: RunChangeConfig, seen: RunDelegation | None) -> RunDelegation:
    """The owner's next delegation after the newest of this directory's and `seen` (the DHT's), written beside
    the manifest: `delegate` adds ids, `revoke` removes one for good (and keeps every earlier revocation)."""
    from swarm.peers.dht_config import load_or_create_key
    from swarm.peers.manifest import RunAuthority, RunDelegation, RunManifest

    path = Path(args.manifest)
    manifest = RunManifest.load(str(path))
    key_path = cfg.owner_key or str(path.parent / OWNER_KEY_FILE)
    if not os.path.exists(key_path):
        raise ValueError(f"owner key {key_path}: not found (give --owner-key)")
    owner = load_or_create_key(key_path)
    known = [d for d in (latest_delegation(path, manifest), seen) if d is not None]
    now = RunAuthority.of(manifest, known, revoked=[r for d in known for r in d.revoked])
    planners, trainers, revoked = set(now.planners), set(now.trainers), set(now.revoked)
    if args.run_command == "revoke":
        if cfg.planner or cfg.trainer:
            raise ValueError("swarm run revoke takes one ID, not --planner/--trainer")
        planners.discard(args.revoked)
        trainers.discard(args.revoked)
        revoked.add(args.revoked)
    else:
        if not cfg.planner and not cfg.trainer:
            raise ValueError("swarm run delegate: give --planner ID or --trainer ID")
        for pid in (*cfg.planner, *cfg.trainer):
            if pid in revoked:
                raise ValueError(f"{pid} was revoked: a revoked id is never accepted again")
        planners.update(cfg.planner)
        trainers.update(cfg.trainer)
    sequence = now.sequence + 1
    delegation = RunDelegation.create(
        owner, manifest, sequence, planners=planners, trainers=trainers, revoked=revoked, created_at=time.time()
    )
    out = path.parent / f"delegation-{sequence}.json"
    _write(out, delegation.to_json())
    print(f"run {manifest.run_id}: delegation {sequence} written to {out}")
    print(f"  planners {', '.join(delegation.planners) or '(none)'}")
    print(f"  trainers {', '.join(delegation.trainers) or '(none)'}")
    print(f"  revoked  {', '.join(delegation.revoked) or '(none)'}")
    return delegation
