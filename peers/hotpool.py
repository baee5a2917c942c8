"""A fixed thread pool that hands each task to the thread that went idle last, so that per-thread native state
stays in the few threads a server's concurrency needs.

Native libraries keep state per thread that computed: oneDNN's and ideep's primitive caches (thread-local, by
shape), MKL's buffers, gRPC's and glibc's per-thread pieces. `concurrent.futures.ThreadPoolExecutor` wakes whichever
idle thread its queue's lock lets through, and a thread that has just finished often takes the next task first,
so the cold threads of a large pool (a relaying peer's gRPC server has 104) get a task now and then, each its first
compute, for thousands of steps: the serving peer's slow growth of issue 28. Here an idle thread waits on an event
of its own on a stack; a task goes to the top of the stack, the thread most recently busy, and a thread that was
never needed is never woken. So the threads that ever run anything are at most the most tasks ever in flight at
once, which a run reaches early, and the pool's threads are all started at construction, so its thread count is
the same from the first task to the last.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from concurrent import futures

__all__ = ["HotPool"]

_IDLE = object()
"""`_Shared.release`'s answer for a worker now on the idle stack."""


class _Worker:
    def __init__(self) -> None:
        self.wake = threading.Event()
        self.task: tuple | None = None
        """handed over by `submit` (under the pool's lock) before `wake` is set; None on shutdown"""
        self.tasks_run = 0


class _Shared:
    """What the pool's threads share: no reference to the `HotPool` itself, so that a pool nobody holds any more
    (a stopped gRPC server's, collected) ends its threads as `ThreadPoolExecutor` does."""

    def __init__(self, workers: list[_Worker]):
        self.lock = threading.Lock()
        self.idle: list[_Worker] = []
        """idle threads, the most recently idle last (a stack)"""
        self.waiting: deque[tuple] = deque()
        """tasks submitted while every thread was busy, oldest first"""
        self.shutdown = False
        self.workers = workers

    def next_task(self, worker: _Worker) -> tuple | None:
        """The next task for `worker`: a waiting one, or the one `submit` hands it once idle; None at shutdown."""
        return self.wait(worker, self.release(worker))

    def release(self, worker: _Worker) -> tuple | object | None:
        """`worker` done with its task: a waiting task for it, or `_IDLE` once it is on the idle stack (nothing to
        wait for yet), or None at shutdown."""
        with self.lock:
            if self.waiting:
                return self.waiting.popleft()
            if self.shutdown:
                return None
            worker.task = None
            worker.wake.clear()
            self.idle.append(worker)
        return _IDLE

    @staticmethod
    def wait(worker: _Worker, released: tuple | object | None) -> tuple | None:
        """What `release` gave, or for an idle worker the task `submit` hands it (None at shutdown)."""
        if released is not _IDLE:
            return released
        worker.wake.wait()
        return worker.task

    def stop(self, cancel_futures: bool = False) -> None:
        """No new tasks; wakes the idle threads to end."""
        with self.lock:
            self.shutdown = True
            if cancel_futures:
                while self.waiting:
                    self.waiting.popleft()[0].cancel()
            idle, self.idle = self.idle, []
            for worker in idle:
                worker.task = None
                worker.wake.set()


def _run(shared: _Shared, worker: _Worker) -> None:
    task = shared.next_task(worker)
    while task is not None:
        future, fn, args, kwargs = task
        del task
        worker.tasks_run += 1
        if not future.set_running_or_notify_cancel():
            task = shared.next_task(worker)
            continue
        error = result = None
        try:
            result = fn(*args, **kwargs)
        except BaseException as e:  # as ThreadPoolExecutor: the future carries it
            error = e
        # back on the idle stack before the caller learns the outcome: a caller that submits its next task the
        # moment this one is done must find this thread on top, not wake a cold one (on a loaded machine the
        # caller often ran before this thread got back to the stack)
        released = shared.release(worker)
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
        del future, fn, args, kwargs, result, error  # no reference to a finished call's objects while idle
        task = shared.wait(worker, released)


class HotPool(futures.Executor):
    """`max_workers` threads, all started now; each task runs on the most recently idle one (`submit`), or waits in
    order for the next thread that finishes. A drop-in for `ThreadPoolExecutor` where only `submit` and `shutdown`
    are used (a gRPC server's pool). Its threads end at `shutdown`, or once the pool is collected.

    Args:
        max_workers: threads, all started at construction.
        thread_name_prefix: the threads are named PREFIX_0, PREFIX_1, ...
    """

    def __init__(self, max_workers: int, thread_name_prefix: str = "hotpool"):
        if max_workers < 1:
            raise ValueError(f"HotPool.max_workers: expected >= 1, got {max_workers}")
        self._shared = shared = _Shared([_Worker() for _ in range(max_workers)])
        self._threads = [
            threading.Thread(target=_run, args=(shared, w), name=f"{thread_name_prefix}_{i}", daemon=True)
            for i, w in enumerate(shared.workers)
        ]
        for thread in self._threads:
            thread.start()
        weakref.finalize(self, shared.stop)

    def submit(self, fn, /, *args, **kwargs) -> futures.Future:
        future: futures.Future = futures.Future()
        task = (future, fn, args, kwargs)
        shared = self._shared
        with shared.lock:
            if shared.shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            if shared.idle:
                worker = shared.idle.pop()
                worker.task = task
                worker.wake.set()
            else:
                shared.waiting.append(task)
        return future

    def threads_used(self) -> int:
        """Threads that ran at least one task so far (a soak's or a test's figure)."""
        return sum(1 for w in self._shared.workers if w.tasks_run)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """No new tasks; the waiting ones still run (or, with `cancel_futures`, are cancelled); idle threads end
        now and busy ones after the waiting tasks. `wait`: return once every thread ended."""
        self._shared.stop(cancel_futures)
        if wait:
            for thread in self._threads:
                if thread is not threading.current_thread():
                    thread.join()
