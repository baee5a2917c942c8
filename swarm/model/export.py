"""A trained swarm model as a Hugging Face directory that `transformers` loads: config.json, model.safetensors,
a tokenizer, and `swarm_export.json` (where the weights came from and which held-out windows measure them).

The built-in GPT maps exactly onto GPT-2 (`GPT2LMHeadModel`): both are pre-LN (`ln_1`/`ln_2` before attention
and MLP, a final `ln_f`), add learned position embeddings to the token embeddings, scale attention by
1/sqrt(head dim) with a causal mask, and use the exact (erf) GELU (`activation_function="gelu"`) with the same
LayerNorm eps. The differences are all representable: GPT-2's `Conv1D` stores [in, out] (the transpose of a
`Linear`), and GPT-2 has biases on its four projections where the built-in has none, so they are written as
zeros. The fused q|k|v projection splits into heads in the same order in both. The head is the token embedding
when the first and last stage hold equal copies of it; when the tied sum was compressed the two copies differ
slightly and the export keeps both (`tie_word_embeddings: false`, an `lm_head.weight`), so the exported model
computes exactly what the pipeline computed. Hugging Face families export to their own family under their own
names (a stage's names are the unsplit model's).

The byte-level vocabulary (token id = byte value) is written as a `tokenizers` byte-level BPE with no merges
whose 256 symbols are numbered by byte value, so `AutoTokenizer` encodes text to the same ids the swarm
trained on and decodes generated ids back to bytes.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from swarm.model.gpt import TIED_EMBEDDING, TIED_HEAD, ModelConfig, config_fields
from swarm.model.gpt import Stage as GPTStage

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

    from swarm.model.spec import AnyModelConfig

__all__ = [
    "EXPORT_FORMAT",
    "EXPORT_FILE",
    "model_to_json",
    "model_from_json",
    "tied_pair",
    "weight_shapes",
    "hf_config_of",
    "hf_model_of",
    "byte_tokenizer",
    "write_hf_dir",
    "read_export_info",
]

EXPORT_FORMAT = "swarm-export/1"
EXPORT_FILE = "swarm_export.json"
"""Beside config.json: the swarm model it was exported from, its provenance and its held-out windows."""


def model_to_json(cfg: AnyModelConfig) -> str:
    """The model config as JSON text (a stage checkpoint's `model` metadata; `model_from_json` reads it back)."""
    if isinstance(cfg, ModelConfig):
        return json.dumps({"family": "gpt", **config_fields(cfg)}, sort_keys=True)
    return json.dumps({"hf": asdict(cfg)}, sort_keys=True)


def model_from_json(text: str) -> AnyModelConfig:
    """The model config `model_to_json` wrote. Raises ValueError for anything else."""
    try:
        d = json.loads(text)
        if isinstance(d, dict) and d.get("family") == "gpt":
            return ModelConfig(**{k: v for k, v in d.items() if k != "family"})
        if isinstance(d, dict) and isinstance(d.get("hf"), dict):
            from swarm.model.hf import HFModelConfig

            return HFModelConfig(**d["hf"])
    except (TypeError, ValueError) as e:
        raise ValueError(f"not a swarm model config: {e}") from e
    raise ValueError("not a swarm model config (neither the built-in GPT nor a Hugging Face family)")


def tied_pair(module_or_cfg: nn.Module | AnyModelConfig) -> tuple[str, str] | None:
    """(the last stage's copy of a tied embedding, the embedding) by their names, of a stage module or a model
    config with tied embeddings; None when the head is not tied. The two hold the same values up to the tied
    sum's compression, so a checkpoint's one stands in for the other when a new split needs it."""
    if isinstance(module_or_cfg, GPTStage | ModelConfig):
        return TIED_HEAD, TIED_EMBEDDING
    from swarm.model.hf_stage import HEAD, embedding_name

    family, tied = getattr(module_or_cfg, "family", None), getattr(module_or_cfg, "tied", None)
    if tied is None:
        tied = bool(getattr(module_or_cfg, "tied_embeddings", False))
    return (HEAD, embedding_name(family)) if tied and family else None


def weight_shapes(cfg: AnyModelConfig) -> dict[str, torch.Size]:
    """Every weight of the unsplit model (a one-stage pipeline's names) and its shape, built on the meta device
    (nothing is allocated or initialised)."""
    from swarm.model.spec import build_stage

    with torch.device("meta"):
        stage = build_stage(cfg, 0, cfg.n_layers, True, True)
    return {k: v.shape for k, v in stage.state_dict().items()}


def _tied(weights: dict[str, torch.Tensor], pair: tuple[str, str] | None) -> bool:
    """Whether the head is the embedding: a tied model whose head copy (if any was kept) equals it."""
    if pair is None:
        return False
    head, emb = pair
    return head not in weights or torch.equal(weights[head], weights[emb])


def hf_config_of(cfg: AnyModelConfig, tied: bool = True) -> PretrainedConfig:
    """The `transformers` config of the exported model: GPT-2 for the built-in GPT (see the module docstring),
    the family's own for a Hugging Face model; `tied` False keeps a separate head."""
    from transformers import AutoConfig, GPT2Config

    if isinstance(cfg, ModelConfig):
        if cfg.subspace_dim:
            raise ValueError(
                f"a model whose stream is kept in a subspace (subspace_dim {cfg.subspace_dim}) is not a GPT-2: "
                "transformers has no architecture for it, so it cannot be exported (its stage checkpoints keep it)"
            )
        return GPT2Config(
            vocab_size=cfg.vocab_size, n_positions=cfg.seq_len_tokens, n_embd=cfg.hidden_dim, n_layer=cfg.n_layers,
            n_head=cfg.n_heads, n_inner=cfg.mlp_ratio * cfg.hidden_dim, activation_function="gelu",
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0,
            layer_norm_epsilon=cfg.norm_eps, initializer_range=cfg.init_std, scale_attn_weights=True,
            scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False, tie_word_embeddings=tied,
            bos_token_id=None, eos_token_id=None, use_cache=True,
        )  # fmt: skip
    d = json.loads(cfg.config_json)
    d.pop("model_type", None)
    d.update(use_cache=True, tie_word_embeddings=tied)
    return AutoConfig.for_model(cfg.family, **d)


def _gpt_to_gpt2(cfg: ModelConfig, w: dict[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    """The built-in GPT's weights under GPT2LMHeadModel's names: Linear [out, in] -> Conv1D [in, out], zero biases."""
    d, inner = cfg.hidden_dim, cfg.mlp_ratio * cfg.hidden_dim
    out = {"transformer.wte.weight": w[TIED_EMBEDDING], "transformer.wpe.weight": w["pos_emb.weight"]}
    for i in range(cfg.n_layers):
        b, h = f"blocks.{i}.", f"transformer.h.{i}."
        for ours, theirs in (("ln1", "ln_1"), ("ln2", "ln_2")):
            out[f"{h}{theirs}.weight"], out[f"{h}{theirs}.bias"] = w[f"{b}{ours}.weight"], w[f"{b}{ours}.bias"]
        for ours, theirs, width in (
            ("attn.qkv", "attn.c_attn", 3 * d),
            ("attn.proj", "attn.c_proj", d),
            ("mlp.fc", "mlp.c_fc", inner),
            ("mlp.proj", "mlp.c_proj", d),
        ):
            out[f"{h}{theirs}.weight"] = w[f"{b}{ours}.weight"].t().contiguous()
            out[f"{h}{theirs}.bias"] = torch.zeros(width, dtype=w[f"{b}{ours}.weight"].dtype)
    out["transformer.ln_f.weight"], out["transformer.ln_f.bias"] = w["norm.weight"], w["norm.bias"]
    if not tied:
        out["lm_head.weight"] = w[TIED_HEAD]
    return out


def hf_model_of(cfg: AnyModelConfig, weights: dict[str, torch.Tensor]) -> PreTrainedModel:
    """The unsplit `transformers` model holding `weights` (the unsplit model's names, as `weight_shapes` lists
    them, plus the last stage's head copy of a tied model if there was one), in eval mode.

    Raises:
        ValueError: a weight is missing, of another shape, or not finite (named).
    """
    from transformers import AutoModelForCausalLM

    expected = weight_shapes(cfg)
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise ValueError(f"no weights for {missing[:6]}{' ...' if len(missing) > 6 else ''} ({len(missing)} missing)")
    for name, shape in expected.items():
        if weights[name].shape != shape:
            raise ValueError(f"{name} has shape {list(weights[name].shape)}, the model's is {list(shape)}")
        if not torch.isfinite(weights[name]).all():
            raise ValueError(f"{name} is not finite")
    pair = tied_pair(cfg)
    tied = _tied(weights, pair)
    hf_cfg = hf_config_of(cfg, tied=tied)
    if isinstance(cfg, ModelConfig):
        state = _gpt_to_gpt2(cfg, weights, tied)
    else:
        state = {k: v for k, v in weights.items() if k in expected}
        if pair is not None and not tied:
            state[pair[0]] = weights[pair[0]]
    model = AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="sdpa", dtype=torch.float32)
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    allowed = {"lm_head.weight"} if tied else set()
    if set(missing) - allowed or unexpected:
        raise ValueError(f"weights do not fit {type(model).__name__}: missing {missing}, unexpected {unexpected}")
    if tied:
        model.tie_weights()
    return model.eval()


def byte_tokenizer(max_length: int | None = None):
    """A `tokenizers.Tokenizer` whose ids are byte values: byte-level pre-tokenizing (bytes as GPT-2's printable
    symbols, no regex split) over a BPE vocabulary of the 256 symbols numbered by the byte they stand for, and
    no merges, so every byte is one token and decoding gives the bytes back."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    symbols = pre_tokenizers.ByteLevel.alphabet()
    byte_of = _bytes_to_unicode()
    vocab = {byte_of[b]: b for b in range(256)}
    assert set(vocab) == set(symbols), "tokenizers' byte alphabet is GPT-2's"
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    if max_length is not None:
        tok.enable_truncation(max_length)
    return tok


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map of bytes to printable characters (the byte-level alphabet), by byte value."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, n = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def write_hf_dir(
    cfg: AnyModelConfig, weights: dict[str, torch.Tensor], out: str | Path, info: dict[str, Any] | None = None
) -> Path:
    """Writes `weights` (see `hf_model_of`) as a Hugging Face directory `out`: config.json, model.safetensors
    (sharded above 2 GB), the tokenizer (the model's tokenizer.json, or the byte-level vocabulary) with a
    tokenizer_config.json for `AutoTokenizer`, and `EXPORT_FILE` holding `info` (provenance, held-out windows)
    and the swarm model config. Returns `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model = hf_model_of(cfg, weights)
    model.save_pretrained(out, safe_serialization=True, max_shard_size="2GB")
    tokenizer_path = getattr(cfg, "tokenizer_path", None)
    if tokenizer_path is not None:
        shutil.copyfile(tokenizer_path, out / "tokenizer.json")
        kind = "tokenizer.json"
    else:
        byte_tokenizer().save(str(out / "tokenizer.json"))
        kind = "bytes"
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "model_max_length": cfg.seq_len_tokens,
                "clean_up_tokenization_spaces": False,
            },
            indent=1,
        )  # fmt: skip
    )
    record = {"format": EXPORT_FORMAT, "model": model_to_json(cfg), "family": model.config.model_type}
    record.update(tokenizer=kind, tied_embeddings=bool(model.config.tie_word_embeddings), **(info or {}))
    (out / EXPORT_FILE).write_text(json.dumps(record, indent=1, sort_keys=True))
    return out


def read_export_info(directory: str | Path) -> dict[str, Any]:
    """`EXPORT_FILE` of an exported directory ({} for a directory that `swarm export` did not write)."""
    path = Path(directory) / EXPORT_FILE
    if not path.is_file():
        return {}
    try:
        info = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path}: not JSON ({e})") from e
    if not isinstance(info, dict) or info.get("format") != EXPORT_FORMAT:
        raise ValueError(f"{path}: not a {EXPORT_FORMAT} record")
    return info
