"""`swarm experiment hetero` on processes: a local swarm of swarm-peer daemons, one of them really slower, and
what the planner's per-stage precision (`--precision-budget`, QSync) recovers of what it costs.

Each setting is a fresh local swarm (`swarm.testbed.local_swarm`: a bootstrap node, `--peers` swarm-peer processes
planning among themselves, and `swarm train` in this process following their plans through the DHT):

- `equal`: every peer as fast as the machine, fp32 everywhere;
- `slow-fp32`: one peer `--slow-factor` x slower (`swarm-peer --compute-slowdown`: it sleeps N - 1 times the
  wall time of each forward and backward, and announces its measured speeds / N), fp32 everywhere;
- `slow-planned`: the same slow peer, and every peer's planner with `--precision-budget`: it chooses each stage's
  precision from the announced speeds and sensitivities (its own measurement until the stages announce theirs from
  real gradients, `swarm.runtime.sensitivity_probe`; it re-chooses when they do, `swarm.daemon.precision_watch`);
- `slow-placed` (with `--placement`): the slow peer, fp32, the planner free to split the layers unevenly by the
  announced speeds. This is placement, not precision: shown beside it so that what recovers what is plain.

The first three plan an even layer split (`--plan-even-layers`), so the stage boundaries, hence the training math,
are the same and only speed and precision differ. Throughput is the batch over the mean step time after the first
`--warm-fraction` of the steps; the held-out loss is the trainer's final evaluation (`swarm.train.heldout`).
`recovered` = (setting - slow-fp32) / (equal - slow-fp32) samples/s; `slow_cost` = 1 - slow-fp32 / equal.

The settings run `--repeats` rounds, interleaved (round k starts at setting k): on a shared machine a neighbour's
load then falls on every setting alike; throughputs are the median of the rounds, each ratio the median of the
per-round ratios, the loss the first round's (the rounds compute the same thing).
"""

from __future__ import annotations

import csv
import json
import statistics
from dataclasses import replace
from pathlib import Path

__all__ = ["SWARM_SETTINGS", "run_swarm_experiment"]

SWARM_SETTINGS = ("equal", "slow-fp32", "slow-planned")
PLACED = "slow-placed"


def _peer_config(cfg, setting: str, steps: int):
    """Every peer's config in `setting` (the slow one adds --compute-slowdown)."""
    from swarm.daemon.peer_config import PeerConfig, PlanningConfig

    mb = max(1, cfg.batch_size // cfg.n_micro)
    planning = PlanningConfig(
        even_layers=setting != PLACED,
        micro_batch_size=mb,
        micro_batches=cfg.n_micro,
        probe_links=False,  # same peers, same plan: run after run (no link measurement moves a boundary)
        codec_policy="fixed",  # the setting's codecs on every link
        precision_budget=cfg.budget if setting == "slow-planned" else 0.0,
    )
    optim = replace(cfg.optim, total_steps=steps, warmup_steps=max(1, round(steps * 0.2)))
    return PeerConfig(assign="plan", num_stages=cfg.n_stages, planning=planning, model=cfg.model, optim=optim)


def _run_setting(cfg, setting: str, out: Path, steps: int, say) -> dict:
    from swarm.daemon.peer_config import peer_flags
    from swarm.testbed.local import local_swarm
    from swarm.train.trainer import TrainConfig, train

    flags = peer_flags().to_argv(_peer_config(cfg, setting, steps))
    slow = [] if setting == "equal" else ["--compute-slowdown", repr(cfg.slow_factor)]
    own = [slow if i == cfg.slow_peer else [] for i in range(cfg.n_stages)]
    train_cfg = TrainConfig(
        model=cfg.model,
        data=cfg.data.path,
        train_samples=cfg.data.train_samples,
        eval_samples=cfg.data.eval_samples,
        eval_every=0,
        batch_size=cfg.batch_size,
        micro_batches=cfg.n_micro,
        steps=steps,
        seed=cfg.seed,
        setting=setting,
        deadline_s=300.0,
        out=str(out),
    )
    with local_swarm(out, cfg.n_stages, flags, say, timeout_s=180.0, per_peer_flags=own) as swarm:
        summary = train(train_cfg, swarm.path, quiet=True, signer=swarm.signer, dht=swarm.dht)
        record = swarm.dht.get_plan(cfg.model.n_layers)
        peers = {p.peer_id: p for p in swarm.dht.peers()}
    plan = record.document
    # the slow peer announces the lowest speed (its measured ones / N); in `equal` none is slow
    slowest = min(peers.values(), key=lambda p: p.compute_layers_per_s).peer_id
    slow_ids = set() if setting == "equal" else {slowest}
    with open(out / "steps.csv") as f:
        rows = list(csv.DictReader(f))
    times = [float(r["step_s"]) for r in rows]
    steady = times[max(1, round(len(times) * cfg.warm_fraction)) :] or times
    return {
        "setting": setting,
        "throughput_samples_s": cfg.batch_size / statistics.mean(steady),
        "mean_step_s": statistics.mean(steady),
        "final_eval_loss": summary.held_out_loss,
        "final_train_loss": statistics.mean(float(r["train_loss"]) for r in rows[-5:]),
        "precisions": list(plan.precisions or ("fp32",) * plan.n_stages),
        "layers": [[s.layer_start, s.layer_end] for s in plan.stages],
        "slow_stages": [i for i, s in enumerate(plan.stages) if slow_ids & set(s.peer_ids)],
        "plan_versions": sorted({int(r["plan_version"]) for r in rows}),
        "announced_sensitivity": {f"{a}:{b}": {p: f} for ann in peers.values() for a, b, p, f in ann.sensitivity},
        # every peer's announced layers/s (the slow one's / N): on this CPU bf16 is faster than fp32 for everyone
        "peer_speeds": sorted(({"fp32": p.compute_layers_per_s, **dict(p.speeds)} for p in peers.values()), key=str),
        "steps": len(rows),
        "window_steps": len(steady),
    }


def _attempts(cfg, setting: str, out: Path, steps: int, say, tries: int = 3) -> dict:
    """`_run_setting`, run again from scratch (a fresh swarm, the same seed) when the swarm fails: on a machine
    loaded far past its cores a live peer can miss the trainer's heartbeats and be declared dead, and a step
    retried on it is refused as already run. The row says how many tries it took (`attempts`)."""
    from swarm.net.stream import StageCallError

    for attempt in range(1, tries + 1):
        try:
            row = _run_setting(
                cfg, setting, out if attempt == 1 else out.with_name(f"{out.name}-try{attempt}"), steps, say
            )
            return {**row, "attempts": attempt}
        except (StageCallError, TimeoutError, RuntimeError) as e:
            if attempt == tries:
                raise
            say(f"  {setting} failed ({type(e).__name__}: {str(e)[:200]}); starting it again from scratch")
    raise AssertionError("unreachable")


def run_swarm_experiment(cfg, out: Path, say=print) -> list[dict]:
    """The settings on processes (see the module docstring); rows in `SWARM_SETTINGS` order (+ slow-placed)."""
    from swarm.experiments import rotated

    settings = SWARM_SETTINGS + ((PLACED,) if cfg.placement else ())
    steps = cfg.data.train_samples // cfg.batch_size * cfg.epochs
    rounds: dict[str, list[dict]] = {s: [] for s in settings}
    for k in range(cfg.repeats):
        for setting in rotated(settings, k):
            say(f"round {k + 1}/{cfg.repeats}: {setting} ({steps} steps)")
            row = _attempts(cfg, setting, out / f"round{k}" / setting, steps, say)
            say(
                f"  {row['throughput_samples_s']:.2f} samples/s, held-out {row['final_eval_loss']}, {row['precisions']}"
            )
            rounds[setting].append(row)
    rows = []
    for setting in settings:
        first = dict(rounds[setting][0])
        first["throughput_samples_s"] = statistics.median(r["throughput_samples_s"] for r in rounds[setting])
        first["round_throughputs"] = [r["throughput_samples_s"] for r in rounds[setting]]
        rows.append(first)
    equal, slow = rounds["equal"], rounds["slow-fp32"]
    for row in rows:
        mine = rounds[row["setting"]]
        rec = [
            (m["throughput_samples_s"] - s["throughput_samples_s"])
            / (e["throughput_samples_s"] - s["throughput_samples_s"])
            for m, s, e in zip(mine, slow, equal, strict=True)
            if e["throughput_samples_s"] > s["throughput_samples_s"]
        ]
        row["recovered"] = statistics.median(rec) if rec else None
        row["recovered_rounds"] = rec
        row["slow_cost"] = statistics.median(
            1 - s["throughput_samples_s"] / e["throughput_samples_s"] for s, e in zip(slow, equal, strict=True)
        )
        base = rows[1]["final_eval_loss"]
        row["loss_vs_slow_fp32"] = row["final_eval_loss"] / base - 1 if row["final_eval_loss"] and base else None
    (out / "rows.json").write_text(json.dumps(rows, indent=2))
    return rows
