"""`swarm bench idle`'s rows from two readings: each process's CPU over the window, a sum per peer with its p2pd,
the swarm's total; a process that ended in the window is left out, never counted as zero."""

from __future__ import annotations

import pytest

from swarm.bench.idle import cpu_rows


def test_rows_are_each_processs_window_and_the_sums_per_peer_and_swarm():
    names = {1: ("bootstrap", "bootstrap"), 2: ("peer0", "peer"), 3: ("peer0/p2pd", "p2pd"), 4: ("peer1", "peer")}
    before = {1: 10.0, 2: 5.0, 3: 1.0, 4: 7.0}
    after = {1: 10.5, 2: 8.0, 3: 2.5}  # peer1 ended in the window
    rows = cpu_rows(before, after, names, seconds=10.0)
    by = {(r["process"], r["role"]): r for r in rows}
    assert ("peer1", "peer") not in by and ("peer1", "sum") not in by, "an ended process is left out"
    assert by[("peer0", "peer")]["cpu_s"] == 3.0 and by[("peer0", "peer")]["core_pct"] == 30.0
    assert by[("peer0", "sum")]["cpu_s"] == pytest.approx(4.5) and by[("bootstrap", "sum")]["cpu_s"] == 0.5
    assert by[("swarm", "total")]["cpu_s"] == pytest.approx(5.0) and by[("swarm", "total")]["core_pct"] == 50.0
