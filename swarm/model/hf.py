"""Hugging Face model families (GPT-2, Llama and its relatives) as swarm models: configs, presets, tokenizers.

A model is an `HFModelConfig`: the family and the `transformers` config as canonical JSON text, so peers can
rebuild it from a string and compare it by `identity_blob()`. It comes from a preset of `PRESETS` or from a
local directory holding a config.json, never from the hub. `build_hf_stage` (in `hf_stage`) splits it into
pipeline stages made of `transformers`' own blocks; `hf_weights` reads each stage's own tensors from a local
safetensors checkpoint. `transformers` and `tokenizers` are imported lazily: `import swarm` never loads them.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swarm.model.hf_stage import build_hf_stage
from swarm.model.hf_weights import checkpoint_files, save_checkpoint

if TYPE_CHECKING:
    import tokenizers
    from transformers import PretrainedConfig

__all__ = [
    "HFModelConfig",
    "HFPreset",
    "PRESETS",
    "FAMILIES",
    "hf_model_config",
    "build_hf_stage",
    "save_checkpoint",
    "load_tokenizer",
    "train_tokenizer",
]

FAMILIES = ("gpt2", "llama", "mistral", "qwen2")
"""Supported `model_type`s: GPT-2, and Llama with the families built from the same decoder layer."""

# Keys of a transformers config dict that say nothing about the weights (versions, local paths, runtime
# switches); dropped so that equal models have equal identities wherever they were saved.
_VOLATILE_KEYS = (
    "transformers_version", "_name_or_path", "_attn_implementation_autoset", "torch_dtype", "dtype", "architectures",
)  # fmt: skip
# Dropout off, no KV cache: every stage computes the same deterministic function the unsplit model does.
_DETERMINISTIC = {
    "gpt2": {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "summary_first_dropout": 0.0},
    "llama": {"attention_dropout": 0.0},
    "mistral": {"attention_dropout": 0.0},
    "qwen2": {"attention_dropout": 0.0},
}
_MAX_CONFIG_BYTES = 1 << 20
DIRECTORY_SEQ_LEN = 256
"""Default tokens per sample of a model from a directory (capped by its positions), as the CPU presets use."""
_GPT2_KEYS = {"vocab_size": "vocab_size", "hidden": "n_embd", "layers": "n_layer", "heads": "n_head"}
_LLAMA_KEYS = {"vocab_size": "vocab_size", "hidden": "hidden_size", "layers": "num_hidden_layers"}


@functools.lru_cache(maxsize=64)
def _config_object(family: str, config_json: str) -> PretrainedConfig:
    from transformers import AutoConfig

    d = json.loads(config_json)
    d.pop("model_type", None)
    cfg = AutoConfig.for_model(family, **d)
    cfg._attn_implementation = "sdpa"  # causal attention from attention_mask=None: no mask tensors built
    cfg.use_cache = False
    return cfg


def _canonical(family: str, config: dict[str, Any]) -> str:
    d = {k: v for k, v in config.items() if k not in _VOLATILE_KEYS}
    d.update(_DETERMINISTIC[family])
    d["model_type"] = family
    d["use_cache"] = False
    return json.dumps(d, sort_keys=True, separators=(",", ":"))


def _max_positions(family: str, cfg: PretrainedConfig) -> int:
    return int(cfg.n_positions if family == "gpt2" else cfg.max_position_embeddings)


@dataclass(frozen=True)
class HFModelConfig:
    """A `transformers` causal LM as a swarm model; plain str/int/None fields so it travels as text."""

    family: str
    """The config's `model_type`: one of `FAMILIES`."""
    config_json: str
    """The `transformers` config dict as canonical JSON (sorted keys, dropout 0, no cache, no versions)."""
    seq_len_tokens: int
    """Tokens per sample; at most the config's position limit."""
    init_seed: int = 0
    """Seed of the deterministic per-parameter init, used when `weights_dir` is None."""
    weights_dir: str | None = None
    """Local checkpoint directory (model.safetensors, or shards with model.safetensors.index.json)."""
    tokenizer_path: str | None = None
    """Local tokenizer.json (None: the byte-level data path, which needs vocab_size >= 256)."""

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"unsupported model family {self.family!r}; supported: {', '.join(FAMILIES)}")
        if len(self.config_json) > _MAX_CONFIG_BYTES:
            raise ValueError(f"config_json longer than {_MAX_CONFIG_BYTES} characters")
        d = json.loads(self.config_json)
        if not isinstance(d, dict) or d.get("model_type") != self.family:
            raise ValueError(f"config_json is not a {self.family} config object")
        cfg = self.hf_config()
        limit = _max_positions(self.family, cfg)
        if not 1 <= self.seq_len_tokens <= limit:
            raise ValueError(f"seq_len_tokens {self.seq_len_tokens} is outside [1, {limit}] (the model's positions)")
        if self.hidden_dim % self.n_heads:
            raise ValueError(f"hidden size {self.hidden_dim} is not divisible by {self.n_heads} heads")
        window = getattr(cfg, "sliding_window", None)
        if window is not None and window < self.seq_len_tokens:
            # Stages attend with attention_mask=None (plain causal); a window shorter than the sample
            # would silently change the math.
            raise ValueError(f"sliding-window attention ({window} < {self.seq_len_tokens} tokens) is unsupported")

    def hf_config(self) -> PretrainedConfig:
        """The `transformers` config object (cached; sdpa attention, no cache). Do not mutate it."""
        return _config_object(self.family, self.config_json)

    def _get(self, key: str) -> int:
        keys = _GPT2_KEYS if self.family == "gpt2" else _LLAMA_KEYS
        return int(getattr(self.hf_config(), keys[key]))

    @property
    def vocab_size(self) -> int:
        return self._get("vocab_size")

    @property
    def hidden_dim(self) -> int:
        return self._get("hidden")

    @property
    def boundary_dim(self) -> int:
        """Width of one token's activation at a stage boundary: the hidden size."""
        return self.hidden_dim

    @property
    def n_layers(self) -> int:
        return self._get("layers")

    @property
    def n_heads(self) -> int:
        cfg = self.hf_config()
        return int(cfg.n_head if self.family == "gpt2" else cfg.num_attention_heads)

    @property
    def tied_embeddings(self) -> bool:
        """The head is the token embedding (GPT-2; a Llama only with tie_word_embeddings)."""
        return bool(self.hf_config().tie_word_embeddings)

    def identity_blob(self) -> str:
        """Canonical JSON of what fixes the weights' shapes and init (no local paths)."""
        blob = {"family": self.family, "config": json.loads(self.config_json)}
        blob.update(seq_len_tokens=self.seq_len_tokens, init_seed=self.init_seed)
        return json.dumps(blob, sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class HFPreset:
    """A named model shape built in code (no downloads)."""

    family: str
    """`model_type` of the config."""
    config: tuple[tuple[str, Any], ...]
    """Keyword arguments of the family's config class (as pairs, to keep the preset hashable)."""
    seq_len_tokens: int
    """Default tokens per sample."""
    doc: str
    """What the preset is for."""


def _preset(family: str, seq: int, doc: str, **config: Any) -> HFPreset:
    return HFPreset(family, tuple(sorted(config.items())), seq, doc)


_TINY_LLAMA = dict(
    vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False, initializer_range=0.02,
)  # fmt: skip

PRESETS: dict[str, HFPreset] = {
    "gpt2-tiny": _preset(
        "gpt2", 128, "GPT-2 blocks at test size, byte vocab", vocab_size=256, n_positions=128, n_embd=32,
        n_layer=3, n_head=4,
    ),
    "llama-tiny": _preset("llama", 128, "Llama blocks at test size (GQA 4:2), byte vocab, untied", **_TINY_LLAMA),
    "mistral-tiny": _preset("mistral", 128, "Mistral blocks at test size", **_TINY_LLAMA, sliding_window=None),
    "qwen2-tiny": _preset("qwen2", 128, "Qwen2 blocks at test size (q/k/v biases)", **_TINY_LLAMA),
    "gpt2-small": _preset(
        "gpt2", 256, "GPT-2 124M's shape (vocab 50257, 12 x 768)", vocab_size=50257, n_positions=1024,
        n_embd=768, n_layer=12, n_head=12,
    ),
    "llama-100m": _preset(
        "llama", 256, "a 110M-parameter Llama (12 x 768, MLP 2048, vocab 16384 for a local BPE tokenizer)",
        vocab_size=16384, hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
        num_key_value_heads=12, max_position_embeddings=2048, tie_word_embeddings=False, rope_theta=10000.0,
        initializer_range=0.02,
    ),
}  # fmt: skip


def _has_weights(directory: Path) -> bool:
    return (directory / "model.safetensors").is_file() or (directory / "model.safetensors.index.json").is_file()


def hf_model_config(
    name: str,
    *,
    seq_len_tokens: int | None = None,
    init_seed: int = 0,
    weights: str | None = None,
    tokenizer: str | None = None,
) -> HFModelConfig:
    """The model a preset name or a local Hugging Face directory describes.

    Args:
        name: a key of `PRESETS`, or a local directory with a config.json.
        seq_len_tokens: tokens per sample (None: the preset's default, or min(positions, 256) for a directory,
            the presets' CPU-sized default).
        init_seed: seed of the deterministic init (used when there are no weights).
        weights: a local checkpoint directory; for a directory `name`, None means its own weights if it has any.
        tokenizer: a local tokenizer.json; None takes `name`'s or `weights`' tokenizer.json when present.

    Raises:
        ValueError: unknown preset, missing config.json or weights, unsupported model_type, bad seq len.
    """
    directory = Path(name)
    if name in PRESETS:
        preset = PRESETS[name]
        family, config = preset.family, _family_config_dict(preset.family, dict(preset.config))
        default_seq = preset.seq_len_tokens
        search = [Path(weights)] if weights else []
    elif directory.is_dir():
        family, config = _directory_config(directory)
        if weights is None and _has_weights(directory):
            weights = str(directory)
        default_seq = None
        search = [directory] + ([Path(weights)] if weights else [])
    else:
        raise ValueError(
            f"unknown model {name!r}: not a directory and not a preset; presets: {', '.join(sorted(PRESETS))}"
        )
    canonical = _canonical(family, config)
    if weights is not None:
        checkpoint_files(Path(weights))  # raises a clear error now rather than on every stage later
        _check_same_model(Path(weights), family, canonical)
        weights = os.path.abspath(weights)
    if tokenizer is None:
        tokenizer = next((str(d / "tokenizer.json") for d in search if (d / "tokenizer.json").is_file()), None)
    if seq_len_tokens is None:
        positions = _max_positions(family, _config_object(family, canonical))
        seq_len_tokens = default_seq or min(positions, DIRECTORY_SEQ_LEN)
    cfg = HFModelConfig(family, canonical, seq_len_tokens, init_seed, weights, tokenizer)
    if tokenizer is not None:
        n = load_tokenizer(tokenizer).get_vocab_size()
        if n > cfg.vocab_size:
            raise ValueError(f"tokenizer {tokenizer} has {n} tokens, more than the model's vocab {cfg.vocab_size}")
    return cfg


def _directory_config(directory: Path) -> tuple[str, dict[str, Any]]:
    path = directory / "config.json"
    if not path.is_file():
        raise ValueError(f"{directory}: no config.json in this directory")
    if path.stat().st_size > _MAX_CONFIG_BYTES:
        raise ValueError(f"{path}: larger than {_MAX_CONFIG_BYTES} bytes")
    try:
        config = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from exc
    family = config.get("model_type") if isinstance(config, dict) else None
    if family not in FAMILIES:
        raise ValueError(f"{path}: unsupported model_type {family!r}; supported: {', '.join(FAMILIES)}")
    # save_pretrained writes only the keys that differ from the defaults: fill them in, so a directory and
    # the preset it was saved from have one identity.
    return family, _family_config_dict(family, {k: v for k, v in config.items() if k != "model_type"})


def _check_same_model(weights: Path, family: str, canonical: str) -> None:
    """A weights directory's own config.json (if any) must describe the model being built."""
    if not (weights / "config.json").is_file():
        return
    other_family, other = _directory_config(weights)
    theirs, ours = json.loads(_canonical(other_family, other)), json.loads(canonical)
    differ = sorted(k for k in theirs.keys() | ours.keys() if theirs.get(k) != ours.get(k))
    if differ:
        shown = ", ".join(f"{k}: {ours.get(k)!r} vs {theirs.get(k)!r}" for k in differ[:5])
        raise ValueError(f"weights {weights} are of another model ({shown})")


def _family_config_dict(family: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    from transformers import AutoConfig

    return AutoConfig.for_model(family, **kwargs).to_dict()


def load_tokenizer(path: str | os.PathLike) -> tokenizers.Tokenizer:
    """A `tokenizers.Tokenizer` from a local tokenizer.json (never the hub)."""
    from tokenizers import Tokenizer

    p = Path(path)
    if not p.is_file():
        raise ValueError(f"tokenizer file {p} does not exist (expected a local tokenizer.json)")
    try:
        return Tokenizer.from_file(str(p))
    except Exception as exc:  # tokenizers raises a bare Exception on bad JSON
        raise ValueError(f"{p} is not a tokenizers tokenizer.json: {exc}") from exc


def train_tokenizer(texts: Any, vocab_size: int, out_path: str | os.PathLike) -> tokenizers.Tokenizer:
    """Train a byte-level BPE tokenizer on local texts (an iterable of str) and save it as tokenizer.json.

    Byte-level: every byte is in the base alphabet, so any text encodes with no unknown token.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(texts, trainer=trainer)
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_path))
    return tok
