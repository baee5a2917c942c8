"""HotPool: tasks go to the most recently idle thread, so the threads that ever run anything are the most ever
needed at once (issue 28's slow growth: each thread that computes keeps native caches)."""

from __future__ import annotations

import sys
import threading
from concurrent import futures

import pytest

from swarm.peers.hotpool import HotPool

WAIT_S = 60.0  # generous: a loaded machine


def _threads_named(prefix: str) -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith(prefix))


@pytest.fixture
def pool():
    pool = HotPool(16, thread_name_prefix="hotpool_test")
    yield pool
    pool.shutdown(cancel_futures=True)


def test_every_thread_starts_at_once_and_one_after_another_calls_use_one_thread(pool):
    assert _threads_named("hotpool_test") == 16
    ran_on = {pool.submit(threading.get_ident).result(WAIT_S) for _ in range(500)}
    assert len(ran_on) == 1 and pool.threads_used() == 1
    assert _threads_named("hotpool_test") == 16


def test_a_thread_is_idle_again_before_its_caller_learns_the_result(pool):
    """The caller's next task must find the thread that just finished on the idle stack, even when the interpreter
    switches threads between the result being set and the worker getting back to the stack (a loaded machine; here
    forced by a 1 us switch interval and two spinning threads). The pool before the fix failed 4 runs in 5."""
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    spinners = [threading.Thread(target=spin) for _ in range(2)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for t in spinners:
            t.start()
        for _ in range(3000):
            pool.submit(threading.get_ident).result(WAIT_S)
    finally:
        sys.setswitchinterval(interval)
        stop.set()
        for t in spinners:
            t.join(WAIT_S)
    assert pool.threads_used() == 1


def test_the_threads_used_are_the_most_tasks_ever_in_flight_at_once(pool):
    for burst in range(50):  # 3 tasks at once, 50 times: always the same 3 threads
        together = threading.Barrier(3)
        done = [pool.submit(together.wait, WAIT_S) for _ in range(3)]
        for f in done:
            f.result(WAIT_S)
        assert pool.threads_used() == 3, f"burst {burst}"
    for _ in range(100):  # then one at a time: still within those 3
        pool.submit(lambda: None).result(WAIT_S)
    assert pool.threads_used() == 3


def test_a_task_submitted_while_every_thread_is_busy_runs_when_one_is_free_in_order():
    pool = HotPool(2, thread_name_prefix="hotpool_busy")
    try:
        release = threading.Event()
        busy = [pool.submit(release.wait, WAIT_S) for _ in range(2)]
        order: list[int] = []
        waiting = [pool.submit(order.append, i) for i in range(5)]
        assert not any(f.done() for f in waiting)
        release.set()
        for f in [*busy, *waiting]:
            f.result(WAIT_S)
        assert sorted(order) == [0, 1, 2, 3, 4]  # two threads drain the queue, oldest first
        assert order[0] in (0, 1)
    finally:
        pool.shutdown()


def test_exceptions_and_results_reach_the_future_and_the_thread_serves_on(pool):
    assert pool.submit(lambda a, b=0: a + b, 2, b=3).result(WAIT_S) == 5
    with pytest.raises(ZeroDivisionError):
        pool.submit(lambda: 1 / 0).result(WAIT_S)

    def exits():
        raise SystemExit(3)

    assert isinstance(pool.submit(exits).exception(WAIT_S), SystemExit)
    assert pool.submit(lambda: "still serving").result(WAIT_S) == "still serving"
    assert pool.threads_used() == 1


def test_a_task_cancelled_before_it_ran_does_not_run():
    pool = HotPool(1, thread_name_prefix="hotpool_cancel")
    try:
        release, ran = threading.Event(), threading.Event()
        busy = pool.submit(release.wait, WAIT_S)
        queued = pool.submit(ran.set)
        assert queued.cancel()
        release.set()
        busy.result(WAIT_S)
        pool.submit(lambda: None).result(WAIT_S)  # the thread went past the cancelled task
        assert not ran.is_set()
    finally:
        pool.shutdown()


def test_shutdown_runs_what_waits_or_cancels_it_and_ends_every_thread():
    pool = HotPool(1, thread_name_prefix="hotpool_down")
    release = threading.Event()
    busy = pool.submit(release.wait, WAIT_S)
    kept = pool.submit(lambda: "ran")
    stopper = threading.Thread(target=pool.shutdown)
    stopper.start()
    with pytest.raises(RuntimeError, match="after shutdown"):
        for _ in range(int(WAIT_S / 0.01)):  # shutdown() sets its flag at once: wait for it, bounded
            pool.submit(lambda: None)
            threading.Event().wait(0.01)
    release.set()
    stopper.join(WAIT_S)
    assert not stopper.is_alive() and busy.result(0) is True and kept.result(0) == "ran"
    assert _threads_named("hotpool_down") == 0

    pool = HotPool(1, thread_name_prefix="hotpool_cancelled")
    release = threading.Event()
    busy = pool.submit(release.wait, WAIT_S)
    dropped = pool.submit(lambda: "never")
    release.set()
    pool.shutdown(cancel_futures=True)
    assert busy.result(0) is True
    assert dropped.cancelled() or dropped.result(0) == "never"  # it may have run before shutdown took the lock
    assert _threads_named("hotpool_cancelled") == 0


def test_a_grpc_server_gets_a_hot_pool(monkeypatch):
    import grpc

    from swarm.peers.transport import TransportConfig, make_server

    made = []

    class _Server:  # no socket: only what make_server asks of a server
        def add_insecure_port(self, address: str) -> int:
            return 1

    def spy(pool, *args, **kwargs):
        made.append(pool)
        return _Server()

    monkeypatch.setattr(grpc, "server", spy)
    make_server(TransportConfig(max_workers=4), port=0)
    assert isinstance(made[0], HotPool) and isinstance(made[0], futures.Executor)
    assert _threads_named("grpc_") >= 4
    made[0].shutdown()


def test_the_pool_needs_a_thread():
    with pytest.raises(ValueError, match="max_workers"):
        HotPool(0)


def test_a_pool_nobody_holds_any_more_ends_its_threads():
    import gc

    pool = HotPool(4, thread_name_prefix="hotpool_dropped")
    assert pool.submit(lambda: 7).result(WAIT_S) == 7
    threads = [t for t in threading.enumerate() if t.name.startswith("hotpool_dropped")]
    assert len(threads) == 4
    del pool
    gc.collect()
    for t in threads:
        t.join(WAIT_S)
    assert not any(t.is_alive() for t in threads)
