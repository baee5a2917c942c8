"""What authentication costs: per call, per in-process step, and per `swarm demo` step, with it on and off.

Three parts, each a set of rows:

- `per_call`: signing and verifying one call in this process, the token alone (what a call carried before
  call proofs, and what the relay's own calls still carry) and the token with the call's proof (Ed25519 over
  callee, method, the SHA-256 of the call's fields, a nonce and the time; `swarm.net.auth`), for a unary request
  and for a stream's first item of 64 KiB and of 1 MiB (the largest chunk). Medians of `--calls` calls, in us.
- `local`: an in-process 2-stage pipeline (`LocalPipeline`, no network, so authentication's share is as large
  as it gets), authentication on and off alternating step by step: mean step time, and how many calls a step
  makes (counted by the stages' replay caches), so per-call cost x calls gives the proofs' share of a step.
- `demo` (unless `--no-demo`): `swarm demo` with signed, authorized calls (the default) against `--no-auth`,
  alternating pair after pair in one run so the machine's drift touches both alike; each demo is a whole swarm
  of processes on 127.0.0.1, its figure the trainer's mean step time (`mean_step_s`, the first step left out).

The summary row gives each part's ratio auth/no-auth (target: < 1.05) and the proofs' predicted share of a
step: (proof - token-only) per call x calls per step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from tqdm import tqdm

from swarm.flags import Flags
from swarm.report import median_seconds, print_table


@dataclass(frozen=True)
class AuthBench:
    """`swarm bench auth`: what authentication costs per call, per in-process step and per demo step."""

    pairs: int = 3
    """demo runs per setting, alternating"""
    epochs: int = 2
    """epochs of each demo (2: 32 steps)"""
    quick: bool = False
    """one pair of one-epoch demos, fewer timed calls and in-process steps"""
    json: bool = False
    """print one JSON object per row"""
    calls: int = 2000
    """calls timed for each per-call figure"""
    local_steps: int = 20
    """in-process steps per setting (auth on, off), alternating"""
    demo: bool = True
    """run the demo pairs too (whole swarms of processes; --no-demo: per-call and in-process figures only)"""


_FLAGS = Flags(AuthBench)

STREAM_ITEM_KIB = (64, 1024)
"""first stream items timed: a small activation, and the largest chunk (compression.framing.DEFAULT_CHUNK_BYTES)"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _FLAGS.add_to(parser)


def _median_us(fn, n: int) -> float:
    """Median microseconds of `n` calls of `fn`, none untimed (a proof is verified once: no warm-up call)."""
    return median_seconds(fn, repeats=n, warmup=0) * 1e6


def per_call_rows(calls: int) -> list[dict]:
    """Median sign and verify time of one call: the token alone, and the token with the call's proof."""
    from swarm.net.auth import CallSigner, CallVerifier, Identity
    from swarm.net.connect import method_path
    from swarm.proto import stage_pb2, wire_pb2

    caller, callee = Identity.generate(), Identity.generate()
    signer = CallSigner(caller)
    verifier = CallVerifier(callee.peer_id, replay_cache_size=max(4 * calls, 1024))
    token = signer.metadata(callee.peer_id)
    verifier.caller(token)  # the one RSA verification, outside the timing: later calls are a cache lookup
    rows = [
        {
            "part": "per_call", "call": "token only (before call proofs)", "fields_bytes": 0,
            "sign_us": _median_us(lambda: signer.metadata(callee.peer_id), calls),
            "verify_us": _median_us(lambda: verifier.caller(token), calls),
        }
    ]  # fmt: skip
    request = stage_pb2.StepRequest(step=1234, global_grad_norm=1.5, plan_version=3, attempt_id=77)
    cases = [("Step, unary", method_path("Step"), request.SerializeToString(), request)]
    for kib in STREAM_ITEM_KIB:
        info = stage_pb2.CallInfo(step=1234, micro_batch=3, stage=1, num_micro_batches=8, route=["a:1", "b:2"])
        header = wire_pb2.FrameHeader(body_bytes=kib << 10, raw_body_bytes=kib << 10, shape=[8, 64, 128])
        item = stage_pb2.StreamItem(info=info, chunk=wire_pb2.Chunk(header=header, data=bytes(kib << 10)))
        wire = item.SerializeToString()  # what the caller holds; the callee holds it parsed
        cases.append(
            (f"Forward, first item {kib} KiB", method_path("Forward"), wire, stage_pb2.StreamItem.FromString(wire))
        )
    for name, path, sent, parsed in cases:
        sign_us, verify_us = _time_proofs(signer, verifier, callee.peer_id, path, sent, parsed, calls)
        rows.append({"part": "per_call", "call": f"token + proof: {name}", "fields_bytes": len(sent),
                     "sign_us": sign_us, "verify_us": verify_us})  # fmt: skip
    return rows


def _time_proofs(signer, verifier, audience: str, path: str, sent: bytes, parsed, calls: int) -> tuple[float, float]:
    """Median us to sign a call (the caller holds `sent`) and to verify it (the callee holds `parsed`)."""
    made = []
    sign_us = _median_us(lambda: made.append(signer.metadata(audience, path, sent)), calls)
    pending = iter(made)  # each proof verified once: a second time would be a replay
    verify_us = _median_us(lambda: verifier.call(next(pending), path, parsed), calls)
    return sign_us, verify_us


def local_rows(steps: int) -> list[dict]:
    """Mean step time of an in-process 2-stage pipeline with authentication on and off, alternating."""
    import torch

    from swarm.model.data import Batch
    from swarm.model.gpt import ModelConfig
    from swarm.runtime.inprocess import LocalPipeline

    torch.set_num_threads(1)
    model = ModelConfig(vocab_size=256, seq_len_tokens=64, hidden_dim=64, n_layers=4, n_heads=4)
    pipes = {auth: LocalPipeline(model, 2, auth=auth) for auth in (True, False)}
    times: dict[bool, list[float]] = {True: [], False: []}
    gen = torch.Generator().manual_seed(0)
    verifiers = [s.target.verifier for s in (row[0] for row in pipes[True].switches)]
    calls_per_step = 0
    try:
        for i in range(steps + 1):
            w = torch.randint(0, model.vocab_size, (8, model.seq_len_tokens + 1), generator=gen)
            batch = Batch(torch.arange(8), w[:, :-1], w[:, 1:])
            for auth in (True, False) if i % 2 == 0 else (False, True):
                before = sum(len(v.replays) for v in verifiers)
                start = time.perf_counter()
                pipes[auth].train_step(batch, 4)
                if i > 0:  # the first step of each builds buffers and warms caches
                    times[auth].append(time.perf_counter() - start)
                if auth:
                    calls_per_step = sum(len(v.replays) for v in verifiers) - before
    finally:
        for pipe in pipes.values():
            pipe.close()
    return [
        {"part": "local", "auth": auth, "steps": len(times[auth]), "mean_step_s": statistics.mean(times[auth]),
         "median_step_s": statistics.median(times[auth]), "calls_per_step": calls_per_step if auth else 0}
        for auth in (True, False)
    ]  # fmt: skip


def _demo(auth: bool, epochs: int, out: Path) -> dict:
    from swarm.testbed.demo import demo_flags

    flags = demo_flags()
    demo = replace(flags.base, out=str(out), peer=replace(flags.base.peer, auth=auth))
    demo = replace(demo, train=replace(demo.train, epochs=epochs))
    argv = [sys.executable, "-m", "swarm.cli", "demo", "--json", *flags.to_argv(demo, always=["--epochs"])]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"swarm demo {'(auth)' if auth else '--no-auth'} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout)


def demo_rows(pairs: int, epochs: int) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="swarm-bench-auth-") as tmp:
        runs = [(i, auth) for i in range(pairs) for auth in (True, False)]
        for i, auth in tqdm(runs, desc="demo runs", file=sys.stderr):
            result = _demo(auth, epochs, Path(tmp) / f"{i}-{'auth' if auth else 'open'}")
            rows.append(
                {"part": "demo", "run": i, "auth": auth, "steps": result["steps"], "mean_step_s": result["mean_step_s"],
                 "final_loss": result["final_loss"]}
            )  # fmt: skip
    return rows


def summary_row(calls: list[dict], local: list[dict], demo: list[dict]) -> dict:
    token = calls[0]["sign_us"] + calls[0]["verify_us"]
    unary = calls[1]["sign_us"] + calls[1]["verify_us"]
    on = next(r for r in local if r["auth"])
    off = next(r for r in local if not r["auth"])
    summary = {
        "run": "summary",
        "proof_extra_us_per_unary_call": unary - token,
        "local_calls_per_step": on["calls_per_step"],
        "local_proof_share_of_step": (unary - token) * 1e-6 * on["calls_per_step"] / on["mean_step_s"],
        "local_auth_mean_step_s": on["mean_step_s"],
        "local_no_auth_mean_step_s": off["mean_step_s"],
        "local_ratio": on["mean_step_s"] / off["mean_step_s"],
    }
    if demo:
        with_auth = [r["mean_step_s"] for r in demo if r["auth"]]
        without = [r["mean_step_s"] for r in demo if not r["auth"]]
        summary.update(
            auth_mean_step_s=statistics.mean(with_auth), no_auth_mean_step_s=statistics.mean(without),
            auth_median_step_s=statistics.median(with_auth), no_auth_median_step_s=statistics.median(without),
            ratio=statistics.mean(with_auth) / statistics.mean(without),
        )  # fmt: skip
    return summary


def run(args: argparse.Namespace) -> int:
    bench = _FLAGS.from_args(args)
    pairs, epochs = (1, 1) if bench.quick else (bench.pairs, bench.epochs)
    calls = min(bench.calls, 200) if bench.quick else bench.calls
    steps = min(bench.local_steps, 6) if bench.quick else bench.local_steps
    per_call = per_call_rows(calls)
    local = local_rows(steps)
    demo = demo_rows(pairs, epochs) if bench.demo else []
    summary = summary_row(per_call, local, demo)
    if bench.json:
        for row in [*per_call, *local, *demo, summary]:
            print(json.dumps(row))
        return 0
    print_table(per_call, ["call", "fields_bytes", "sign_us", "verify_us"], "one call: sign and verify (median, us)")
    print_table(local, ["auth", "steps", "mean_step_s", "median_step_s", "calls_per_step"], "in-process 2-stage step")
    if demo:
        print_table(demo, ["run", "auth", "steps", "mean_step_s", "final_loss"], "swarm demo, auth on and off")
        print(
            f"demo mean step: {summary['auth_mean_step_s']:.4f} s with auth, {summary['no_auth_mean_step_s']:.4f} s "
            f"without: ratio {summary['ratio']:.3f} (target < 1.05)"
        )
    print(
        f"in-process step: ratio {summary['local_ratio']:.3f}; call proofs add "
        f"{summary['proof_extra_us_per_unary_call']:.0f} us a call x {summary['local_calls_per_step']} calls = "
        f"{100 * summary['local_proof_share_of_step']:.2f}% of a step"
    )
    return 0
