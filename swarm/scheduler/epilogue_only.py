"""Epilogue-only compression, planned: which backward messages to compress, from measured stage and link timings.

The inputs are what a planner measures: each stage's forward and backward compute of one micro-batch (seconds),
each boundary's rate and one-way latency, and the bytes of one micro-batch's forward message and of its backward
message at the precise and at the compressed codec (`sizes.message_bytes`). `choose_epilogue_only` plays the
schedule on `swarm.runtime.epilogue`'s clock and keeps compressed only the messages whose transfer would lengthen
the step by more than `tolerance` (a share of it) against compressing every one; it reports the three predicted
steps (all compressed, the chosen set, all precise) and the step's split (compute, exposed transfer), which the
experiments print beside what they measure.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from swarm.runtime.epilogue import EpiloguePlan, StageTimes, derive_tails, exposed_messages, step_time_s

__all__ = ["EpilogueOnlyChoice", "choose_epilogue_only", "link_times"]

DEFAULT_TOLERANCE = 0.01
"""The chosen set may make the predicted step at most 1% longer than compressing every backward message."""


def link_times(
    compute_s: Sequence[tuple[float, float]],
    bytes_per_s: Sequence[float],
    latency_s: Sequence[float],
    forward_bytes: float,
    precise_bytes: float,
    compressed_bytes: float,
) -> StageTimes:
    """`StageTimes` from measured figures: `compute_s[s]` = (forward, backward) of stage s; per boundary its rate
    (bytes/s, both ways) and one-way latency; one micro-batch's message bytes."""
    n = len(compute_s)
    if len(bytes_per_s) != n - 1 or len(latency_s) != n - 1:
        raise ValueError(f"{n} stages need {n - 1} link rates and latencies")
    if any(not r > 0 for r in bytes_per_s):
        raise ValueError(f"link rates must be > 0 bytes/s, got {list(bytes_per_s)}")
    send = lambda nbytes: tuple(lat + nbytes / r for r, lat in zip(bytes_per_s, latency_s, strict=True))  # noqa: E731
    return StageTimes(
        tuple(f for f, _ in compute_s),
        tuple(b for _, b in compute_s),
        send(forward_bytes),
        send(precise_bytes),
        send(compressed_bytes),
    )


@dataclass(frozen=True)
class EpilogueOnlyChoice:
    """What the planner chose and what it predicts."""

    plan: EpiloguePlan
    """The compressed tails, for the schedule and micro-batch count chosen for."""
    compressed_s: float
    """The predicted step (pipeline only) with every backward message compressed."""
    chosen_s: float
    """... with only `plan`'s messages compressed."""
    precise_s: float
    """... with none compressed."""
    compute_s: float
    """The busiest stage's compute over the step (the step's floor)."""
    exposed: int
    """Backward messages compressed, of `total`."""
    total: int

    @property
    def why(self) -> str:
        return (
            f"compress {self.exposed}/{self.total} backward messages ({self.plan.describe()}): predicted "
            f"{self.chosen_s:.3f}s vs {self.compressed_s:.3f}s all compressed, {self.precise_s:.3f}s none; "
            f"compute {self.compute_s:.3f}s"
        )

    def row(self) -> dict:
        """The figures as a report's columns (the step's split: compute, and what the transfers add)."""
        return {
            "tails": ",".join(map(str, self.plan.tails or ())),
            "compressed_messages": self.exposed,
            "backward_messages": self.total,
            "predicted_all_s": round(self.compressed_s, 4),
            "predicted_epilogue_s": round(self.chosen_s, 4),
            "predicted_none_s": round(self.precise_s, 4),
            "predicted_compute_s": round(self.compute_s, 4),
            "predicted_transfer_s": round(self.chosen_s - self.compute_s, 4),
        }


def choose_epilogue_only(
    schedule: str, n_micro: int, times: StageTimes, tolerance: float = DEFAULT_TOLERANCE
) -> EpilogueOnlyChoice:
    """The fewest backward messages to compress (a tail per boundary, `derive_tails`) for a step at most
    `tolerance` longer than with all of them compressed, and the predicted steps."""
    if not 0 <= tolerance < 1:
        raise ValueError(f"tolerance must be in [0, 1), got {tolerance}")
    n = times.n_stages
    tails = derive_tails(schedule, n_micro, times, tolerance)
    chosen = set(exposed_messages(schedule, n, n_micro, tails))
    every = {(b, m) for b in range(n - 1) for m in range(n_micro)}
    compute = max(n_micro * (f + b) for f, b in zip(times.forward_s, times.backward_s, strict=True))
    return EpilogueOnlyChoice(
        EpiloguePlan(tails, schedule, n_micro),
        step_time_s(schedule, n_micro, times, every),
        step_time_s(schedule, n_micro, times, chosen),
        step_time_s(schedule, n_micro, times, set()),
        compute,
        len(chosen),
        len(every),
    )
