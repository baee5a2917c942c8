"""Local Hugging Face checkpoints: each stage reads only its own tensors; tests and tools write whole ones.

A checkpoint is a directory with `model.safetensors`, or shards listed by `model.safetensors.index.json`'s
`weight_map`. A stage looks its parameters up by their unsplit names (with or without the family's base
prefix, as `GPT2Model`/`LlamaModel` save them; a tied head from the embedding) and opens only the shards that
hold them, reading tensors one by one with `safetensors.safe_open`: no peer ever loads the whole model.
"""

from __future__ import annotations

import json
import shutil
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from swarm.model.hf_stage import HEAD, embedding_name

if TYPE_CHECKING:
    from swarm.model.hf import HFModelConfig

__all__ = ["checkpoint_files", "load_stage_weights", "unsplit_model", "save_checkpoint"]

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_MAX_INDEX_BYTES = 64 << 20


def _shard(directory: Path, file: object, where: str) -> Path:
    # Shard names are plain file names inside the checkpoint directory, never paths out of it.
    if not isinstance(file, str) or not file or Path(file).name != file or file in (".", ".."):
        raise ValueError(f"{where}: bad shard file name {file!r}")
    path = directory / file
    if not path.is_file():
        raise ValueError(f"{where}: shard {file} is missing")
    return path


def checkpoint_files(directory: Path) -> dict[str, Path]:
    """Tensor name -> the file holding it, from the index (or the single file's header).

    Raises:
        ValueError: no such directory, no safetensors checkpoint in it, or a malformed index.
    """
    if not directory.is_dir():
        raise ValueError(f"weights directory {directory} does not exist")
    index = directory / INDEX
    if index.is_file():
        if index.stat().st_size > _MAX_INDEX_BYTES:
            raise ValueError(f"{index}: index larger than {_MAX_INDEX_BYTES} bytes")
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{index}: not a safetensors index with a weight_map ({exc})") from exc
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: weight_map is not an object")
        shards = {f: _shard(directory, f, str(index)) for f in set(weight_map.values())}
        return {str(name): shards[f] for name, f in weight_map.items()}
    single = directory / SINGLE
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as f:  # reads the header only
            return {name: single for name in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
    raise ValueError(f"{directory}: no {SINGLE} or {INDEX} (a local safetensors checkpoint is needed)")


def _candidates(cfg: HFModelConfig, name: str) -> list[str]:
    base = "transformer." if cfg.family == "gpt2" else "model."
    if name == HEAD and cfg.tied_embeddings:
        emb = embedding_name(cfg.family)
        return [emb, emb.removeprefix(base), HEAD]
    if name.startswith(base):
        return [name, name.removeprefix(base)]
    return [name]


@torch.no_grad()
def load_stage_weights(stage: nn.Module, cfg: HFModelConfig) -> None:
    """Copy the stage's parameters from `cfg.weights_dir`, opening only the shards that hold them.

    Raises:
        ValueError: a tensor the stage needs is missing, has the wrong shape, or is not finite (named).
    """
    from safetensors import safe_open

    assert cfg.weights_dir is not None
    files = checkpoint_files(Path(cfg.weights_dir))
    wanted: dict[Path, list[tuple[str, str, nn.Parameter]]] = defaultdict(list)
    for local, param in stage.named_parameters():
        tried = _candidates(cfg, local)
        key = next((k for k in tried if k in files), None)
        if key is None:
            raise ValueError(f"{cfg.weights_dir}: checkpoint has no tensor for {local} (tried {', '.join(tried)})")
        wanted[files[key]].append((local, key, param))
    for path, entries in sorted(wanted.items()):
        with safe_open(str(path), framework="pt") as f:
            for local, key, param in entries:
                tensor = f.get_tensor(key)
                if tuple(tensor.shape) != tuple(param.shape):
                    raise ValueError(
                        f"{path.name}: tensor {key} has shape {tuple(tensor.shape)}, {local} needs {tuple(param.shape)}"
                    )
                if not tensor.is_floating_point() or not torch.isfinite(tensor).all():
                    raise ValueError(f"{path.name}: tensor {key} is not finite floating point")
                param.copy_(tensor)


def unsplit_model(cfg: HFModelConfig) -> nn.Module:
    """The unsplit `transformers` model holding the weights the stages hold (init or checkpoint).

    For tests and for writing checkpoints: a peer never builds it.
    """
    from transformers import AutoModelForCausalLM

    from swarm.model.hf_stage import build_hf_stage

    model = AutoModelForCausalLM.from_config(cfg.hf_config(), attn_implementation="sdpa")
    full = build_hf_stage(cfg, 0, cfg.n_layers, True, True)
    missing, unexpected = model.load_state_dict(full.state_dict(), strict=False)
    allowed = {HEAD} if cfg.tied_embeddings else set()
    if set(missing) - allowed or unexpected:
        raise RuntimeError(f"stage names differ from the unsplit model's: missing {missing}, unexpected {unexpected}")
    return model.eval()


def save_checkpoint(
    cfg: HFModelConfig, out_dir: str | Path, *, max_shard_size: int | str = "2GB", tokenizer: str | None = None
) -> Path:
    """Write `cfg`'s model as a local Hugging Face checkpoint (config.json + safetensors, sharded by size).

    Args:
        cfg: the model; its weights are the init of `cfg.init_seed` or `cfg.weights_dir`'s.
        out_dir: directory to write (created).
        max_shard_size: `save_pretrained`'s shard limit ("2GB", or bytes); small values make many shards.
        tokenizer: a tokenizer.json to copy beside it (default `cfg.tokenizer_path`, if any).

    Returns:
        The directory, which `hf_model_config(out_dir)` reads back.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    unsplit_model(cfg).save_pretrained(out, max_shard_size=max_shard_size, safe_serialization=True)
    tokenizer = tokenizer or cfg.tokenizer_path
    if tokenizer is not None:
        shutil.copyfile(tokenizer, out / "tokenizer.json")
    return out
