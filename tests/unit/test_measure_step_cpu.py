"""scripts/measure_step_cpu.py's accounting, without a run: which intervals count (after the first epoch, none
with a held-out evaluation), which process is whose, how a perf line's library reads, and the per-thread CPU a
step from /proc snapshots (pairs across an evaluation left out)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))
import measure_step_cpu as m  # noqa: E402


def _rows(times, evaluated=()):
    return [
        {
            "step": str(i + 1),
            "time": str(t),
            "machine_cpu_s": str(100 + t),
            "held_out_loss": "2.5" if i + 1 in evaluated else "",
        }
        for i, t in enumerate(times)
    ]


def test_intervals_skip_the_first_epoch_and_the_evaluations():
    rows = _rows([10.0, 10.1, 10.2, 10.3, 10.4, 11.4, 11.5], evaluated={5})
    # steps 1-2 are the first epoch (per_epoch 2), so the first interval is 3 -> 4, as the cells count theirs;
    # step 5's row carries an evaluation, so 5 -> 6 is left out
    assert m._intervals(rows, 2) == [(10.2, 10.3), (10.3, 10.4), (11.4, 11.5)]


def test_inside_finds_a_time_in_sorted_intervals_only():
    intervals = [(1.0, 2.0), (2.0, 3.0), (5.0, 6.0)]
    assert m._inside(intervals, 1.5) and m._inside(intervals, 2.0) and m._inside(intervals, 6.0)
    assert not m._inside(intervals, 0.5) and not m._inside(intervals, 4.0) and not m._inside(intervals, 6.5)


@pytest.mark.parametrize(
    ("cmd", "parent", "role"),
    [
        (["python", "-m", "swarm.daemon.peer", "--address-file", "b", "--host", "10.0.0.2"], None, "peer 10.0.0.2"),
        (["python", "-m", "swarm.cli", "train", "--address-file", "bootstrap.addr"], None, "trainer"),
        (["python", "-m", "swarm.cli", "bootstrap", "--address-file", "b.addr"], None, "bootstrap"),
        (["p2pd", "-listen=/unix/x.sock"], "peer 10.0.0.2", "p2pd of peer 10.0.0.2"),
        (["python", "-m", "swarm.experiments.torch_baseline", "--rank", "1"], None, "torch rank 1"),
        (["python", "-m", "swarm.cli", "experiment", "throttled", "--train-samples", "32"], None, "other"),
    ],
)
def test_role_of_each_process(cmd, parent, role):
    assert m._role(cmd, parent) == role


def test_library_names():
    assert m._library("/usr/lib/libtorch_cpu.so") == "libtorch_cpu.so"
    assert m._library("/x/grpc/_cython/cygrpc.cpython-311-x86_64-linux-gnu.so") == "cygrpc"
    assert m._library("/x/cryptography/hazmat/bindings/_rust.abi3.so") == "_rust"
    assert m._library("[JIT] tid 42") == m._library("/tmp/perf-42.map")


def test_by_thread_counts_clean_pairs_per_step():
    sampler = m.Sampler(root=0)
    sampler.roles = {7: "peer 10.0.0.2", 8: "other"}
    # one peer with two threads; the step interval is 0.1 s; a held-out evaluation ran between t=2.0 and t=2.6
    cpu = {0.0: (0.0, 0.0), 1.0: (0.5, 0.1), 2.0: (1.0, 0.2), 3.0: (3.0, 0.3), 4.0: (3.5, 0.4)}
    sampler.snaps = [(t, {7: {1: ("grpc_0", a), 2: ("swarm-dht", b)}, 8: {3: ("x", t)}}) for t, (a, b) in cpu.items()]
    intervals = [(0.1 * i, 0.1 * i + 0.1) for i in range(20)] + [(2.6 + 0.1 * i, 2.7 + 0.1 * i) for i in range(14)]
    table = m.by_thread(sampler, {7}, intervals, step_s=0.1)
    # pairs (0,1), (1,2) and (3,4) count: 1.5 s of grpc and 0.3 s of the DHT over 3 s, 0.1 s a step
    assert table["peer 10.0.0.2"]["grpc"] == pytest.approx(50.0)
    assert table["peer 10.0.0.2"]["swarm-dht"] == pytest.approx(10.0)
    assert table["peer 10.0.0.2"]["total"] == pytest.approx(60.0)
    assert "other" not in table
