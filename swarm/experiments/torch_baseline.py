"""PyTorch's own pipeline as a baseline of `swarm experiment throttled`: torch.distributed.pipelining (PipelineStage,
Schedule1F1B) over gloo, fp32, one process per stage, on the throttled cells' model, split, data and optimizer.

What is the same as a swarm fp32 cell: `ModelConfig()` from init seed 0, split by `split_layers` into the
cells' stages (`swarm.model.gpt.build_stage`, so every stage holds exactly the unsplit model's weights), the
data set and batch order of the trainer (`epoch_batches`, seed 0), the micro-batches, and the optimizer:
every stage is a `StageWorker` (AdamW, warm-up and cosine of `OptimConfig(total_steps=steps,
warmup_steps=WARMUP_SHARE of them)` as the cells' peers get, clipping by the global gradient norm).
Only the forward and backward passes and their transfers are torch's: `Schedule1F1B.step` on `PipelineStage`s.

The tied embedding: stage 0 holds the token embedding, the last stage an untied copy (`head_weight`, the same
initial values). After every step's backward the two ranks sum their gradients with one gloo `all_reduce`
(the sum applied to both, as swarm does), and every rank all-reduces its squared gradient norm (the copy
counted once) for the clipping. Both are counted in `total_wire_bytes`.

Bytes are counted from the tensors sent, since gloo counts nothing: per micro-batch, stage k < last sends
its output activation (forward hook: `numel * element_size`) and stage k > 0 the gradient of its input (the
same shape and dtype); per step, each member of the tied all-reduce sends one copy of the gradient (a ring
all-reduce of 2 members sends half the tensor twice), and each rank 8 bytes of its squared norm. TCP/IP and
gloo's own headers are not counted (nor are they in swarm's rows). Step times are taken on rank 0 from the
start of a step's schedule to the end of its optimizer step; every step ends with the collectives above, so
the ranks step together.

With `ThrottledConfig.netns` the ranks run in namespaces of the testbed (`swarm.testbed.netns.lay_out_testbed`,
`setup_commands`: a bridge, one namespace per service, every namespace's egress shaped by tbf at the rate,
as the swarm cells' links are); otherwise on loopback, unshaped. Every rank has a deadline for rendezvous
and collectives (gloo's timeout) and the parent one for the whole run: a failed or late rank gets every rank
of its run killed (process groups), and the namespaces are swept.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from swarm.report import free_port as _free_port  # a port below the kernel's ephemeral range

if TYPE_CHECKING:
    from swarm.experiments.throttled import ThrottledConfig

__all__ = ["SETTING", "TorchRun", "run_torch", "run_torch_rows", "summarize_torch"]

SETTING = "torch-fp32"
NETNS_PREFIX = "swtq-"
"""Default namespace and link prefix of the baseline's testbed (`ThrottledConfig.baseline_prefix`): not the swarm
cells' `swt-`, so both can be up."""
NETNS_SUBNET = "10.77.93.0/24"
GLOO_PORT = 29517


@dataclass(frozen=True)
class TorchRun:
    """One run of the baseline, as the rank processes receive it (JSON on their command line)."""

    stages: int = 2
    train_samples: int = 32
    batch_size: int = 8
    micro_batches: int = 4
    steps: int = 40
    seed: int = 0
    total_steps: int | None = None
    """Steps of the learning-rate schedule (None: `steps`): the slow rates run a prefix of the same schedule."""
    model: dict | None = None
    """ModelConfig fields (None: the defaults, as the throttled cells use)."""
    timeout_s: float = 120.0
    """gloo's bound on rendezvous and on every collective or transfer, seconds."""

    def __post_init__(self) -> None:
        for name in ("stages", "train_samples", "batch_size", "micro_batches", "steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"TorchRun.{name}: expected >= 1, got {getattr(self, name)}")
        if self.total_steps is not None and self.total_steps < self.steps:
            raise ValueError(f"TorchRun.total_steps: expected >= steps ({self.steps}), got {self.total_steps}")
        if self.stages < 2:
            raise ValueError("TorchRun.stages: torch's pipeline baseline needs at least 2 stages")
        if self.batch_size % self.micro_batches or self.train_samples < self.batch_size:
            raise ValueError("TorchRun: micro_batches must divide batch_size, and batch_size <= train_samples")
        if not self.timeout_s > 0:
            raise ValueError("TorchRun.timeout_s must be > 0")


# ---- one rank ---------------------------------------------------------------------------------------------


def _rank_main(rank: int, master: str, run: TorchRun, out: Path) -> None:
    """Stage `rank` of `run`: trains every step and writes one JSON line per step to `out`."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from swarm.model.data import DataConfig, build_datasets, epoch_batches
    from swarm.model.gpt import ModelConfig, build_stage, lm_loss, split_layers
    from swarm.runtime.worker import OptimConfig, StageConfig, StageWorker
    from swarm.train.steplog import machine_cpu_s

    torch.manual_seed(0)
    torch.set_num_threads(1)  # as swarm-peer (--threads 1 by default)
    cfg = ModelConfig(**(run.model or {}))
    n, last = run.stages, run.stages - 1
    start, end = split_layers(cfg.n_layers, n)[rank]
    module = build_stage(cfg, start, end, is_first=rank == 0, is_last=rank == last)
    from swarm.experiments.throttled import warmup_steps

    total = run.total_steps or run.steps
    optim = OptimConfig(total_steps=total, warmup_steps=warmup_steps(total))
    worker = StageWorker(module, StageConfig(optim))
    train_set, _, _ = build_datasets(
        DataConfig(seq_len_tokens=cfg.seq_len_tokens, train_samples=run.train_samples, eval_samples=0)
    )
    mb = run.batch_size // run.micro_batches
    # shapes of one micro-batch's input and output; activations (and their gradients) must be marked as needing
    # grad, or torch's stage neither sends nor receives a gradient for them
    act = torch.zeros(mb, cfg.seq_len_tokens, cfg.boundary_dim)
    tokens = torch.zeros(mb, cfg.seq_len_tokens, dtype=torch.int64)
    example_in = tokens if rank == 0 else act.clone().requires_grad_(True)
    example_out = (torch.zeros(mb, cfg.seq_len_tokens, cfg.vocab_size) if rank == last else act).requires_grad_(True)
    sent = {"forward": 0, "backward": 0}

    def count(_module, inputs, output) -> None:
        if rank < last:
            sent["forward"] += output.numel() * output.element_size()
        if rank > 0:  # this stage sends the gradient of its input back: the input's shape and dtype
            sent["backward"] += inputs[0].numel() * inputs[0].element_size()

    module.register_forward_hook(count)
    _refuse_pickled_objects(dist)
    addr, port = master.rsplit(":", 1)
    timeout = timedelta(seconds=run.timeout_s)
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=n, timeout=timeout)
    try:
        tied_group = dist.new_group([0, last], timeout=timeout)
        # shapes given up front: no shape inference, which would exchange pickled objects between the ranks
        stage = PipelineStage(module, rank, n, torch.device("cpu"), input_args=example_in, output_args=example_out)
        schedule = Schedule1F1B(stage, run.micro_batches, loss_fn=lm_loss, scale_grads=True)
        steps_per_epoch = len(train_set) // run.batch_size
        with open(out, "w") as f:
            for step in range(run.steps):
                epoch, index = divmod(step, steps_per_epoch)
                batch = list(epoch_batches(train_set, run.batch_size, epoch, run.seed))[index]
                sent["forward"] = sent["backward"] = 0
                t0 = time.perf_counter()
                losses: list[torch.Tensor] = []
                if rank == 0:
                    schedule.step(batch.tokens)
                elif rank == last:
                    schedule.step(target=batch.targets, losses=losses)
                else:
                    schedule.step()
                t1 = time.perf_counter()
                tied_bytes = 0
                if rank in (0, last):
                    grad = worker.tied_grad()
                    dist.all_reduce(grad, group=tied_group)
                    worker.set_tied_grad(grad)
                    tied_bytes = grad.numel() * grad.element_size()
                sq = torch.tensor([worker.grad_sq_norm()], dtype=torch.float64)
                dist.all_reduce(sq)
                t2 = time.perf_counter()
                lr = worker.step(math.sqrt(float(sq)))
                seconds = time.perf_counter() - t0
                loss = float(torch.stack([x.detach() for x in losses]).mean()) if losses else None
                record = {"step": step + 1, "epoch": epoch, "step_s": seconds, "loss": loss, "lr": lr}
                # as swarm's steps.csv: when it ended and the machine's busy CPU then (`throttled`'s CPU a step)
                record |= {"time": round(time.time(), 3), "machine_cpu_s": machine_cpu_s()}
                # where the step went: torch's schedule (compute and boundary transfers), the two all-reduces
                record |= {"schedule_s": t1 - t0, "sync_s": t2 - t1}
                record |= {"forward_bytes": sent["forward"], "backward_bytes": sent["backward"]}
                record |= {"tied_bytes": tied_bytes, "control_bytes": sq.numel() * sq.element_size()}
                f.write(json.dumps(record) + "\n")
                f.flush()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _refuse_pickled_objects(dist) -> None:
    """torch's object collectives unpickle what a peer sends; nothing from the network is ever unpickled here, so
    they raise (the stages get their shapes up front, which keeps torch's pipelining on tensors only)."""

    def refuse(*_args, **_kwargs):
        raise RuntimeError("torch baseline: an object collective would unpickle a peer's bytes; refused")

    for name in ("recv_object_list", "broadcast_object_list", "all_gather_object", "gather_object",
                 "scatter_object_list"):  # fmt: skip
        setattr(dist, name, refuse)


# ---- the runs ---------------------------------------------------------------------------------------------


def _kill(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)


def _tail(path: Path, lines: int = 12) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


def run_torch(
    run: TorchRun, out: Path, places: Sequence[tuple[list[str], str]], master: str, deadline_s: float
) -> list[dict]:
    """Starts one process per stage and waits for all of them; returns the merged per-step records.

    Args:
        run: what to train.
        out: folder for the ranks' logs and step records.
        places: per rank, the argv prefix that places it (`[]`, or `ip netns exec NS`) and its gloo interface.
        master: `ADDR:PORT` of rank 0's rendezvous.
        deadline_s: bound on the whole run; past it, or when a rank fails, every rank is killed.
    """
    out.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen] = []
    spec = json.dumps(asdict(run))
    try:
        for rank, (prefix, ifname) in enumerate(places):
            argv = [*prefix, sys.executable, "-m", "swarm.experiments.torch_baseline", "--rank", str(rank)]
            argv += ["--master", master, "--run", spec, "--out", str(out / f"rank{rank}.jsonl")]
            env = {**os.environ, "GLOO_SOCKET_IFNAME": ifname, "PYTHONUNBUFFERED": "1"}
            with open(out / f"rank{rank}.log", "w") as log:
                procs.append(
                    subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True, env=env)
                )  # fmt: skip
        until = time.monotonic() + deadline_s
        pending = list(enumerate(procs))
        while pending:
            rank, proc = pending[0]
            try:
                code = proc.wait(timeout=min(0.5, max(until - time.monotonic(), 0.01)))
            except subprocess.TimeoutExpired:
                if time.monotonic() > until:
                    raise TimeoutError(f"torch baseline: rank {rank} still running after {deadline_s:.0f} s") from None
                pending.append(pending.pop(0))  # look at the others: one that failed must stop the run at once
                continue
            if code:
                raise RuntimeError(f"torch baseline: rank {rank} exited with {code}:\n{_tail(out / f'rank{rank}.log')}")
            pending.pop(0)
    finally:
        _kill(procs)
    files = [out / f"rank{r}.jsonl" for r in range(run.stages)]
    ranks = [[json.loads(line) for line in file.read_text().splitlines()] for file in files]
    merged = []
    for records in zip(*ranks, strict=True):
        row = dict(records[0])  # rank 0's step time
        row["loss"] = records[-1]["loss"]
        for key in ("forward_bytes", "backward_bytes", "tied_bytes", "control_bytes"):
            row[key] = sum(r[key] for r in records)
        merged.append(row)
    return merged


def summarize_torch(rate_mbit: float | None, records: list[dict], steps_per_epoch: int, batch_size: int) -> dict:
    """The throttled row of one baseline run (the keys and windows of `throttled.summarize`)."""
    from swarm.train.steplog import machine_cpu

    times = [r["step_s"] for r in records]
    steady = times[steps_per_epoch:] or times
    losses = [r["loss"] for r in records]
    wire = sum(r["forward_bytes"] + r["backward_bytes"] for r in records)
    total = wire + sum(r["tied_bytes"] + r["control_bytes"] for r in records)
    directions = ("forward_bytes", "backward_bytes")
    return {
        "rate_mbit": rate_mbit,
        "setting": SETTING,
        "fw_bits": 32,
        "bw_bits": 32,
        "mean_step_s": statistics.mean(steady),
        "first_epoch_step_s": statistics.mean(times[:steps_per_epoch]),
        "throughput_samples_per_s": batch_size / statistics.mean(steady),
        "wire_bytes": wire,
        "fp32_wire_bytes": wire,
        "wire_bytes_per_step": wire / len(records),
        "sync_bytes": sum(r["tied_bytes"] for r in records),
        "control_bytes": sum(r["control_bytes"] for r in records),
        "total_wire_bytes": total,
        "fp32_total_wire_bytes": total,
        "total_ratio_vs_fp32": 1.0,
        "busiest_direction_bytes_per_step": max(statistics.mean(r[k] for r in records) for k in directions),
        # rank 0's mean, steps after the first epoch: torch's schedule (compute, boundary transfers), all-reduces
        "schedule_step_s": statistics.mean(r["schedule_s"] for r in records[steps_per_epoch:] or records),
        "sync_step_s": statistics.mean(r["sync_s"] for r in records[steps_per_epoch:] or records),
        "first_loss": losses[0],
        "final_loss": statistics.mean(losses[-steps_per_epoch:]),
        "steps": len(records),
        # rank 0's rows, steps after the first epoch: the machine's CPU a step (both ranks' and anything else's)
        **machine_cpu(records[steps_per_epoch:] or records),
    }


def _label(rate: float | None) -> str:
    return "unshaped" if rate is None else f"{rate:g}mbit"


def run_torch_rows(
    cfg: ThrottledConfig, rates: Sequence[float | None], out: Path, say: Callable[[str], None] = print
) -> list[dict]:
    """One `torch-fp32` row per link speed, from runs of PyTorch's pipeline on the cells' model and data.

    With `cfg.netns` (root), each run's ranks sit in the namespaces of a testbed shaped to the rate (the rate
    None: unshaped); otherwise they run on loopback, unshaped whatever the rate (for tests)."""
    from swarm.experiments.throttled import Cell

    steps_per_epoch = cfg.train_samples // cfg.batch_size
    rows = []
    for rate in rates:
        steps = cfg.steps_of(Cell(rate, "fp32/fp32"))  # the swarm cells' steps at this rate, same schedule
        run = TorchRun(
            stages=cfg.peers, train_samples=cfg.train_samples, batch_size=cfg.batch_size,
            micro_batches=cfg.micro_batches, steps=steps, total_steps=cfg.steps,
        )  # fmt: skip
        deadline_s = 120.0 + 60.0 * steps
        folder = out / f"{_label(rate)}-torch-fp32"
        say(f"torch baseline: {steps} steps, {_label(rate)}{' (netns)' if cfg.netns else ' (loopback)'}")
        if cfg.netns:
            records = _run_in_namespaces(run, rate, folder, deadline_s, cfg.baseline_prefix)
        else:
            places = [([], "lo")] * run.stages
            records = run_torch(run, folder, places, f"127.0.0.1:{_free_port()}", deadline_s)
        rows.append(summarize_torch(rate, records, steps_per_epoch, cfg.batch_size))
    return rows


def _run_in_namespaces(
    run: TorchRun, rate: float | None, out: Path, deadline_s: float, prefix: str = NETNS_PREFIX
) -> list[dict]:
    from swarm.testbed.netns import (
        check_available,
        lay_out_testbed,
        list_links,
        list_namespaces,
        run_command,
        setup_commands,
        sweep,
    )
    from swarm.testbed.services import Egress, TestbedConfig

    check_available()
    if list_namespaces(prefix) or list_links(prefix):
        sweep(prefix, grace_s=2)  # left by a killed run of this baseline: the prefix is its own
    cfg = TestbedConfig(peers=run.stages, egress=Egress(rate or 0.0), prefix=prefix, subnet=NETNS_SUBNET)
    layout = lay_out_testbed(cfg, str(out))
    try:
        for command in setup_commands(layout):
            run_command(command)
        nodes = [layout.node(f"peer{i}") for i in range(run.stages)]
        places = [(["ip", "netns", "exec", node.namespace], node.veth_ns) for node in nodes]
        return run_torch(run, out, places, f"{nodes[0].service.address}:{GLOO_PORT}", deadline_s)
    finally:
        sweep(prefix, grace_s=2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one rank of the torch pipeline baseline (started by run_torch)")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--master", required=True, help="ADDR:PORT of rank 0's rendezvous")
    parser.add_argument("--run", required=True, help="the TorchRun as JSON")
    parser.add_argument("--out", type=Path, required=True, help="file for the per-step JSON lines")
    args = parser.parse_args(argv)
    run = TorchRun(**json.loads(args.run))
    if not 0 <= args.rank < run.stages:
        parser.error(f"--rank {args.rank} outside 0..{run.stages - 1}")
    _rank_main(args.rank, args.master, run, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
