"""`swarm bench model`: what a model costs a swarm, per stage and per boundary.

For a `--model` split into `--stages` even stages: each stage's forward+backward tokens/s on one micro-batch
(the fastest of `--iters` timed passes after a warm-up, as `swarm.daemon.capacity` measures a peer); the
bytes per token a boundary sends, measured by encoding and framing real tensors of the first boundary (stage
0's activation of real text, and the loss's gradient with respect to it through the rest of the model): in
fp32, and with the swarm's default codecs (AQ-SGD's first sight of a sample, then its steady-state delta after
one AdamW step of stage 0 at the fine-tuning rate `--lr`, and gradq's gradient); and from those, the link
speed below which the pipeline is network-bound: a boundary's busier direction per micro-batch takes longer
on the link than the slowest stage's compute per micro-batch (full-duplex links, as the planner assumes).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from dataclasses import dataclass, field

import torch

from swarm.compression import DEFAULT_BACKWARD_CODEC, DEFAULT_FORWARD_CODEC, CodecConfig, frame, make_codec
from swarm.flags import Flags, flag
from swarm.options import MODEL_GROUP, ModelFlags

__all__ = ["add_arguments", "run", "bench_model"]


def _has_device_module() -> bool:
    return importlib.util.find_spec("swarm.runtime.device") is not None


@dataclass(frozen=True)
class ModelBench:
    """`swarm bench model`: a model's tokens/s per stage, boundary bytes per token and the link speeds below
    which it is network-bound."""

    model: ModelFlags = field(
        default_factory=ModelFlags,
        metadata=flag(only=("model", "weights", "tokenizer", "seq_len", "model_seed"), group=MODEL_GROUP),
    )
    """The model (the built-in's shape: its defaults)."""
    stages: int = 3
    """even stages to split the model into"""
    micro_batch: int = 2
    """samples per micro-batch"""
    iters: int = 3
    """timed passes per stage, the fastest counts"""
    lr: float = 1e-4
    """AdamW step before the steady-state delta"""
    fw_codec: str = DEFAULT_FORWARD_CODEC
    """activation codec"""
    bw_codec: str = DEFAULT_BACKWARD_CODEC
    """gradient codec"""
    threads: int = 1
    """torch intra-op threads"""
    json: bool = False
    """print one JSON object"""


_FLAGS = Flags(ModelBench)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _FLAGS.add_to(parser)
    if _has_device_module():
        from swarm.runtime.device import add_device_argument

        add_device_argument(parser)


def _tokens(model, batch: int) -> torch.Tensor:
    """`batch` windows of real text, tokenized as the model's data set is (its tokenizer, else bytes)."""
    from swarm.model.data import DataConfig, build_datasets

    data = DataConfig(
        seq_len_tokens=model.seq_len_tokens,
        train_samples=batch,
        eval_samples=0,
        tokenizer=getattr(model, "tokenizer_path", None),
    )
    train, _, _ = build_datasets(data)
    return train.windows[:batch]


class _End:
    """One sending end of a boundary: a codec and its link state (AQ-SGD buffers, error feedback)."""

    def __init__(self, label: str):
        from swarm.compression import LinkState

        self.config = CodecConfig.parse(label)
        self.codec, self.state = make_codec(self.config), LinkState(self.config)

    def message_bytes(self, tensor: torch.Tensor, ids: list[int]) -> int:
        """Bytes of `tensor`'s message, encoded and framed as a stage sends it (headers and scales included)."""
        msg = self.codec.encode(tensor, sample_ids=ids if self.codec.uses_buffers else None, state=self.state)
        return sum(chunk.ByteSize() for chunk in frame(msg, zstd_level=self.config.zstd_level))


def _time_stage(stage, x: torch.Tensor, targets: torch.Tensor, iters: int) -> float:
    """Fastest forward+backward of `stage` on `x`, seconds (the device synchronized around each timed pass; the
    first pass warms up the allocator and kernels)."""
    from swarm.runtime.device import fastest_seconds

    def one_pass() -> None:
        stage.zero_grad(set_to_none=True)
        inp = x if not x.is_floating_point() else x.detach().requires_grad_(True)
        out = stage(inp, targets) if stage.is_last else stage(inp)
        (out if out.dim() == 0 else (out * torch.ones_like(out)).sum()).backward()

    return fastest_seconds(one_pass, x.device, iters, warmup=1)


def bench_model(
    model, stages: int, micro_batch: int, iters: int, lr: float, forward_codec: str, backward_codec: str, device="cpu"
) -> dict:
    from swarm.model.gpt import split_layers
    from swarm.model.spec import build_stage, model_identity

    windows = _tokens(model, micro_batch).to(device)
    tokens, targets = windows[:, :-1], windows[:, 1:]
    n_tok = tokens.numel()
    ranges = split_layers(model.n_layers, stages)
    rows = []
    for s, (a, b) in enumerate(ranges):
        stage = build_stage(model, a, b, s == 0, s == stages - 1).to(device)
        x = tokens if s == 0 else torch.randn(micro_batch, model.seq_len_tokens, model.boundary_dim, device=device)
        seconds = _time_stage(stage, x, targets, iters)
        params = sum(p.numel() for p in stage.parameters())
        rows.append({"stage": s, "layers": [a, b], "parameters": params, "fwd_bwd_s": seconds,
                     "tokens_per_s": n_tok / seconds})  # fmt: skip
        del stage
    # the first boundary, on real tensors: stage 0's activation and the loss's gradient with respect to it
    first = build_stage(model, *ranges[0], True, stages == 1).to(device)
    rest = build_stage(model, ranges[0][1], model.n_layers, False, True).to(device) if stages > 1 else None
    act = first(tokens)
    boundary = {}
    if rest is not None:
        x = act.detach().requires_grad_(True)
        loss = rest(x, targets)
        loss.backward()
        grad = x.grad.detach()
        (act * grad).sum().backward()  # stage 0's own gradient of the same loss
        ids = list(range(micro_batch))
        forward = _End(forward_codec)
        first_sight = forward.message_bytes(act.detach().float().cpu(), ids)
        torch.optim.AdamW(first.parameters(), lr=lr).step()
        with torch.no_grad():
            act2 = first(tokens).float().cpu()
        boundary = {
            "fp32_forward": _End("fp32").message_bytes(act.detach().float().cpu(), ids) / n_tok,
            "fp32_backward": _End("fp32").message_bytes(grad.float().cpu(), ids) / n_tok,
            "codec_forward_first_sight": first_sight / n_tok,
            "codec_forward_steady": forward.message_bytes(act2, ids) / n_tok,
            "codec_backward": _End(backward_codec).message_bytes(grad.float().cpu(), ids) / n_tok,
        }
    slowest = max(r["fwd_bwd_s"] for r in rows)
    link = {}
    if boundary:
        # network-bound when the busier direction's bytes per micro-batch take longer than the slowest stage
        for name, busier in (
            ("fp32", max(boundary["fp32_forward"], boundary["fp32_backward"])),
            ("codecs", max(boundary["codec_forward_steady"], boundary["codec_backward"])),
        ):
            link[f"{name}_network_bound_below_mbit"] = busier * n_tok * 8 / slowest / 1e6
    return {
        "model": getattr(model, "family", "gpt"),
        "identity": model_identity(model)[:16],
        "parameters": sum(r["parameters"] for r in rows),
        "layers": model.n_layers,
        "hidden": model.hidden_dim,
        "seq_len": model.seq_len_tokens,
        "micro_batch": micro_batch,
        "device": str(device),
        "fw_codec": forward_codec,
        "bw_codec": backward_codec,
        "stages": rows,
        "boundary_bytes_per_token": boundary,
        "slowest_stage_s": slowest,
        **link,
    }


def run(args: argparse.Namespace) -> int:
    bench = _FLAGS.from_args(args)
    from swarm.model.gpt import ModelConfig
    from swarm.options import chosen_model

    torch.set_num_threads(bench.threads)
    builtin = ModelConfig(seq_len_tokens=bench.model.seq_len, init_seed=bench.model.model_seed)
    model = chosen_model(bench.model, builtin)
    if bench.stages < 1 or bench.stages > model.n_layers:
        raise SystemExit(f"--stages {bench.stages}: expected 1..{model.n_layers} (the model's layers)")
    device = getattr(args, "device", "cpu")
    result = bench_model(
        model, bench.stages, bench.micro_batch, bench.iters, bench.lr, bench.fw_codec, bench.bw_codec, device
    )
    if bench.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{bench.model.model}: {result['parameters']:,} parameters, {result['layers']} layers x {result['hidden']}, "
          f"micro-batch {result['micro_batch']} x {result['seq_len']} tokens on {result['device']}")  # fmt: skip
    for r in result["stages"]:
        a, b = r["layers"]
        print(f"  stage {r['stage']} [{a},{b}): {r['parameters']:,} params, {r['tokens_per_s']:,.0f} tokens/s")
    for k, v in result["boundary_bytes_per_token"].items():
        print(f"  boundary {k}: {v:,.1f} B/token")
    for k in ("fp32_network_bound_below_mbit", "codecs_network_bound_below_mbit"):
        if k in result:
            print(f"  {k}: {result[k]:,.1f}")
    return 0
