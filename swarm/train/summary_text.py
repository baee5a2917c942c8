"""`swarm train`'s summary as text (`TrainSummary`, swarm/train/trainer.py), and its step-time spread."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from swarm.train.trainer import TrainSummary


def step_time_spread(times: list[float]) -> dict[str, float]:
    """The summary's median and 10th and 90th percentiles of the step times `times` (zeros without any)."""
    if not times:
        return {"median_step_s": 0.0, "step_s_p10": 0.0, "step_s_p90": 0.0}
    ordered = sorted(times)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

    return {"median_step_s": at(0.5), "step_s_p10": at(0.1), "step_s_p90": at(0.9)}


def format_summary(s: TrainSummary) -> str:
    """`swarm train`'s summary for people (`--json` prints the summary's fields)."""
    ratio = s.fp32_wire_bytes / max(1, s.wire_bytes)
    predicted = "no prediction (even split)" if s.predicted_step_s is None else f"{s.predicted_step_s:.2f} s/step"
    measured = s.median_step_s or s.mean_step_s
    known = s.predicted_step_s is not None and measured > 0
    off = f" (prediction {s.predicted_step_s / measured - 1:+.1%})" if known else ""
    if s.relay_extra_s is not None:
        off += f"; its relayed links add {s.relay_extra_s:.3f} s/step of it"
    spread = f" (10-90%: {s.step_s_p10:.2f}-{s.step_s_p90:.2f})" if s.step_s_p90 > 0 else ""
    return "\n".join(
        [
            f"steps:        {s.steps} in {s.seconds:.1f} s ({s.mean_step_s:.2f} s/step)",
            f"step time:    predicted {predicted}, measured {'median ' if s.median_step_s else ''}{measured:.2f} "
            f"s/step{spread}{off}",
            f"loss:         {s.first_loss:.3f} -> {s.final_loss:.3f} (mean of the last 5 steps)",
            *_held_out(s),
            f"wire bytes:   {s.wire_bytes / 1e6:.2f} MB; fp32: {s.fp32_wire_bytes / 1e6:.2f} MB ({ratio:.1f}x)",
            f"embedding:    {s.sync_bytes / 1e6:.2f} MB of tied-gradient sync between the end stages",
            f"total bytes:  {s.total_wire_bytes / 1e6:.2f} MB (boundaries + embedding + sums + control); fp32: "
            f"{s.fp32_total_wire_bytes / 1e6:.2f} MB ({s.total_ratio_vs_fp32:.1f}x)",
            *_state(s),
            f"stages:       {s.stages} at {', '.join(s.route)}"
            + (f" (plan {s.plan_version}, {s.replans} re-plans followed)" if s.plan_version else ""),
            f"outputs:      {s.csv}" + (f", {s.plot}" if s.plot else ""),
        ]
    )


def _state(s: TrainSummary) -> list[str]:
    """The stage state the peers moved (held copies, takeovers), beside the total, not in it."""
    if not s.state_bytes:
        return []
    return [f"stage state:  {s.state_bytes / 1e6:.2f} MB copied between peers (held copies, takeovers), not in it"]


def _held_out(s: TrainSummary) -> list[str]:
    """The held-out line: the last evaluation's loss, of which step, on how many windows (none when off)."""
    if not s.held_out_samples:
        return []
    if s.held_out_loss is None:
        return [f"held-out:     no evaluation succeeded ({s.held_out_samples} windows)"]
    last = "" if s.held_out_step == s.steps else f", not the last step {s.steps}: its evaluation failed"
    off = f" ({s.held_out_deferred} periodic ones put off: --eval-max-share)" if s.held_out_deferred else ""
    return [
        f"held-out:     loss {s.held_out_loss:.3f} on {s.held_out_samples} windows after step {s.held_out_step}"
        f"{last}{off}"
    ]
