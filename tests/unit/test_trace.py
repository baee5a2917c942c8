"""The timeline tracer: off unless SWARM_TRACE_DIR is set; on, every stage's forward and backward of every
micro-batch, its codec work, calls and the trainer's phases become spans of a Chrome trace that merges and sums."""

from __future__ import annotations

import gc
import json
import os
import threading

import pytest
import torch

from swarm import trace
from swarm.runtime.inprocess import LocalPipeline
from tests.unit.runtime.test_replicas import CFG, FP32, batch

torch.set_num_threads(1)


@pytest.fixture
def traced(tmp_path, monkeypatch):
    """Tracing on into tmp_path for the test, off again after it (the module's tracer is process-wide)."""
    monkeypatch.setenv(trace.ENV, str(tmp_path))
    monkeypatch.setattr(trace, "_tracer", None)
    yield tmp_path
    if trace._gc_span in gc.callbacks:
        gc.callbacks.remove(trace._gc_span)
    trace._tracer = None


def test_off_without_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(trace.ENV, raising=False)
    monkeypatch.setattr(trace, "_tracer", None)
    assert trace.start("trainer") is None
    with trace.span("forward", stage=0):
        pass
    trace.since("wait", 0)
    assert trace.active() is None and trace.flush() is None
    assert list(tmp_path.iterdir()) == []


def test_spans_carry_wall_and_cpu_time_and_are_written_as_a_chrome_trace(traced):
    tracer = trace.start("peer 1")
    with trace.span("compute", "stage", stage=1, mb=3):
        sum(i * i for i in range(20000))  # some CPU in the span
    done = threading.Event()

    def other() -> None:
        with trace.span("read Forward", "serve"):
            done.set()

    t = threading.Thread(target=other, name="grpc_0")
    t.start()
    t.join(10)
    assert done.is_set()
    gc.collect()  # the collector's pause is a span too
    path = trace.flush()
    assert path == traced / f"trace-{tracer.pid}.json"
    events = json.loads(path.read_text())["traceEvents"]
    spans = {e["name"]: e for e in events if e["ph"] == "X"}
    compute = spans["compute"]
    assert compute["args"]["stage"] == 1 and compute["args"]["mb"] == 3
    assert 0 < compute["args"]["cpu_ms"] <= compute["dur"] / 1000 + 1.0  # a thread's CPU is within its wall time
    assert spans["read Forward"]["tid"] != compute["tid"]
    assert any(name.startswith("gc ") for name in spans)
    meta = {(e["name"], e.get("tid")): e["args"]["name"] for e in events if e["ph"] == "M"}
    assert meta[("process_name", None)] == "peer 1"
    assert "grpc_0" in meta.values()


def test_a_process_keeps_at_most_max_events_and_counts_the_rest(traced, monkeypatch):
    monkeypatch.setattr(trace, "MAX_EVENTS", 5)
    trace.start("trainer")
    for _ in range(8):
        with trace.span("step"):
            pass
    data = json.loads(trace.flush().read_text())
    assert sum(e["ph"] == "X" for e in data["traceEvents"]) <= 5
    assert data["otherData"]["dropped"] >= 3


def test_a_traced_in_process_step_has_every_micro_batch_on_every_stage(traced, capsys):
    pipe = LocalPipeline(CFG, 2, FP32, FP32, "1f1b")
    pipe.driver(4)
    pipe.train_step(batch(8), 4)
    trace.flush()
    events = trace.merge(traced)[1]
    computed = {(e["name"], e["args"]["stage"], e["args"]["mb"]) for e in events if e.get("cat") == "stage"
                and e["name"] in ("forward", "backward")}  # fmt: skip
    assert computed == {(k, s, mb) for k in ("forward", "backward") for s in (0, 1) for mb in range(4)}
    names = {e["name"] for e in events if e["ph"] == "X"}
    assert {"pipeline", "Forward", "Backward", "encode", "decode", "wait"} <= names
    assert trace.main([str(traced), "--steps", "1", "--pipeline", "0"]) == 0
    out = capsys.readouterr().out
    assert "forward" in out and "ms a step" in out and (traced / "trace.json").exists()
    figures = trace.pipeline_figures(events, from_step=0)
    assert set(figures["stages"]) == {0, 1} and figures["pipeline"] > 0
    hops = figures["hops"]["counts"]
    assert hops["waited"] + hops["handoff"] == 8  # every micro-batch's forward into stage 1 and backward into 0


def test_merge_skips_a_torn_file_and_summary_totals_by_process(tmp_path, capsys):
    def events(pid: int, name: str, durs: list[float]) -> dict:
        meta = [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}}]
        return {"traceEvents": meta + [{"name": "forward", "ph": "X", "pid": pid, "tid": 1, "ts": 0, "dur": d}
                                       for d in durs]}  # fmt: skip

    (tmp_path / "trace-1.json").write_text(json.dumps(events(1, "peer 1", [1000.0, 3000.0])))
    (tmp_path / "trace-2.json").write_text(json.dumps(events(2, "trainer", [500.0])))
    (tmp_path / "trace-3.json").write_text('{"traceEvents": [')  # a process killed while writing
    _, merged = trace.merge(tmp_path)
    assert "skipped" in capsys.readouterr().err
    assert trace.summary(merged) == [("peer 1", "forward", 2, 4.0), ("trainer", "forward", 1, 0.5)]


def test_the_cli_says_when_a_directory_has_no_spans(tmp_path, capsys):
    assert trace.main([str(tmp_path)]) == 1
    assert "no spans" in capsys.readouterr().err


def _span(pid: int, tid: int, name: str, ts: float, dur: float, **args) -> dict:
    return {"name": name, "ph": "X", "pid": pid, "tid": tid, "ts": ts * 1000, "dur": dur * 1000, "args": args}


def test_a_hop_is_waited_for_or_a_gate_hand_off_by_whether_the_input_came_first():
    f = dict(step=3, cpu_ms=1.0)
    events = [
        _span(1, 1, "forward", 0, 4, stage=0, mb=0, **f),  # stage 0 sends mb 0 at 4 ms
        _span(1, 1, "encode", 4, 0.5),
        _span(1, 1, "call Forward", 4.6, 10),
        _span(2, 7, "serve Forward", 5.5, 8),
        _span(2, 7, "read Forward", 5.6, 1.4),
        _span(2, 7, "decode", 7.0, 0.5),
        _span(2, 7, "forward", 8, 3, stage=1, mb=0, **f),  # stage 1 waited for it: 4 ms after it was computed
        _span(1, 2, "forward", 4.2, 4, stage=0, mb=1, **f),  # mb 1 is there at 8.2 ms, before stage 1 is free
        _span(2, 8, "forward", 12, 3, stage=1, mb=1, **f),  # free at 11: a 1 ms hand-off
    ]
    figures = trace.pipeline_figures(events, from_step=0)
    assert figures["hops"]["waited"] == {"forward": 4.0}
    assert figures["hops"]["handoff"] == {"forward": 1.0}
    assert figures["hops"]["segments"] == {
        "encode": 0.5, "call to handler": 0.9, "handler's read": 1.5, "decode": 0.5, "gate": 0.5,
    }  # fmt: skip
    assert figures["stages"][1]["compute a step"] == 6.0
    assert trace.pipeline_figures(events, from_step=4)["stages"] == {}  # steps before FROM_STEP are left out


def test_a_new_directory_starts_a_new_trace_and_writes_the_old_one(traced, monkeypatch):
    first = trace.start("trainer")
    with trace.span("pipeline", "trainer"):
        pass
    monkeypatch.setenv(trace.ENV, str(traced / "cell2"))  # an experiment's next cell, its trainer in this process
    second = trace.start("trainer")
    assert second is not first and second.directory == traced / "cell2"
    old = json.loads((traced / f"trace-{first.pid}.json").read_text())["traceEvents"]
    assert [e["name"] for e in old if e["ph"] == "X"] == ["pipeline"]
    assert second.events == [] and trace.start("trainer") is second  # the same directory: the same trace
    assert gc.callbacks.count(trace._gc_span) == 1


def test_a_traced_throttled_cell_gets_its_own_timeline_and_figures(traced, monkeypatch):
    from swarm.experiments import throttled

    monkeypatch.delenv(trace.ENV)
    cell = throttled.Cell(rate_mbit=10.0, setting="fp32/fp32")
    seen = []

    def processes(cell, cfg, out):  # what the cell's processes do: trace where the environment says
        seen.append(os.environ[trace.ENV])
        trace.start("trainer")
        with trace.span("forward", "stage", stage=1, step=5, mb=0, cpu_ms=1.0):
            pass
        with trace.span("pipeline", "trainer"):
            pass
        return [{"step": "1"}]

    monkeypatch.setattr(throttled, "_run_cell_processes", processes)
    cfg = throttled.ThrottledConfig(trace=True, train_samples=32, batch_size=8)
    assert throttled._run_cell(cell, cfg, traced) == [{"step": "1"}]
    directory = traced / cell.label / "trace"
    assert seen == [str(directory)] and trace.ENV not in os.environ  # set for the cell only
    assert json.loads((directory / "pipeline.json").read_text())["stages"]["1"]["compute a step"] >= 0
    assert "forward" in (directory / "spans.txt").read_text() and (directory / "trace.json").exists()
