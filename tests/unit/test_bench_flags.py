"""The benchmarks' flags: each bench's config dataclass round-trips through its argv, reads a TOML file under
the command line, and --quick shrinks a copy of the config."""

from __future__ import annotations

import argparse

import pytest

from swarm.bench.auth import AuthBench
from swarm.bench.codecs import CodecsBench
from swarm.bench.hostile import HostileBench
from swarm.bench.kernels import KernelsBench
from swarm.bench.model import ModelBench
from swarm.bench.relay import RelayBench
from swarm.bench.scheduler import SchedulerBench
from swarm.bench.selective import SelectiveBench
from swarm.bench.soak import SoakConfig
from swarm.bench.transport import TransportBench
from swarm.flags import Flags
from swarm.options import ModelFlags

CHANGED = [
    AuthBench(pairs=2, epochs=1, quick=True),
    CodecsBench(numel=1024, deltas="synthetic", zstd_level=0, json=True),
    HostileBench(case=("a", "b"), watchdog_s=5.0, list=True),
    KernelsBench(bits=(2, 3), sizes_kib=(64,), nearest=True, quantizer="acsgd"),
    ModelBench(model=ModelFlags(model="llama-tiny", seq_len=32, model_seed=2), stages=2, lr=1e-3),
    RelayBench(calls=10, payload_mib=0.5, rounds=1),
    SchedulerBench(seed=1, only="dtfm", sizes="64"),
    SelectiveBench(rates="1,10", replica_rate=5.0),
    SoakConfig(steps=50, peers=3, sample_every_s=0.1, per_process=True, out="x"),
    TransportBench(repeats=1, shaped_seconds=0.5),
]


@pytest.mark.parametrize("config", CHANGED, ids=lambda c: type(c).__name__)
def test_bench_config_round_trips_through_argv(config):
    flags = Flags(type(config))
    argv = flags.to_argv(config)
    assert argv and flags.parse(argv) == config
    assert flags.parse([]) == type(config)()


def test_toml_file_under_a_flag(tmp_path):
    path = tmp_path / "kernels.toml"
    path.write_text('bits = [2, 8]\nrepeats = 9\nquantizer = "acsgd"\n')
    parser = argparse.ArgumentParser()
    Flags(KernelsBench).add_to(parser)
    got = Flags(KernelsBench).from_args(parser.parse_args(["--config", str(path), "--repeats", "2"]))
    assert got == KernelsBench(bits=(2, 8), repeats=2, quantizer="acsgd")


def test_quick_shrinks_a_copy():
    assert RelayBench(quick=True).run_config() == RelayBench(
        calls=50, payload_mib=1.0, large_calls=3, rounds=2, quick=True
    )
    assert RelayBench(calls=7).run_config().calls == 7
    assert SoakConfig(quick=True).run_config() == SoakConfig(steps=200, sample_every_s=0.5, quick=True)
    assert SoakConfig(sample_every_s=1.0).run_config().sample_every_s == 1.0
