"""hivemind's DHT node in a thread of this process: `DHTThread` runs a `hivemind.dht.node.DHTNode` on an asyncio
loop of its own, with the part of `hivemind.DHT`'s interface that `SwarmDHT` uses (get, store, run_coroutine).

`hivemind.DHT` runs the same node in a forked child process: a second Python interpreter with a copy of every
module its parent had imported (torch included), ~140 MB of PSS per peer (`swarm bench footprint`), fed through a
pipe. In a thread, the node shares the peer's interpreter; its requests are coroutines handed to its loop
(`asyncio.run_coroutine_threadsafe`), whose `concurrent.futures.Future`s the callers wait on with a deadline, as
they waited on hivemind's MPFutures. The record validators (signing and checking) and client mode are the node's
own arguments, as in the child. The p2p daemon it starts dies with this process however it ends
(`swarm.peers.lifeline.p2pd_dies_with_its_thread`), and with the node's thread when the node shuts down.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

from hivemind.dht.node import DHTNode
from hivemind.dht.validation import CompositeValidator, RecordValidatorBase

from swarm.peers.lifeline import p2pd_dies_with_its_thread

__all__ = ["DHTThread"]

logger = logging.getLogger(__name__)
R = TypeVar("R")


P2PD_START_ATTEMPTS = 3
"""times the node tries to start p2pd when the daemon fails to start (not when it cannot join its peers); 2 fell
short once in CI's loaded suite, where a real failure followed the test's injected one"""


class DHTThread:
    """A hivemind DHT node served by a daemon thread of this process.

    Args:
        initial_peers: multiaddrs to join through (None: a new DHT).
        record_validators: hivemind record validators (signing, the run's records), combined as hivemind.DHT does.
        shutdown_timeout_s: how long `shutdown` waits for the node (and its p2pd) to stop.
        **node_kwargs: the rest of `DHTNode.create`'s arguments (client_mode, and P2P's: host_maddrs,
            announce_maddrs, identity_path, startup_timeout).
    """

    def __init__(
        self,
        initial_peers: list[str] | None = None,
        *,
        record_validators: Iterable[RecordValidatorBase] = (),
        shutdown_timeout_s: float = 5.0,
        **node_kwargs: Any,
    ):
        p2pd_dies_with_its_thread()
        self.shutdown_timeout_s = shutdown_timeout_s
        self._create = dict(
            initial_peers=initial_peers, record_validator=CompositeValidator(record_validators), **node_kwargs
        )
        self._node: DHTNode | None = None
        self._ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._loop = asyncio.new_event_loop()
        self._main: asyncio.Task | None = None
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="swarm-dht", daemon=True)
        self._thread.start()

    # -- the node's thread -------------------------------------------------------------------------------------

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._main = self._loop.create_task(self._serve())
            self._loop.run_until_complete(self._main)
        except BaseException as e:  # noqa: BLE001 - reported to whoever waits for the node, not lost in a thread
            self._fail(e)
        finally:
            self._close_loop()

    async def _serve(self) -> None:
        if self._closing:
            raise RuntimeError("the DHT node was shut down before it started")
        for attempt in range(1, P2PD_START_ATTEMPTS + 1):
            try:
                self._node = await DHTNode.create(**self._create)
                break
            except asyncio.CancelledError:
                raise RuntimeError("the DHT node was shut down while starting") from None
            except Exception as e:
                if attempt < P2PD_START_ATTEMPTS and "Daemon failed to start" in str(e) and not self._closing:
                    # p2pd's first output was not its banner. The known cause, gRPC's poller restarted in the
                    # forked child by gRPC's fork support and printing into p2pd's pipe before the exec, is off
                    # (swarm/__init__.py); this retry stays for whatever else fails p2pd's start once
                    logger.warning("p2pd failed to start (%s); starting it again", e)
                    continue
                logger.debug("DHT node failed to start", exc_info=True)
                self._fail(e)
                return
        self._ready.set_result(None)
        try:
            await asyncio.Event().wait()  # serves (the node's own tasks) until shutdown() cancels this task
        except asyncio.CancelledError:
            pass
        try:
            await asyncio.wait_for(self._node.shutdown(), self.shutdown_timeout_s)
        except (asyncio.TimeoutError, Exception) as e:  # p2pd still dies with this thread (its parent-death signal)
            logger.warning("the DHT node did not shut down cleanly (%s); its p2pd goes with its thread", e or type(e))

    def _close_loop(self) -> None:
        loop = self._loop
        try:
            tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for task in tasks:
                task.cancel()
            if tasks:
                loop.run_until_complete(asyncio.wait(tasks, timeout=self.shutdown_timeout_s))
            loop.run_until_complete(loop.shutdown_asyncgens())
        except Exception as e:  # noqa: BLE001 - the loop closes whatever its leftovers do
            logger.debug("closing the DHT loop: %s", e)
        finally:
            loop.close()

    # -- hivemind.DHT's interface, as SwarmDHT uses it ----------------------------------------------------------

    def wait_until_ready(self, timeout: float | None = None) -> None:
        """Returns once the node has joined; raises concurrent.futures.TimeoutError, or why it could not start."""
        self._ready.result(timeout=timeout)

    def is_alive(self) -> bool:
        """Whether the node is up and serving (started, not shut down, its thread running)."""
        return self._thread.is_alive() and not self._closing and self._ready.done() and not self._ready.exception()

    def get(self, key: Any, latest: bool = False, return_future: bool = True, **kwargs: Any) -> Any:
        """hivemind.DHT.get: the newest (latest) or any unexpired value under `key`, or None."""
        return self._submit(lambda node: node.get(key, latest=latest, **kwargs), return_future)

    def store(
        self, key: Any, value: Any, expiration_time: float, subkey: Any = None, return_future: bool = True, **kwargs
    ) -> Any:
        """hivemind.DHT.store: stores `value` under `key` (and `subkey`) until `expiration_time` (DHT time)."""
        store = lambda node: node.store(key, value, expiration_time, subkey=subkey, **kwargs)
        return self._submit(store, return_future)

    def run_coroutine(self, coro: Callable[[Any, DHTNode], Awaitable[R]], return_future: bool = True) -> Any:
        """hivemind.DHT.run_coroutine: `coro(this, node)` on the node's loop (it must not block that loop)."""
        return self._submit(lambda node: coro(self, node), return_future)

    def _submit(self, make: Callable[[DHTNode], Awaitable[Any]], return_future: bool) -> Any:
        if self._closing or self._node is None or not self._thread.is_alive():
            raise RuntimeError("the DHT node is not running")
        node = self._node

        async def call() -> Any:
            return await make(node)

        future = asyncio.run_coroutine_threadsafe(call(), self._loop)
        return future if return_future else future.result()

    def shutdown(self) -> None:
        """Stops the node and its p2pd and ends the thread; safe to call twice, and while it is still starting."""
        if self._closing:
            return
        self._closing = True
        if threading.current_thread() is self._thread:
            raise RuntimeError("DHTThread.shutdown called from the DHT's own loop")
        if self._thread.is_alive():
            try:
                self._loop.call_soon_threadsafe(self._cancel_main)
            except RuntimeError:  # the loop closed meanwhile: the thread is ending by itself
                pass
            self._thread.join(self.shutdown_timeout_s * 2 + 1)
            if self._thread.is_alive():
                logger.warning("the DHT thread is still busy after shutdown; leaving it (a daemon thread)")
        self._fail(RuntimeError("the DHT node was shut down before it started"))

    def _fail(self, error: BaseException) -> None:
        with contextlib.suppress(concurrent.futures.InvalidStateError):  # the other thread may have set it first
            self._ready.set_exception(error)

    def _cancel_main(self) -> None:
        if self._main is not None:
            self._main.cancel()
