"""`swarm train`'s summary names the stage state its peers copied to each other (held copies, takeovers) beside the
run's total, from the live peers' Status counters: a liar's or a dead peer's figure is left out, never summed."""

from __future__ import annotations

from types import SimpleNamespace

from swarm.train.trainer import TrainSummary, format_summary, peers_state_bytes


def reply(**metrics) -> SimpleNamespace:
    return SimpleNamespace(metrics=metrics)


class Driver:
    def __init__(self, rows):
        self.rows = rows

    def replica_status(self, timeout_s: float = 10.0):
        assert timeout_s <= 2.0, "the summary waits briefly on each peer"
        if isinstance(self.rows, Exception):
            raise self.rows
        return self.rows


def test_the_live_peers_counts_are_summed_and_lies_left_out():
    rows = [
        [reply(swarm_state_bytes_total=5_000_000.0), None],  # a dead replica: no reply
        [reply(swarm_state_bytes_total=2_500_000.0), reply(swarm_steps_total=3.0)],  # one never sent state
        [reply(swarm_state_bytes_total=-1.0), reply(swarm_state_bytes_total=float("inf"))],  # lies
        [reply(swarm_state_bytes_total=2.0**60)],
    ]
    assert peers_state_bytes(Driver(rows)) == 7_500_000
    assert peers_state_bytes(Driver([[None], [reply(swarm_steps_total=1.0)]])) is None, "nobody said"
    assert peers_state_bytes(Driver(TimeoutError("Status: deadline"))) is None, "the summary is written anyway"


def test_the_summary_prints_it_beside_the_total_not_in_it():
    base = dict(first_loss=5.0, final_loss=4.0, steps=3, wire_bytes=1, fp32_wire_bytes=4, sync_bytes=0)
    base |= dict(mean_step_s=0.3, seconds=1.0, stages=2, route=["a:1"], plan_version=2, replans=0, csv="c", plot=None)
    text = format_summary(TrainSummary(**base, total_wire_bytes=100, fp32_total_wire_bytes=400, state_bytes=5_325_991))
    assert "stage state:  5.33 MB copied between peers" in text and "(4.0x)" in text
    assert "stage state" not in format_summary(TrainSummary(**base, state_bytes=None))
