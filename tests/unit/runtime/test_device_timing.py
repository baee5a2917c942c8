"""Timing on a device: `fastest_seconds` synchronizes CUDA before every clock read, and the compute a peer
announces (`measure_compute`) and `swarm bench model` are timed through it. The CUDA path is checked here on the
CPU with torch.cuda.synchronize and the clock replaced by recorders; the test marked `cuda` times a real GPU."""

from __future__ import annotations

import pytest
import torch

import swarm.runtime.device as device_module
from swarm.daemon.capacity import measure_compute
from swarm.model.gpt import ModelConfig
from swarm.runtime.device import fastest_seconds, synchronize

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA unavailable here)")


class _Recorder:
    """The order of work, device synchronizations and clock reads; the clock advances by the given pass times."""

    def __init__(self, durations: list[float]):
        self.events: list[str] = []
        self.durations = list(durations)
        self.now = 100.0

    def work(self) -> None:
        self.events.append("work")

    def synchronize(self, device=None) -> None:
        self.events.append(f"sync:{device}")

    def clock(self) -> float:
        if self.events and self.events[-1] == "work":
            self.now += 1.0  # an unsynchronized read would stop the clock here, before the kernels ran
        elif self.events.count("clock") % 2 == 1:
            self.now += self.durations.pop(0)  # the end read of a timed pass: the pass's time
        self.events.append("clock")
        return self.now


@pytest.fixture
def recorder(monkeypatch):
    rec = _Recorder([0.5, 0.2, 0.3])
    monkeypatch.setattr(torch.cuda, "synchronize", rec.synchronize)
    monkeypatch.setattr(device_module, "_clock", rec.clock)
    return rec


@pytest.mark.parametrize("name", ["cuda", "cuda:1"])
def test_every_clock_read_on_cuda_follows_a_synchronize(recorder, name):
    seconds = fastest_seconds(recorder.work, name, iters=3, warmup=2)
    events = recorder.events
    assert events[:2] == ["work", "work"], "warm-up passes are not timed"
    clocks = [i for i, e in enumerate(events) if e == "clock"]
    assert len(clocks) == 6, "a start and an end read per timed pass"
    for i in clocks:
        assert events[i - 1].startswith("sync:"), f"clock read {i} without a synchronize right before it: {events}"
    assert all(events[i + 1] == "work" for i in clocks[0::2]), "each pass runs between its two reads"
    assert seconds == pytest.approx(0.2), "the fastest pass, each measured start to end"


def test_the_synchronize_names_the_device_timed(recorder):
    fastest_seconds(recorder.work, "cuda:1", iters=1, warmup=0)
    assert recorder.events == ["sync:cuda:1", "clock", "work", "sync:cuda:1", "clock"]


def test_cpu_timing_never_touches_cuda(monkeypatch):
    def refuse(*_):
        raise AssertionError("torch.cuda.synchronize on a CPU timing")

    monkeypatch.setattr(torch.cuda, "synchronize", refuse)
    calls = []
    seconds = fastest_seconds(lambda: calls.append(1), "cpu", iters=4, warmup=1)
    assert len(calls) == 5 and 0.0 <= seconds < 1.0
    synchronize("cpu")


def test_measure_compute_times_a_real_pass_through_the_synchronized_timer(monkeypatch):
    seen = {}

    def fake_fastest(work, device, iters, warmup=2):
        work()  # the pass itself runs: a block's forward and backward
        seen.update(device=device, iters=iters, warmup=warmup)
        return 0.25

    monkeypatch.setattr(device_module, "fastest_seconds", fake_fastest)
    tiny = ModelConfig(seq_len_tokens=8, hidden_dim=16, n_layers=2, n_heads=2)
    assert measure_compute(tiny, "cpu", iters=7) == pytest.approx(4.0)
    assert seen == {"device": "cpu", "iters": 7, "warmup": 2}


def test_bench_model_times_its_stages_through_the_synchronized_timer(monkeypatch):
    from swarm.bench.model import _time_stage
    from swarm.model.spec import build_stage

    seen = []
    real = device_module.fastest_seconds
    monkeypatch.setattr(device_module, "fastest_seconds", lambda work, device, iters, warmup=2: seen.append(
        (str(device), iters, warmup)) or real(work, device, iters, warmup))  # fmt: skip
    tiny = ModelConfig(seq_len_tokens=8, hidden_dim=16, n_layers=2, n_heads=2)
    stage = build_stage(tiny, 0, 1, False, False)
    assert _time_stage(stage, torch.randn(2, 8, 16), None, iters=2) > 0
    assert seen == [("cpu", 2, 1)]


@pytest.mark.cuda
@needs_cuda
def test_a_cuda_timing_covers_the_kernels_it_launched():
    a = torch.randn(4096, 4096, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def work() -> None:
        for _ in range(8):
            a @ a

    work()
    torch.cuda.synchronize()
    start.record()
    work()
    end.record()
    end.synchronize()
    event_s = start.elapsed_time(end) / 1e3
    assert fastest_seconds(work, "cuda", iters=3) >= 0.8 * event_s, "the host clock saw the kernels, not launches"
    tiny = ModelConfig(seq_len_tokens=64, hidden_dim=256, n_layers=2, n_heads=4)
    assert 0 < measure_compute(tiny, "cuda", iters=3) < float("inf")
