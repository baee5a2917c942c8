"""`swarm bench hostile`: hostile clients against a local 3-stage pipeline over real gRPC, one row per case.

The stage servers run in a child process (`swarm.bench.hostile_servers`), so the server's RSS is read by pid with
psutil and a case that exhausts memory cannot take the benchmark down with it.
After every case one legitimate training step runs through the same servers; a case after which that step
fails gets fresh servers, so one wedge does not decide the rows after it.

Columns: `refused` (the hostile call ended with a gRPC error sent by the server), `error` (its code and
details, which should name the field or rule), `next_step_served` (the next legitimate step ran and gave a
finite loss), `rss_growth_mib` (server RSS after the case and the next step, minus before the case),
`rss_peak_growth_mib` (the highest RSS sampled while the case ran, minus before), `threads_held` (server
handlers still running after the next step), `thread_growth` (server threads after minus before), `seconds`
(the case alone). The last row is the summary.

Authentication: the bench's callers (the plan's trainer, a stranger) carry call tokens when this tree has
`swarm.net.auth`; without it they send no metadata and the servers check none (see `Keys`).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import re
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from swarm.bench.hostile_servers import Keys, Servers, codecs, tiny_model
from swarm.flags import Flags, flag
from swarm.report import print_table

__all__ = ["Harness", "Outcome", "add_arguments", "run"]

CALL_TIMEOUT_S = 10.0
"""The client's deadline on a hostile call: longer than the servers' wait cap, so the server ends a parked
call, not the client."""
STEP_DEADLINE_S = 20.0
"""deadline of the legitimate step after each case"""
WATCHDOG_S = 120.0
"""longest one case may run before it is reported as hung"""
WARMUP_STEPS = 3
"""legitimate steps before the first case, so the servers' allocations settle"""
BATCH, MICRO_BATCHES = 4, 2
COLUMNS = [
    "case", "refused", "next_step_served", "rss_growth_mib", "rss_peak_growth_mib", "threads_held", "seconds", "error",
]  # fmt: skip


@dataclass(frozen=True)
class HostileBench:
    """`swarm bench hostile`: hostile clients against a local pipeline, case by case."""

    json: bool = False
    """print one JSON object per line instead of a table"""
    case: tuple[str, ...] = field(default=(), metadata=flag(repeat=True))
    """run only this case (repeatable; none: every case)"""
    list: bool = False
    """list the cases and what each sends, then exit"""
    quick: bool = False
    """skip the slow and memory-hungry cases (marked heavy in --list)"""
    watchdog_s: float = WATCHDOG_S
    """longest one case may run, seconds"""


_FLAGS = Flags(HostileBench)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Hostile clients (a stranger, and the plan's own trainer misbehaving) against a local 3-stage pipeline "
        "over real gRPC on 127.0.0.1, the stage servers in a child process. One row per case: refused, the "
        "error, whether the next legitimate step was served, server RSS growth and held threads; then a summary."
    )
    _FLAGS.add_to(parser)


# ---- the hostile side -------------------------------------------------------------------------------------

_SIGNED = object()
"""`Harness.call`'s default metadata: `who`'s token and that call's proof."""


@dataclass
class Outcome:
    """What a case's hostile call(s) got back."""

    refused: bool
    error: str = ""
    extra: dict = field(default_factory=dict)


def rpc_error(e: grpc.RpcError) -> str:
    return f"{e.code().name}: {e.details()}"


def server_refused(e: grpc.RpcError) -> bool:
    """An error the server sent, not the client's own deadline running out or the connection failing."""
    client_deadline = e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and e.details() == "Deadline Exceeded"
    return not client_deadline and e.code() != grpc.StatusCode.UNAVAILABLE


class Harness:
    """What a case works with: raw stubs per stage with a caller's metadata, call infos and batches of the
    current step, and the legitimate trainer's driver."""

    def __init__(self, servers: Servers, keys: Keys):
        from swarm.peers.transport import TransportConfig

        self.servers, self.keys = servers, keys
        self.model, (self.forward_codec, self.backward_codec) = tiny_model(), codecs()
        self.step = 0
        """The step hostile calls name; the next legitimate step runs at step + 1."""
        self._transport = TransportConfig(max_message_bytes=1 << 30)
        self._channels: dict[str, grpc.Channel] = {}
        self.driver = None
        self.connect()

    @property
    def addresses(self) -> list[str]:
        return self.servers.addresses

    def connect(self) -> None:
        """(Re)connects the driver and the stubs to the current servers."""
        from swarm.runtime.driver import PipelineDriver

        self.close_clients()
        self.driver = PipelineDriver(
            self.addresses, self.keys.stage_ids, "1f1b", MICRO_BATCHES, deadline_s=STEP_DEADLINE_S,
            connector=self.keys.connector("trainer"),
        )  # fmt: skip

    def close_clients(self) -> None:
        if self.driver is not None:
            self.driver.close()
        for channel in self._channels.values():
            channel.close()
        self._channels = {}

    def channel(self, address: str) -> grpc.Channel:
        if address not in self._channels:
            self._channels[address] = grpc.insecure_channel(address, options=self._transport.channel_options())
        return self._channels[address]

    # -- calls -------------------------------------------------------------------------------------------------

    def call(self, stage: int, method: str, request, who: str = "trainer", timeout: float = CALL_TIMEOUT_S, **kw):
        """One call of `method` to `stage` as `who`; a stream method takes an iterable of serialized items.
        Returns the reply (a server-streaming reply is read to its end)."""
        from swarm.net.stream import TensorStreams
        from swarm.proto import stage_pb2_grpc

        channel = self.channel(self.addresses[stage])
        if method in ("Forward", "Backward", "Sink", "ForwardItem", "BackwardItem"):  # items serialized already
            fn = getattr(TensorStreams(channel), method)
        else:
            fn = getattr(stage_pb2_grpc.StageStub(channel), method)
        fields = request
        if method in ("Forward", "Backward", "Sink"):
            request = iter(request)
            fields = next(request, None)  # a call's proof signs its stream's first item
            request = iter(()) if fields is None else itertools.chain((fields,), request)
        metadata = kw.pop("metadata", _SIGNED)
        if metadata is _SIGNED:
            metadata = self.keys.metadata(who, stage, method, fields, signed=True)
        reply = fn(request, timeout=timeout, metadata=metadata)
        return list(reply) if method == "GetState" else reply

    def expect_refusal(self, stage: int, method: str, request, who: str = "trainer", **kw) -> Outcome:
        """Runs one call; refused when the addressed stage answered it with an error. An error a stage further
        down the pipeline raised (its details start "stage K (peer ...") means this stage took the call and
        passed it on: not refused."""
        try:
            self.call(stage, method, request, who, **kw)
        except grpc.RpcError as e:
            downstream = re.match(r"stage (\d+) \(peer ", e.details() or "")
            if downstream and int(downstream.group(1)) != stage:
                return Outcome(False, f"passed on, then {rpc_error(e)}")
            return Outcome(server_refused(e), rpc_error(e))
        return Outcome(False, "served")

    def info(self, target: int, **overrides):
        """The call info the trainer (or a stage) would send to stage `target` for micro-batch 0 of the current
        step, with `overrides` (CallInfo fields) on top."""
        from swarm.proto import stage_pb2

        info = stage_pb2.CallInfo(
            step=self.step, micro_batch=0, stage=target, plan_version=0, num_micro_batches=MICRO_BATCHES,
            schedule="1f1b", route=self.addresses, route_peers=self.keys.stage_ids, deadline_s=STEP_DEADLINE_S,
        )  # fmt: skip
        for name, value in overrides.items():
            if isinstance(value, list):
                del getattr(info, name)[:]
                getattr(info, name).extend(value)
            else:
                setattr(info, name, value)
        return info

    def batch(self, step: int):
        """The legitimate mini-batch of `step`: fixed sample ids 0..BATCH-1 (AQ-SGD buffers stay warm)."""
        import torch

        from swarm.model.data import Batch

        gen = torch.Generator().manual_seed(step)
        seq, vocab = self.model.seq_len_tokens, self.model.vocab_size
        tokens = torch.randint(0, vocab, (BATCH, seq), generator=gen)
        return Batch(torch.arange(BATCH), tokens, torch.randint(0, vocab, (BATCH, seq), generator=gen))

    def warm_up(self) -> str:
        """A few legitimate steps on fresh servers, so their allocations settle and the AQ-SGD buffers of the
        legitimate samples exist; returns the error if one failed."""
        for _ in range(WARMUP_STEPS):
            served, error = self.legitimate_step()
            self.step += 1
            if not served:
                return error
        return ""

    def legitimate_step(self) -> tuple[bool, str]:
        """One training step of the plan's trainer at step + 1; served when it ran and its loss is finite."""
        step = self.step + 1
        try:
            result = self.driver.train_step(step, self.batch(step))
        except Exception as e:  # StageCallError, or anything a corrupted stage answers: a row, not a crash
            with contextlib.suppress(Exception):
                self.driver.abandon(step)
            return False, str(e) or type(e).__name__
        if not math.isfinite(result.loss):
            return False, f"loss {result.loss}"
        return True, ""


# ---- running the cases ----------------------------------------------------------------------------------------


def _with_watchdog(fn: Callable[[], Outcome], seconds: float) -> Outcome:
    box: list = []

    def target():
        try:
            box.append(fn())
        except Exception as e:  # a case that breaks is a row with its error, never a crash of the benchmark
            box.append(Outcome(False, f"case failed: {type(e).__name__}: {e}"))

    thread = threading.Thread(target=target, daemon=True, name="hostile-case")
    thread.start()
    thread.join(seconds)
    return box[0] if box else Outcome(False, f"watchdog: the case did not finish in {seconds:.0f} s")


class _PeakRss:
    """Samples the server's RSS every few milliseconds while a case runs: a transient allocation (a zstd bomb
    decompressed, then dropped) shows in the peak though not in the growth after."""

    def __init__(self, servers: Servers, every_s: float = 0.01):
        self.servers, self.every_s, self.peak_mib = servers, every_s, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True, name="peak-rss")

    def _sample(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak_mib = max(self.peak_mib, self.servers.process.memory_info().rss / 2**20)
            except Exception:
                return
            self._stop.wait(self.every_s)

    def __enter__(self) -> _PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def run_case(h: Harness, case, watchdog_s: float) -> dict:
    before = h.servers.stats()
    start = time.perf_counter()
    with _PeakRss(h.servers) as peak:
        outcome = _with_watchdog(lambda: case.run(h), watchdog_s)
    seconds = time.perf_counter() - start
    served, step_error = h.legitimate_step() if before else (False, "no server")
    after = h.servers.stats()
    row = {
        "case": case.name,
        "caller": case.caller,
        "refused": outcome.refused,
        "error": outcome.error,
        "next_step_served": served,
        "rss_growth_mib": round(after["rss_mib"] - before["rss_mib"], 2) if "rss_mib" in after else None,
        "rss_peak_growth_mib": round(peak.peak_mib - before["rss_mib"], 2) if "rss_mib" in before else None,
        "threads_held": after.get("busy"),
        "thread_growth": after["threads"] - before["threads"] if "threads" in after and "threads" in before else None,
        "seconds": round(seconds, 3),
        **outcome.extra,
    }
    if not served:
        row["next_step_error"] = step_error
    h.step += 2
    if not served or not after:
        h.servers.restart()  # a wedged or dead server must not decide the rows after this one
        h.connect()
        if error := h.warm_up():
            row["warm_up_error"] = error
        row["servers_restarted"] = True
    return row


def summary_row(rows: list[dict]) -> dict:
    growth = [r["rss_growth_mib"] for r in rows if r["rss_growth_mib"] is not None]
    return {
        "case": "summary",
        "cases": len(rows),
        "refused": sum(r["refused"] for r in rows),
        "next_steps_served": sum(r["next_step_served"] for r in rows),
        "all_refused": all(r["refused"] for r in rows),
        "all_next_steps_served": all(r["next_step_served"] for r in rows),
        "max_rss_growth_mib": max(growth, default=None),
        "max_rss_peak_growth_mib": max((r["rss_peak_growth_mib"] or 0 for r in rows), default=None),
        "max_threads_held": max((r["threads_held"] or 0 for r in rows), default=0),
    }


def run(args: argparse.Namespace) -> int:
    bench = _FLAGS.from_args(args)
    from swarm.bench.hostile_cases import CASES

    if bench.list:
        for case in CASES:
            print(f"{case.name:28s} {case.caller:9s} {'heavy' if case.heavy else '     '} {case.doc}")
        return 0
    chosen = [c for c in CASES if not (bench.quick and c.heavy)]
    if bench.case:
        unknown = set(bench.case) - {c.name for c in CASES}
        if unknown:
            print(f"error: unknown case(s) {sorted(unknown)}; see --list", file=sys.stderr)
            return 2
        chosen = [c for c in chosen if c.name in bench.case]
    from tqdm import tqdm

    rows = []
    with tempfile.TemporaryDirectory(prefix="swarm-hostile-") as key_dir:
        keys = Keys(Path(key_dir))
        servers = Servers(Path(key_dir))
        harness = Harness(servers, keys)
        try:
            error = harness.warm_up()
            if error:
                print(f"error: the pipeline does not train before any case: {error}", file=sys.stderr)
                return 1
            for case in tqdm(chosen, desc="hostile cases", unit="case", file=sys.stderr):
                row = run_case(harness, case, bench.watchdog_s)
                rows.append(row)
                if bench.json:
                    print(json.dumps(row), flush=True)
        finally:
            harness.close_clients()
            servers.close()
    summary = summary_row(rows)
    if bench.json:
        print(json.dumps(summary), flush=True)
    else:
        print_table(rows, COLUMNS, "hostile cases against a local 3-stage pipeline (servers in a child process)")
        print(json.dumps(summary))
    return 0


def lazy(items: Iterable[bytes]) -> Iterable[bytes]:
    """Hands items to gRPC one at a time, so a huge stream never sits in the client's memory."""
    yield from items
