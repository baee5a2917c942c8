"""safetensors checkpoints of one stage, written atomically so a crash or a full disk never corrupts one.

A stage's checkpoint is complete: its weights (`model.<name>`), its optimizer's moments and step per
parameter (`optim.<name>.<key>`), and in the metadata the layer range, the stage's applied steps, the
learning-rate schedule's position and the plan it served. It is named by what it holds (the layer range), and
loading checks the range and every tensor's shape: a file that does not match is reported and skipped
(`resume`), never fatal. A stage whose exact range has no file (a restart under another split) finds its
layers one by one across every checkpoint in the directory, the newest step winning per layer
(`gather_layers`), and says which layers no file holds.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

if TYPE_CHECKING:
    from swarm.runtime.worker import StageWorker

log = logging.getLogger("swarm.runtime.checkpoint")


FORMAT = "swarm-stage/1"
OPTIM_KEYS = ("step", "exp_avg", "exp_avg_sq")
AMP_KEYS = ("amp.scale", "amp.good_steps")
"""fp16's loss scaler (swarm.runtime.precision.LossScaler.state_tensors), saved by fp16 stages only"""
"""What AdamW keeps per parameter."""


def checkpoint_path(directory: str | os.PathLike, layer_start: int, layer_end: int) -> Path:
    """The checkpoint of the stage holding layers [layer_start, layer_end) (its range says whether it also
    holds the embedding, layer 0, or the head, the last layer)."""
    return Path(directory) / f"layers-{layer_start:04d}-{layer_end:04d}.safetensors"


def save_stage(path: Path, state: dict[str, torch.Tensor], metadata: dict[str, str]) -> bool:
    """Writes `state` to `path` via a temporary file and an atomic rename; returns False (and keeps the
    previous checkpoint, and no partial file) when the disk refuses, e.g. because it is full: safetensors
    reports a failed write as SafetensorError, not OSError, and both are a refused checkpoint, not a failed
    stage."""
    tmp = path.with_suffix(".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp), metadata=metadata)
        _fsync(tmp)  # the bytes are on disk before the name points at them
        os.replace(tmp, path)
        _fsync(path.parent)  # and the rename itself survives a power cut
        return True
    except (OSError, SafetensorError) as e:
        log.error("checkpoint %s not written: %s (%s); the previous one is kept", path, e, describe_disk(path))
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        return False


def describe_disk(path: str | os.PathLike) -> str:
    """The file system that holds (or would hold) `path`, for an error about a write there: its mount point and
    free space."""
    at = Path(os.path.abspath(path))
    while not at.exists() and at != at.parent:
        at = at.parent
    mount = at
    while not os.path.ismount(mount) and mount != mount.parent:
        mount = mount.parent
    try:
        usage = shutil.disk_usage(at)
    except OSError:
        return f"the disk mounted at {mount}"
    return f"the disk mounted at {mount}: {usage.free / 2**20:.1f} MiB free of {usage.total / 2**20:.1f} MiB"


def load_stage(
    path: Path, expected: dict[str, torch.Tensor], state: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """Loads a checkpoint (or checks `state`, already loaded from it) and checks it holds exactly the expected
    tensors with the expected shapes."""
    state = load_file(str(path)) if state is None else state
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    if missing or extra:
        raise ValueError(f"checkpoint {path} does not match this stage: missing {missing}, unexpected {extra}")
    for name, tensor in expected.items():
        if state[name].shape != tensor.shape:
            raise ValueError(
                f"checkpoint {path}: {name} has shape {list(state[name].shape)}, expected {list(tensor.shape)}"
            )
    return state


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def worker_tensors(worker: StageWorker) -> dict[str, torch.Tensor]:
    """Everything a stage's training state is made of, as named tensors: weights and optimizer moments."""
    tensors = {f"model.{k}": v.detach().clone() for k, v in worker.module.state_dict().items()}
    for name, param in worker.module.named_parameters():
        for key, value in worker.optimizer.state.get(param, {}).items():
            if key in OPTIM_KEYS:
                # every tensor has a dimension (the step too): the wire's fp32 codec sends no 0-d tensors
                value = torch.as_tensor(value).detach().clone().float()
                tensors[f"optim.{name}.{key}"] = value.reshape(1) if key == "step" else value
    if worker.scaler is not None:  # fp16: the loss scale continues where it was (swarm.runtime.precision)
        tensors.update(worker.scaler.state_tensors())
    return tensors


def save_worker(
    directory: str | os.PathLike,
    worker: StageWorker,
    layer_start: int,
    layer_end: int,
    steps_done: int,
    plan_version: int = 0,
    model: str | None = None,
) -> Path | None:
    """Writes the stage's complete checkpoint (see the module's docstring); its path, or None when the disk
    refused (the previous checkpoint is kept). `model` (`swarm.model.export.model_to_json`) lets `swarm export`
    rebuild the model from the checkpoints alone."""
    path = checkpoint_path(directory, layer_start, layer_end)
    metadata = {
        "format": FORMAT,
        "layer_start": str(layer_start),
        "layer_end": str(layer_end),
        "steps_done": str(steps_done),
        "lr_step": str(worker.step_count),
        "plan_version": str(plan_version),
        "saved_at": f"{time.time():.3f}",
    }
    if model is not None:
        metadata["model"] = model
    return path if save_stage(path, worker_tensors(worker), metadata) else None


def load_worker(path: Path, worker: StageWorker, layer_start: int, layer_end: int) -> dict[str, str]:
    """Restores weights, optimizer moments and the schedule's position from `path` into `worker`; returns the
    checkpoint's metadata. Raises ValueError naming what does not match (format, layer range, a tensor)
    before anything is changed."""
    metadata = _metadata(path)
    held = (metadata.get("layer_start"), metadata.get("layer_end"))
    if held != (str(layer_start), str(layer_end)):
        raise ValueError(f"checkpoint {path} holds layers [{held[0]}, {held[1]}), not [{layer_start}, {layer_end})")
    params = dict(worker.module.named_parameters())
    expected = {f"model.{k}": v for k, v in worker.module.state_dict().items()}
    for name, param in params.items():
        expected.update({f"optim.{name}.{k}": torch.empty(param.shape if k != "step" else (1,)) for k in OPTIM_KEYS})
    state = load_file(str(path))
    optim_names = [k for k in state if k.startswith("optim.")]
    if optim_names and set(optim_names) != {k for k in expected if k.startswith("optim.")}:
        raise ValueError(f"checkpoint {path}: optimizer state for other parameters than this stage's")
    expected.update({k: torch.empty(1) for k in state if k in AMP_KEYS})  # a scaler's state, if it was saved
    load_stage(path, {k: v for k, v in expected.items() if not k.startswith("optim.") or optim_names}, state)
    if worker.scaler is not None and AMP_KEYS[0] in state:
        worker.scaler.load_tensors(state)  # checked whole before the weights change below
    worker.module.load_state_dict({k[len("model.") :]: v for k, v in state.items() if k.startswith("model.")})
    worker.optimizer.state.clear()
    for name, param in params.items():
        if optim_names:
            worker.optimizer.state[param] = _moments(state, name, param)
    worker.step_count = int(metadata.get("lr_step", 0))
    return metadata


def resume(
    directory: str | os.PathLike, worker: StageWorker, layer_start: int, layer_end: int
) -> dict[str, str] | None:
    """Loads the stage's state from `directory`: its own range's checkpoint when there is one that fits (exact,
    with its moments and scaler), else its layers found one by one across every checkpoint there
    (`gather_layers`, newest step per layer; layers no file holds are named in one error line and keep their
    initial weights). Returns the metadata (`steps_done`, `lr_step`, `plan_version`; `sources` and `missing`
    when found by layer), or None when nothing was loaded. A mismatching or unreadable file is reported and
    skipped, never fatal."""
    path = checkpoint_path(directory, layer_start, layer_end)
    if path.exists():
        try:
            return load_worker(path, worker, layer_start, layer_end)
        except Exception as e:  # a foreign, truncated or corrupt file: look further rather than die
            log.error("checkpoint %s skipped: %s", path, e)
    return resume_by_layer(directory, worker, layer_start, layer_end, skip=path)


def resume_by_layer(
    directory: str | os.PathLike, worker: StageWorker, layer_start: int, layer_end: int, skip: Path | None = None
) -> dict[str, str] | None:
    """The layers of `worker`'s stage gathered from every checkpoint in `directory` (`gather_layers`) and loaded
    with `take_over`; None (nothing changed) when no checkpoint holds any of them."""
    from swarm.model.export import tied_pair

    files = [f for f in scan_checkpoints(directory) if skip is None or f.path != skip]
    if not files:
        return None
    expected = {k: v.shape for k, v in worker.module.state_dict().items()}
    pair = tied_pair(worker.module)
    found = gather_layers(files, expected, aliases=dict([pair]) if pair else {})
    where = f"layers [{layer_start}, {layer_end})"
    if not found.sources:
        log.error("%s: none of %s is in the %d checkpoints in %s", where, found.missing_text(), len(files), directory)
        return None
    if found.missing:
        log.error(
            "%s resumed without %s: no checkpoint in %s holds them; they start from the initial weights",
            where,
            found.missing_text(),
            directory,
        )
    take_over(worker, found.tensors)
    mixed = len({f.steps_done for f in found.sources.values()}) > 1  # the older layers lack the newer steps
    log.log(logging.WARNING if mixed else logging.INFO, "%s found by layer: %s", where, found.sources_text())
    return {
        "steps_done": str(found.steps_done),
        "lr_step": str(found.lr_step),
        "plan_version": str(found.plan_version),
        "sources": found.sources_text(),
        "missing": found.missing_text() if found.missing else "",
    }


_LAYER_INDEX = re.compile(r"(?:^|\.)(?:blocks|h|layers)\.(\d+)\.")
"""A block's index in its weights' names: the built-in `blocks.3.`, GPT-2's `transformer.h.3.`, Llama's
`model.layers.3.`."""


def layer_unit(name: str) -> str:
    """What a weight is found by: its block ("layer 3") for a block's weights, else its own name (the
    embeddings, the final norm, the head), so a block's tensors always come from one file together."""
    m = _LAYER_INDEX.search(name)
    return f"layer {int(m[1])}" if m else name


@dataclass(frozen=True)
class CheckpointFile:
    """One stage checkpoint in a directory, as its header says (no tensor is read)."""

    path: Path
    steps_done: int
    saved_at: float
    lr_step: int
    plan_version: int
    shapes: dict[str, tuple[int, ...]]
    """every tensor's name (`model.*`, `optim.*`, `amp.*`) and shape"""
    model: str | None = None
    """the model it belongs to (`swarm.model.export.model_to_json`), if the writer recorded it"""

    @property
    def rank(self) -> tuple[int, float]:
        """Newer first: more steps applied, then written later."""
        return (self.steps_done, self.saved_at)


def scan_checkpoints(directory: str | os.PathLike) -> list[CheckpointFile]:
    """Every stage checkpoint (`layers-*.safetensors`) directly in `directory`, by header; a file that is not one
    or cannot be read is logged and left out. An absent directory has none."""
    from safetensors import safe_open

    found = []
    for path in sorted(Path(directory).glob("layers-*.safetensors")) if Path(directory).is_dir() else ():
        try:
            metadata = _metadata(path)
            with safe_open(str(path), "pt") as f:
                shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
            found.append(
                CheckpointFile(
                    path,
                    int(metadata.get("steps_done", 0)),
                    float(metadata.get("saved_at", 0.0)),
                    int(metadata.get("lr_step", 0)),
                    int(metadata.get("plan_version", 0)),
                    shapes,
                    metadata.get("model"),
                )
            )
        except Exception as e:  # a foreign, truncated or corrupt file: the others may still hold the layers
            log.error("checkpoint %s skipped: %s", path, e)
    return found


@dataclass
class Gathered:
    """What `gather_layers` found: handover tensors (`take_over`'s input) and where each unit came from."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    sources: dict[str, CheckpointFile] = field(default_factory=dict)
    """unit (`layer_unit`) -> the file it was read from"""
    missing: list[str] = field(default_factory=list)
    """units no file holds (whole, with the expected shapes)"""

    @property
    def steps_done(self) -> int:
        return max((f.steps_done for f in self.sources.values()), default=0)

    @property
    def lr_step(self) -> int:
        return max((f.lr_step for f in self.sources.values()), default=0)

    @property
    def plan_version(self) -> int:
        return max((f.plan_version for f in self.sources.values()), default=0)

    def missing_text(self) -> str:
        return _units_text(self.missing)

    def sources_text(self) -> str:
        by_file: dict[Path, list[str]] = {}
        for unit, f in self.sources.items():
            by_file.setdefault(f.path, []).append(unit)
        steps = {f.path: f.steps_done for f in self.sources.values()}
        return "; ".join(f"{_units_text(u)} from {p.name} (step {steps[p]})" for p, u in sorted(by_file.items()))


def _units_text(units: list[str]) -> str:
    """'layers 2, 3, norm.weight and tok_emb.weight': blocks by index, the other weights by name."""
    layers = sorted(int(u.split()[1]) for u in units if u.startswith("layer "))
    parts = [f"layer{'s' if len(layers) > 1 else ''} {layers[0]}"] + [str(i) for i in layers[1:]] if layers else []
    parts += sorted(u for u in units if not u.startswith("layer "))
    return ", ".join(parts[:-1]) + f" and {parts[-1]}" if len(parts) > 1 else (parts[0] if parts else "nothing")


def gather_layers(
    files: list[CheckpointFile],
    expected: dict[str, torch.Size | tuple[int, ...]],
    aliases: dict[str, str] | None = None,
    weights_only: bool = False,
) -> Gathered:
    """The weights `expected` names (unprefixed name -> shape), found unit by unit (`layer_unit`) in `files`: for
    each unit the newest file (`CheckpointFile.rank`) holding all of its weights with those shapes, its AdamW
    moments with them when that file has them (unless `weights_only`), and the newest loss scaler among the
    files used. `aliases` maps a weight to another name that holds the same values (the last stage's copy of a
    tied embedding and the embedding itself), tried after the name itself.

    Returns handover tensors (`model.*`, `optim.*`, `amp.*`, `meta.*`) and what came from where; what no file
    holds is listed in `missing`, never guessed."""
    from safetensors import safe_open

    aliases = aliases or {}
    units: dict[str, list[str]] = {}
    for name in expected:
        units.setdefault(layer_unit(name), []).append(name)
    found = Gathered()
    reads: dict[Path, list[tuple[str, str]]] = {}  # file -> (name wanted, name in the file)
    for unit, names in units.items():
        best: tuple[tuple[int, float, int], CheckpointFile, dict[str, str]] | None = None
        for f in files:
            mapping = {}
            for name in names:
                held = [
                    n for n in (name, aliases.get(name)) if n and f.shapes.get(f"model.{n}") == tuple(expected[name])
                ]
                if not held:
                    break
                mapping[name] = held[0]
            else:
                rank = (*f.rank, sum(a == b for a, b in mapping.items()))  # equal steps: its own names first
                if best is None or rank > best[0]:
                    best = (rank, f, mapping)
        if best is None:
            found.missing.append(unit)
            continue
        found.sources[unit] = best[1]
        reads.setdefault(best[1].path, []).extend(best[2].items())
    for path, pairs in reads.items():
        f = next(c for c in found.sources.values() if c.path == path)
        with safe_open(str(path), "pt") as opened:
            for name, held in pairs:
                found.tensors[f"model.{name}"] = opened.get_tensor(f"model.{held}")
                moments = [f"optim.{held}.{k}" for k in OPTIM_KEYS]
                if not weights_only and all(m in f.shapes for m in moments):
                    for k, m in zip(OPTIM_KEYS, moments, strict=True):
                        found.tensors[f"optim.{name}.{k}"] = opened.get_tensor(m)
    scalers = [f for f in {f.path: f for f in found.sources.values()}.values() if AMP_KEYS[0] in f.shapes]
    if scalers and not weights_only:
        newest = max(scalers, key=lambda f: f.rank)
        with safe_open(str(newest.path), "pt") as opened:
            found.tensors.update({k: opened.get_tensor(k) for k in AMP_KEYS if k in newest.shapes})
    if found.sources:
        _with_meta(found.tensors, found.lr_step, found.steps_done)
    return found


def handover_tensors(worker: StageWorker, steps_done: int) -> dict[str, torch.Tensor]:
    """What a stage hands to the peer taking its layers over: weights, optimizer moments, and (`meta.*`) the
    schedule's position and the applied steps, so neither the warm-up nor the moments start again."""
    return _with_meta(worker_tensors(worker), worker.step_count, steps_done)


def checkpoint_handover(directory: str | os.PathLike, layer_start: int, layer_end: int) -> dict[str, torch.Tensor]:
    """`handover_tensors` of the stage that held [layer_start, layer_end), read from its checkpoint in
    `directory` (the fallback when that peer is gone). Raises OSError/ValueError if there is none that fits."""
    path = checkpoint_path(directory, layer_start, layer_end)
    metadata = _metadata(path)
    return _with_meta(load_file(str(path)), metadata.get("lr_step", 0), metadata.get("steps_done", 0))


def _metadata(path: Path) -> dict[str, str]:
    """A stage checkpoint's metadata; ValueError if the file is not one (another format)."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        metadata = f.metadata() or {}
    if metadata.get("format") != FORMAT:
        raise ValueError(f"checkpoint {path}: format {metadata.get('format')!r}, expected {FORMAT!r}")
    return metadata


def _with_meta(tensors: dict[str, torch.Tensor], lr_step, steps_done) -> dict[str, torch.Tensor]:
    """`tensors` plus the schedule's position and the applied steps as `meta.*` one-element tensors."""
    tensors["meta.lr_step"] = torch.tensor([float(lr_step)])
    tensors["meta.steps_done"] = torch.tensor([float(steps_done)])
    return tensors


def take_over(worker: StageWorker, tensors: dict[str, torch.Tensor]) -> tuple[int, list[str], int]:
    """Loads what `tensors` (merged `handover_tensors` of the old holders) has of this stage's parameters:
    weights, their moments, and the schedule's position (the furthest one). Returns (tensors loaded, names of
    this stage's weights left at their initial values, steps done). A loss scaler's state (`amp.*`) is checked
    and taken first: a bad one raises before anything changed."""
    if worker.scaler is not None and AMP_KEYS[0] in tensors:
        worker.scaler.load_tensors(tensors)
    tensors = _tied_copy(worker, tensors)
    wanted = worker.module.state_dict()
    weights = {
        k[len("model.") :]: v
        for k, v in tensors.items()
        if k.startswith("model.") and k[len("model.") :] in wanted and v.shape == wanted[k[len("model.") :]].shape
    }
    if weights:
        worker.module.load_state_dict(weights, strict=False)
    for name, param in worker.module.named_parameters():
        keys = [f"optim.{name}.{k}" for k in OPTIM_KEYS]
        if name in weights and all(k in tensors for k in keys) and tensors[keys[1]].shape == param.shape:
            worker.optimizer.state[param] = _moments(tensors, name, param)
    if "meta.lr_step" in tensors:
        worker.step_count = max(worker.step_count, int(tensors["meta.lr_step"].max()))
    steps_done = int(tensors["meta.steps_done"].max()) if "meta.steps_done" in tensors else 0
    return len(weights), sorted(set(wanted) - set(weights)), steps_done


def _tied_copy(worker: StageWorker, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` with the last stage's copy of a tied embedding (and its moments) taken from the embedding when
    only that was handed over: a one-stage plan's stage holds no separate head, and a new last stage's head
    would otherwise restart from its initial weights."""
    from swarm.model.export import tied_pair

    pair = tied_pair(worker.module)
    if pair is None or f"model.{pair[0]}" in tensors or f"model.{pair[1]}" not in tensors:
        return tensors
    head, emb = pair
    copied = {f"model.{head}": tensors[f"model.{emb}"]}
    copied.update(
        {f"optim.{head}.{k}": tensors[f"optim.{emb}.{k}"] for k in OPTIM_KEYS if f"optim.{emb}.{k}" in tensors}
    )
    return {**tensors, **copied}


def _moments(tensors: dict[str, torch.Tensor], name: str, param: torch.Tensor) -> dict[str, torch.Tensor]:
    """AdamW's state of `param` from `optim.<name>.*` (its step back to the 0-d tensor AdamW keeps)."""
    state = {k: tensors[f"optim.{name}.{k}"].to(param.dtype) for k in OPTIM_KEYS}
    state["step"] = state["step"].reshape(())
    return state
