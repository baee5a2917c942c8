"""safetensors checkpoints of one stage, written atomically so a crash or a full disk never corrupts one."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

log = logging.getLogger("swarm.runtime.checkpoint")


def checkpoint_path(directory: str | os.PathLike, stage: int) -> Path:
    return Path(directory) / f"stage{stage}.safetensors"


def save_stage(path: Path, state: dict[str, torch.Tensor], metadata: dict[str, str]) -> bool:
    """Writes `state` to `path` via a temporary file and an atomic rename; returns False (and keeps the
    previous checkpoint) when the disk refuses, e.g. because it is full."""
    tmp = path.with_suffix(".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp), metadata=metadata)
        os.replace(tmp, path)
        return True
    except OSError as e:
        log.error("checkpoint %s not written (%s); the previous one is kept", path, e)
        tmp.unlink(missing_ok=True)
        return False


def load_stage(path: Path, expected: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Loads a checkpoint and checks it holds exactly the expected tensors with the expected shapes."""
    state = load_file(str(path))
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
