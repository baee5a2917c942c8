"""A dial-back's answer does not tell whether the dialed port is open (issue 27: a closed port answered in
0.01 s, an open one that never speaks gRPC in 3.01 s, the helper's timeout). Its timing and its refusals are
compared for the two: the distributions of answer times must overlap within a tolerance far below the dial
timeout (no assertion on absolute speed)."""

from __future__ import annotations

import socket
import statistics
import time

import pytest

from swarm.net.auth import CallSigner, Identity
from swarm.net.reach import DialBackHelper
from swarm.net.relay import RelayError

pytestmark = pytest.mark.timeout(120)

TIMEOUT_S = 2.0
"""the helper's dial timeout: an open, silent port holds a dial this long"""
ROUNDS = 8


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # bound, never listening: connections are refused


def test_the_answer_time_and_refusals_do_not_tell_an_open_port_from_a_closed_one():
    silent = socket.create_server(("127.0.0.1", 0), backlog=64)  # open, accepts, never answers
    open_address = f"127.0.0.1:{silent.getsockname()[1]}"
    closed_address = f"127.0.0.1:{_closed_port()}"
    callers = {f"asker-{i}": (open_address if i % 2 else closed_address) for i in range(2 * ROUNDS)}
    helper = DialBackHelper(
        callers.get, CallSigner(Identity.generate()), timeout_s=TIMEOUT_S, max_dials=4 * ROUNDS, interval_s=0.0
    )
    times: dict[str, list[float]] = {open_address: [], closed_address: []}
    refusals: dict[str, set[str]] = {open_address: set(), closed_address: set()}
    try:
        for caller, address in callers.items():  # interleaved: open, closed, open, ...
            started = time.perf_counter()
            helper.dial_back(caller, b"n" * 32)
            times[address].append(time.perf_counter() - started)
        for caller, address in callers.items():  # asked again at once: the same refusal for both
            try:
                helper.dial_back(caller, b"m" * 32)
                refusals[address].add("accepted")
            except RelayError as e:
                refusals[address].add(f"{e.code.name}: {e.details.replace(caller, '<caller>')}")
        # after the closed port's dial surely ended (it is refused at once): still the same
        time.sleep(TIMEOUT_S / 2)  # not a synchronization: the moment at which the two must look alike
        for caller, address in callers.items():
            try:
                helper.dial_back(caller, b"o" * 32)
                refusals[address].add("accepted")
            except RelayError as e:
                refusals[address].add(f"{e.code.name}: {e.details.replace(caller, '<caller>')}")
    finally:
        helper.close()
        silent.close()
    open_median, closed_median = statistics.median(times[open_address]), statistics.median(times[closed_address])
    print(f"answer median: open {1e3 * open_median:.2f} ms, closed {1e3 * closed_median:.2f} ms")
    # before: open ~TIMEOUT_S, closed ~0.01 s. Now both answer before dialing: the difference is noise
    assert abs(open_median - closed_median) < 0.25 * TIMEOUT_S, times
    assert refusals[open_address] == refusals[closed_address], refusals
