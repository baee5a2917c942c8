"""Command-line flags shared by the peer daemon, the trainer, the demo and the experiments."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from swarm.compression import DEFAULT_BW_CODEC, DEFAULT_FW_CODEC, CodecConfig, codec_labels
from swarm.model.gpt import ModelConfig
from swarm.model.spec import BUILTIN, AnyModelConfig, resolve_model
from swarm.peers.shaper import LinkShape
from swarm.runtime.schedules import SCHEDULES

DEFAULT_MODEL = ModelConfig()


def add_model_choice_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """`--model`, `--weights`, `--tokenizer`: which model, from which local files (commands that shape the
    built-in model with flags of their own add only these)."""
    parser.add_argument(
        "--model",
        default=BUILTIN,
        metavar="NAME|DIR",
        help="the model: 'gpt' (the built-in byte-level GPT, shaped by --layers/--hidden/--heads), a preset "
        "(gpt2-tiny, llama-tiny, gpt2-small, llama-100m) or a local Hugging Face directory with config.json "
        "(default %(default)s; nothing is downloaded)",
    )
    parser.add_argument(
        "--weights",
        default=None,
        metavar="DIR",
        help="a local Hugging Face checkpoint (safetensors, sharded with an index or not): each stage loads only "
        "its own layers (default: a directory --model's own weights, else the seeded init)",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        metavar="FILE",
        help="a local tokenizer.json the data is tokenized with (default: a directory --model's own, else bytes)",
    )


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model (every peer and the trainer must agree)")
    add_model_choice_arguments(g)
    g.add_argument("--layers", type=int, default=DEFAULT_MODEL.n_layers, help="transformer blocks (--model gpt)")
    g.add_argument(
        "--hidden", type=int, default=DEFAULT_MODEL.hidden_dim, help="width of the residual stream (--model gpt)"
    )
    g.add_argument("--heads", type=int, default=DEFAULT_MODEL.n_heads, help="attention heads (--model gpt)")
    g.add_argument("--seq-len", type=int, default=DEFAULT_MODEL.seq_len_tokens, help="tokens per sample")
    g.add_argument("--model-seed", type=int, default=DEFAULT_MODEL.init_seed, help="seed of the weights' init")


def builtin_model(args: argparse.Namespace, init_seed: int) -> ModelConfig:
    """The built-in GPT shaped by `--seq-len/--hidden/--layers/--heads`, initialised from `init_seed`."""
    shape = dict(seq_len_tokens=args.seq_len, hidden_dim=args.hidden, n_layers=args.layers, n_heads=args.heads)
    return ModelConfig(**shape, init_seed=init_seed)


def model_config(args: argparse.Namespace) -> AnyModelConfig:
    """The model the flags name (`swarm.model.spec.resolve_model`); a bad value exits with a one-line error."""
    return chosen_model(args, builtin_model(args, args.model_seed))


def chosen_model(args: argparse.Namespace, builtin: ModelConfig) -> AnyModelConfig:
    """`builtin` for `--model gpt`, else the Hugging Face model `--model/--weights/--tokenizer` name, with
    `builtin`'s sequence length and init seed; a bad value exits with a one-line error naming the flag."""
    name = getattr(args, "model", BUILTIN)
    weights, tokenizer = getattr(args, "weights", None), getattr(args, "tokenizer", None)
    for flag, value in (("--weights", weights), ("--tokenizer", tokenizer)):
        if value is not None and not Path(value).exists():
            raise SystemExit(f"{flag} {value}: no such file or directory")
    if name == BUILTIN:
        if weights is not None or tokenizer is not None:
            raise SystemExit("--weights and --tokenizer need a Hugging Face model (--model PRESET or a directory)")
        return builtin
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
    flags = [
        f"--model={args.model}", f"--layers={args.layers}", f"--hidden={args.hidden}", f"--heads={args.heads}",
        f"--seq-len={args.seq_len}", f"--model-seed={args.model_seed}",
    ]  # fmt: skip
    return flags + [f"--{k}={getattr(args, k)}" for k in ("weights", "tokenizer") if getattr(args, k, None)]


def add_schedule_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup, default: str = "1f1b") -> None:
    """`--schedule`, whose choices are the schedule registry's names (`swarm.runtime.schedules.SCHEDULES`)."""
    parser.add_argument(
        "--schedule", choices=sorted(SCHEDULES), default=default, help="pipeline schedule (default %(default)s)"
    )


def add_codec_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("compression on the links")
    labels = codec_labels()
    g.add_argument("--fw-codec", default=DEFAULT_FW_CODEC, help=f"activation codec: {labels} (default %(default)s)")
    g.add_argument("--bw-codec", default=DEFAULT_BW_CODEC, help=f"gradient codec: {labels} (default %(default)s)")
    g.add_argument("--group-size", type=int, default=None, help="quantization group size (default: the kernels')")
    g.add_argument("--zstd-level", type=int, default=1, help="zstd level of the framing, 0 = off")
    g.add_argument("--codec-seed", type=int, default=0, help="seed of the stochastic rounding")


def codec_configs(args: argparse.Namespace) -> tuple[CodecConfig, CodecConfig]:
    common = dict(group_size=args.group_size, zstd_level=args.zstd_level, seed=args.codec_seed)
    buffer_dir = getattr(args, "buffer_dir", None)
    fw_extra = {"buffer_dir": str(buffer_dir)} if buffer_dir else {}  # one file per link end, see Direction
    return CodecConfig.parse(args.fw_codec, **common, **fw_extra), CodecConfig.parse(args.bw_codec, **common)


def add_shaping_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("link shaping in the application (token bucket + one-way delay)")
    g.add_argument("--rate-mbit", type=float, default=None, help="bandwidth of every outgoing link, Mbit/s")
    g.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay of every outgoing link, ms")
    g.add_argument(
        "--link",
        action="append",
        default=[],
        metavar="ADDR=RATE[:DELAY]",
        help="shape the link to one address differently, e.g. 127.0.0.1:5001=10:25 (repeatable)",
    )


def link_shapes(args: argparse.Namespace) -> tuple[LinkShape, dict[str, LinkShape]]:
    default = LinkShape.from_mbit(args.rate_mbit, args.delay_ms)
    per_link = {}
    for spec in args.link:
        address, sep, shape = spec.partition("=")
        if not sep:
            raise SystemExit(f"--link {spec!r}: expected ADDR=RATE[:DELAY]")
        per_link[address] = LinkShape.parse(shape)
    return default, per_link


def add_dht_arguments(parser: argparse.ArgumentParser) -> None:
    """The DHT flags of `swarm bootstrap` (--initial-peers, --host, --port, --run-name) plus --address-file."""
    from swarm.peers.dht_flags import add_dht_arguments as add_bootstrap_dht_arguments

    add_bootstrap_dht_arguments(parser)
    parser.add_argument(
        "--address-file", default=None, help="join through the multiaddrs in this file (as `swarm bootstrap` writes)"
    )


def initial_peers(args: argparse.Namespace) -> list[str]:
    from swarm.peers.dht_flags import read_address_file

    return list(args.initial_peers) + (read_address_file(args.address_file) if args.address_file else [])


def dht_config(args: argparse.Namespace, **overrides):
    """The DHTConfig of a command's parsed DHT flags."""
    from swarm.peers.dht_flags import dht_config_from_args

    return dht_config_from_args(args, initial_peers=tuple(initial_peers(args)), **overrides)


def add_metrics_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("monitoring")
    g.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics at http://HOST:PORT/metrics, HOST being --host (off unless given; 0: any port)",
    )
