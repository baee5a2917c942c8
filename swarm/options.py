"""Flag groups shared by the peer daemon, the trainer, the demo and the experiments, each flag a field here:
the model (`ModelFlags`), the links' codecs (`CodecFlags`) and shaping (`LinkShaping`, the one `--rate-mbit` of
a peer's links), the DHT (`DHT_FLAGS`) and the schedule (`SCHEDULE_CHOICES`)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from swarm.compression import DEFAULT_BACKWARD_CODEC, DEFAULT_FORWARD_CODEC, CodecConfig, codec_labels
from swarm.flags import Flag, Flags, flag
from swarm.model.gpt import ModelConfig
from swarm.model.spec import BUILTIN, BUILTIN_PRESETS, AnyModelConfig, builtin_preset, resolve_model
from swarm.peers.shaper import LinkShape, parse_rate_mbit
from swarm.runtime.schedules import SCHEDULES

DEFAULT_MODEL = ModelConfig()
SCHEDULE_CHOICES = tuple(sorted(SCHEDULES))
"""`--schedule`'s choices: the schedule registry's names (`swarm.runtime.schedules.SCHEDULES`)."""


@dataclass(frozen=True)
class ModelFlags:
    """The flags that name a model (`build`: the model config they name; `of`: the flags of a built-in one)."""

    model: str = field(default=BUILTIN, metadata=flag(metavar="NAME|DIR"))
    """the model: 'gpt' (the built-in byte-level GPT, shaped by --layers/--hidden/--heads), 'gpt-mid' (the built-in at
    hidden 256, 4 layers, 8 heads: 3.2M parameters; it sets those three flags), a preset (gpt2-tiny, llama-tiny,
    gpt2-small, llama-100m) or a local Hugging Face directory with config.json (nothing is downloaded)"""
    weights: str | None = field(default=None, metadata=flag(metavar="DIR"))
    """a local Hugging Face checkpoint (safetensors, sharded with an index or not): each stage loads only its own
    layers (none: a directory --model's own weights, else the seeded init)"""
    tokenizer: str | None = field(default=None, metadata=flag(metavar="FILE"))
    """a local tokenizer.json the data is tokenized with (none: a directory --model's own, else bytes)"""
    layers: int = DEFAULT_MODEL.n_layers
    """transformer blocks (--model gpt)"""
    hidden: int = DEFAULT_MODEL.hidden_dim
    """width of the residual stream (--model gpt)"""
    heads: int = DEFAULT_MODEL.n_heads
    """attention heads (--model gpt)"""
    seq_len: int = DEFAULT_MODEL.seq_len_tokens
    """tokens per sample"""
    model_seed: int = DEFAULT_MODEL.init_seed
    """seed of the weights' init"""
    subspace_dim: int = DEFAULT_MODEL.subspace_dim
    """keep the residual stream in a fixed random subspace of this many dimensions, so a stage boundary carries
    that many numbers a token instead of --hidden (a compression-aware architecture, for training from scratch;
    --model gpt or gpt-mid; 0: off)"""

    def build(self) -> AnyModelConfig:
        return model_config(self)

    @classmethod
    def of(cls, model: AnyModelConfig) -> ModelFlags:
        """The flags of a built-in model (a Hugging Face model is written by its --model name: `ModelFlags`
        itself, as `swarm experiment finetune` does)."""
        if not isinstance(model, ModelConfig):
            raise ValueError(f"a {type(model).__name__} has no flags of its own: pass its --model name instead")
        return cls(
            layers=model.n_layers, hidden=model.hidden_dim, heads=model.n_heads, seq_len=model.seq_len_tokens,
            model_seed=model.init_seed, subspace_dim=model.subspace_dim,
        )  # fmt: skip


MODEL_GROUP = "model (every peer and the trainer must agree)"
MODEL_FLAGS = Flags(ModelFlags, title=MODEL_GROUP)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The `ModelFlags` of a command that reads them from its namespace (`model_config(args)`)."""
    MODEL_FLAGS.add_to(parser, config_flag=False)


def model_config(args: argparse.Namespace) -> AnyModelConfig:
    """The model the flags name (`swarm.model.spec.resolve_model`); a bad value exits with a one-line error."""
    shape = dict(seq_len_tokens=args.seq_len, hidden_dim=args.hidden, n_layers=args.layers, n_heads=args.heads)
    return chosen_model(args, builtin_config(shape, args.model_seed, getattr(args, "subspace_dim", 0)))


def builtin_config(shape: dict, init_seed: int, subspace_dim: int) -> ModelConfig:
    """The built-in GPT of these flags; a bad shape exits with a one-line error."""
    try:
        return ModelConfig(**shape, init_seed=init_seed, subspace_dim=subspace_dim)
    except ValueError as e:
        raise SystemExit(f"model flags: {e}") from None


def chosen_model(args: argparse.Namespace, builtin: ModelConfig) -> AnyModelConfig:
    """`builtin` for `--model gpt`, else the Hugging Face model `--model/--weights/--tokenizer` name, with
    `builtin`'s sequence length and init seed; a bad value exits with a one-line error naming the flag."""
    name = getattr(args, "model", BUILTIN)
    weights, tokenizer = getattr(args, "weights", None), getattr(args, "tokenizer", None)
    for option, value in (("--weights", weights), ("--tokenizer", tokenizer)):
        if value is not None and not Path(value).exists():
            raise SystemExit(f"{option} {value}: no such file or directory")
    if name == BUILTIN or name in BUILTIN_PRESETS:
        if weights is not None or tokenizer is not None:
            raise SystemExit("--weights and --tokenizer need a Hugging Face model (--model PRESET or a directory)")
        try:
            return builtin if name == BUILTIN else builtin_preset(name, builtin)
        except ValueError as e:  # a subspace wider than the preset's width
            raise SystemExit(f"--model {name}: {e}") from None
    if builtin.subspace_dim:
        raise SystemExit(f"--subspace-dim is for the built-in GPT (--model gpt or gpt-mid), not --model {name}")
    try:
        cfg = resolve_model(name, seq_len_tokens=builtin.seq_len_tokens, init_seed=builtin.init_seed, weights=weights)
    except (ValueError, KeyError, OSError) as e:
        raise SystemExit(f"--model {name}: {e}") from None
    if tokenizer is not None:
        from swarm.model.hf import load_tokenizer

        try:
            n = load_tokenizer(tokenizer).get_vocab_size()
        except ValueError as e:
            raise SystemExit(f"--tokenizer {tokenizer}: {e}") from None
        if n > cfg.vocab_size:
            raise SystemExit(f"--tokenizer {tokenizer}: {n} tokens, more than the model's vocabulary {cfg.vocab_size}")
        cfg = replace(cfg, tokenizer_path=str(Path(tokenizer).resolve()))
    return cfg


def model_arguments(args: argparse.Namespace) -> list[str]:
    """The model flags of `args` as a command line, for the peers a command starts (the same model)."""
    return MODEL_FLAGS.to_argv(ModelFlags(**{f.name: getattr(args, f.name) for f in fields(ModelFlags)}))


def _codec_label(text: str) -> str:
    CodecConfig.parse(text)  # a bad label fails as the flag is read, naming it
    return text


_LABELS = codec_labels()


def _full_label(c: CodecConfig) -> str:
    """`c.label` with what it leaves out: round to nearest (`+nr`) and the group size (`+gN`)."""
    return c.label + ("" if c.stochastic else "+nr") + (f"+g{c.group_size}" if c.group_size is not None else "")


@dataclass(frozen=True)
class CodecFlags:
    """Compression on the links: the flags of a peer's two codecs (`build`: the `CodecConfig`s they give)."""

    fw_codec: str = field(
        default=DEFAULT_FORWARD_CODEC, metadata=flag(parse=_codec_label, help=f"activation codec: {_LABELS}")
    )
    """Label of the activation codec of the links this peer sends forward on."""
    bw_codec: str = field(
        default=DEFAULT_BACKWARD_CODEC, metadata=flag(parse=_codec_label, help=f"gradient codec: {_LABELS}")
    )
    """Label of the gradient codec of the links this peer sends backward on."""
    group_size: int | None = None
    """quantization group size (none: the kernels')"""
    zstd_level: int = 1
    """zstd level of the framing, 0 = off"""
    codec_seed: int = 0
    """seed of the stochastic rounding"""
    buffer_dir: str | None = None
    """keep AQ-SGD buffers in memory-mapped files here (data larger than RAM)"""
    buffer_budget_bytes: int = 0
    """bytes of AQ-SGD buffers each link end may hold, in RAM or in --buffer-dir; past it the least recently seen
    sample is evicted and travels as a first sight when it comes back (0: no budget). Give both ends of a link the
    same budget"""

    def build(self) -> dict[str, CodecConfig]:
        common = dict(group_size=self.group_size, zstd_level=self.zstd_level, seed=self.codec_seed)
        common["buffer_budget_bytes"] = self.buffer_budget_bytes or 0
        forward_extra = {"buffer_dir": str(self.buffer_dir)} if self.buffer_dir else {}  # one file per link end
        return {
            "fw_codec": CodecConfig.parse(self.fw_codec, **common, **forward_extra),
            "bw_codec": CodecConfig.parse(self.bw_codec, **common),
        }

    @classmethod
    def of(cls, forward: CodecConfig, backward: CodecConfig) -> CodecFlags:
        """The flags of two codecs (each one's rounding and group size in its label, `+nr`, `+gN`)."""
        labels = [
            default if CodecConfig.parse(default) == c else _full_label(c)
            for c, default in ((forward, DEFAULT_FORWARD_CODEC), (backward, DEFAULT_BACKWARD_CODEC))
        ]
        return cls(*labels, None, forward.zstd_level, forward.seed, forward.buffer_dir, forward.buffer_budget_bytes)


def codec_configs(args: argparse.Namespace) -> tuple[CodecConfig, CodecConfig]:
    """The codecs of a namespace holding `CodecFlags`' flags."""
    names = [f.name for f in fields(CodecFlags)]
    built = CodecFlags(**{n: getattr(args, n, None) for n in names if hasattr(args, n)}).build()
    return built["fw_codec"], built["bw_codec"]


def _mbit(rate_bytes_per_s: float | None) -> float | None:
    return None if rate_bytes_per_s is None else round(rate_bytes_per_s * 8 / 1e6, 9)  # 9 digits: not 7.000000001


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 9)


def _number(x: float) -> str:
    text = repr(x)
    return text[:-2] if text.endswith(".0") else text


def _shape_text(shape: LinkShape) -> str:
    rate = _mbit(shape.rate_bytes_per_s)
    return f"{'none' if rate is None else _number(rate)}:{_number(_ms(shape.delay_s))}"


@dataclass(frozen=True)
class LinkShaping:
    """Link shaping in the application (token bucket + one-way delay): the flags of a peer's outgoing links."""

    rate_mbit: float | None = field(default=None, metadata=flag(parse=parse_rate_mbit))
    """bandwidth of every outgoing link, Mbit/s (none or 0: unshaped)"""
    delay_ms: float = 0.0
    """one-way delay of every outgoing link, ms"""
    link: tuple[str, ...] = field(default=(), metadata=flag(repeat=True, metavar="ADDR=RATE[:DELAY]"))
    """shape the link to one address differently, e.g. 127.0.0.1:5001=10:25 (repeatable)"""

    def __post_init__(self) -> None:
        for spec in self.link:
            if "=" not in spec:
                raise ValueError(f"--link {spec!r}: expected ADDR=RATE[:DELAY]")

    def build(self) -> dict[str, object]:
        per_link = {}
        for spec in self.link:
            address, _, shape = spec.partition("=")
            per_link[address] = LinkShape.parse(shape)
        return {
            "link_shape": LinkShape.from_mbit(self.rate_mbit, self.delay_ms),
            "link_shapes": tuple(per_link.items()),
        }

    @classmethod
    def of(cls, shape: LinkShape, shapes: tuple[tuple[str, LinkShape], ...]) -> LinkShaping:
        return cls(_mbit(shape.rate_bytes_per_s), _ms(shape.delay_s), tuple(f"{a}={_shape_text(s)}" for a, s in shapes))


def peer_ids(text: str) -> tuple[str, ...]:
    """`ID[,ID...]` as a tuple of peer ids."""
    ids = tuple(part.strip() for part in text.split(",") if part.strip())
    if not ids and text.strip():  # "" is none (what an empty tuple renders as)
        raise argparse.ArgumentTypeError(f"expected peer ids separated by commas, got {text!r}")
    return ids


def _identity(path: str | None) -> str | None:
    from swarm.peers.dht_config import load_or_create_key

    if path is not None:
        load_or_create_key(path)  # an unreadable or malformed file fails here, named, not in a child process
    return path


def _secret(path: str | None) -> str | None:
    return None if path is None else read_secret_file(path)


def read_secret_file(path: str) -> str:
    """The run secret in `path` (surrounding whitespace stripped). Raises ValueError naming the file."""
    try:
        with open(path, "rb") as f:
            data = f.read(4097)
    except OSError as e:
        raise ValueError(f"--run-secret-file {path}: cannot read it: {e.strerror or e}") from None
    try:
        secret = data.decode().strip()
    except UnicodeDecodeError:
        raise ValueError(f"--run-secret-file {path}: not UTF-8 text") from None
    if not secret or len(data) > 4096:
        raise ValueError(f"--run-secret-file {path}: expected 1 to 4096 bytes of text")
    return secret


def _no_secret(secret: str | None) -> str:
    if secret is None:
        return "none"
    raise ValueError("a run secret never goes on a command line: give the child --run-secret-file itself")


_TRUST = "identity and trust"
DHT_FLAGS = Flag(
    group="DHT",
    only=("initial_peers", "host", "port", "run_name", "run", "signing_key_path", "trusted_planners", "run_secret",
          "allowed_trainers"),
    fields={
        "initial_peers": Flag(
            nargs="+", metavar="MADDR",
            help="multiaddrs of live DHT nodes to join through, as `swarm bootstrap` prints them "
            "(/ip4/HOST/tcp/PORT/p2p/ID); none starts a new swarm",
        ),
        "host": Flag(help="IP address the DHT node (and a peer's stage service) listens on; 0.0.0.0 to accept "
                     "other machines"),
        "port": Flag(help="TCP port the DHT node listens on (0: any free)"),
        "run_name": Flag(help="namespace of the run's DHT keys, so runs can share a DHT"),
        "run": Flag(
            metavar="ID|FILE", group=_TRUST,
            help="join the owned run with this id (its manifest is fetched from the DHT and verified) or this "
            "manifest file (`swarm run init`): the model, codecs and schedule come from the manifest, and only the "
            "owner's delegated planners and trainers plan and train (none: an unowned run, whose planning any peer "
            "can take over)",
        ),
        "signing_key_path": Flag(
            name="--identity", metavar="FILE", parse=str, value=_identity, group=_TRUST,
            help="RSA key (DER) that signs this process's records and calls; its hash is the peer id, so a restart "
            "with the same file keeps the id (created with mode 0600 if missing; none: a fresh key each start)",
        ),
        "trusted_planners": Flag(
            parse=peer_ids, render=",".join, nargs=None, metavar="ID[,ID...]", group=_TRUST,
            help="private run: follow plans only from these peer ids, and let only them plan (none: an owned run's "
            "delegated planners, else the elected planner, the lowest announced id holding the planner lease, which "
            "a stranger can grind a key for: open runs are owned runs, --run)",
        ),
        "run_secret": Flag(
            name="--run-secret-file", metavar="FILE", parse=str, value=_secret, render=_no_secret, group=_TRUST,
            help="private run: a secret shared by the run's peers and trainers, read from FILE (never on the "
            "command line); stages serve only callers that know it",
        ),
        "allowed_trainers": Flag(
            name="--trainers", parse=peer_ids, render=",".join, metavar="ID[,ID...]", group=_TRUST,
            help="private run: the peer ids of the trainers the stages serve (none: any announced trainer)",
        ),
    },
)  # fmt: skip
"""How a command's `dht: DHTConfig` field is flags (`field(metadata={"flag": DHT_FLAGS})`)."""
