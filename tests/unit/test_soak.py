"""`swarm bench soak`'s verdict on threads and fds: a count's floor, not two samples."""

from __future__ import annotations

import pytest

from swarm.bench.soak import ProcessSample, _Series, floors


def _series(threads: list[int], fds: list[int] | None = None, rss: float = 100.0) -> _Series:
    fds = fds or [10] * len(threads)
    series = _Series()
    for i, (t, f) in enumerate(zip(threads, fds, strict=True)):
        series.steps.append(1000 + 10 * i)
        series.samples.append(ProcessSample(rss, t, f, 1))
    return series


def test_threads_that_come_and_go_with_the_steps_are_flat_whatever_the_last_sample_caught():
    # a trainer: 14 threads of its own, up to 6 more while a step's calls run; the last sample caught 20
    counts = [14, 17, 14, 16, 14, 20, 15, 14, 18, 14] * 10 + [20]
    row = _series(counts).row("trainer")
    assert (row["threads_start"], row["threads_end"]) == (14, 20)  # two samples differ ...
    assert (row["threads_floor_start"], row["threads_floor_end"]) == (14, 14)  # ... the floor does not
    assert row["threads_max"] == 20 and row["verdict"] == "PASS"


@pytest.mark.parametrize("what", ["threads", "fds"])
def test_a_thread_or_fd_never_given_back_fails_the_verdict(what):
    counts = [14, 17, 14, 16] * 25 + [15, 18, 15, 16] * 25  # one more thread (or fd) held from mid-run on
    series = _series(counts) if what == "threads" else _series([14] * len(counts), fds=counts)
    row = series.row("peer0")
    assert row[f"{what}_floor_start"] == 14 and row[f"{what}_floor_end"] == 15
    assert row["verdict"] == "FAIL"


def test_floors_take_the_least_count_of_each_end_and_at_least_one_sample():
    assert floors([5, 3, 9, 9, 9, 9, 9, 9, 9, 9, 9, 4, 8], fraction=0.25) == (3, 4)
    assert floors([7]) == (7, 7)
    assert floors([3, 9]) == (3, 9)  # one sample each: a rise between two samples still fails
    with pytest.raises(ValueError, match="no values"):
        floors([])


def test_the_rss_slope_still_decides_alone():
    series = _series([14] * 50)
    for i, sample in enumerate(series.samples):  # 1 MiB per 1000 steps: 10 steps a sample
        series.samples[i] = ProcessSample(100.0 + 0.01 * i, sample.threads, sample.fds, 1)
    row = series.row("peer0")
    assert row["rss_slope_mib_per_1k_steps"] == pytest.approx(1.0) and row["verdict"] == "FAIL"


def test_a_risen_thread_count_names_the_kind_of_thread_that_rose():
    # 120 interpreter threads throughout; gRPC's event engine holds one more from mid-run on
    series = _Series()
    for i in range(100):
        engine = 4 if i < 50 else 5
        names = (("event_engine", engine), ("python3", 120))
        series.steps.append(1000 + 10 * i)
        series.samples.append(ProcessSample(300.0, 120 + engine, 19, 1, thread_names=names))
    row = series.row("peer1")
    assert row["verdict"] == "FAIL" and row["threads_grew"] == {"event_engine": [4, 5]}
    assert row["process"] == "peer1", "the row names its process, not a thread"
    assert _series([14] * 50).row("peer0")["threads_grew"] == {}, "nothing grew: nothing named"


def test_a_process_tree_is_sampled_with_its_threads_names_and_summed_by_name():
    import os
    import threading

    from swarm.bench.soak import sample_tree, summed, thread_names

    started, stop = threading.Event(), threading.Event()

    def hold() -> None:
        started.set()
        stop.wait(60)

    worker = threading.Thread(target=hold, daemon=True)
    worker.start()
    started.wait(10)
    try:
        mine = dict(thread_names(os.getpid()))
        tree = sample_tree(os.getpid())
    finally:
        stop.set()
        worker.join(10)
    assert sum(mine.values()) >= 2, mine  # this thread and the held one at least
    total = summed(tree)
    assert total is not None and sum(dict(total.thread_names).values()) >= sum(mine.values())
    assert thread_names(2**22 + 7) == (), "a process that is gone reads as no threads"
