"""`swarm bench kernels`: the acsgd table on the CPU, and --device cuda (a clear message without CUDA)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from swarm.bench import kernels as bench


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_without_cuda_the_device_table_says_so(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.run(parse("--device", "cuda", "--json")) == 2
    assert "CUDA is not available" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("name", "gbps"),
    [("NVIDIA H200", 4800.0), ("NVIDIA H100 80GB HBM3", 3350.0), ("NVIDIA H100 PCIe", 2000.0),
     ("NVIDIA A100-SXM4-80GB", 2039.0), ("NVIDIA GeForce RTX 3060", None)],
)  # fmt: skip
def test_the_nominal_hbm_peak_of_known_devices(name, gbps):
    assert bench.hbm_peak_gbps(name) == gbps


def test_the_quantize_share_of_the_peak_is_none_without_a_peak():
    assert bench._share({"quantize_gbps": 4080.0}, 4800.0) == pytest.approx(0.85)
    assert bench._share({"quantize_gbps": 4080.0}, None) is None


def test_a_negative_hbm_peak_is_refused(monkeypatch, capsys):
    monkeypatch.setattr(bench, "resolve_device", lambda name: torch.device("cpu"))
    assert bench.run(parse("--device", "cuda", "--hbm-peak-gbps", "-1")) == 2
    assert "--hbm-peak-gbps -1" in capsys.readouterr().out


def test_the_acsgd_table_on_the_cpu(capsys):
    assert bench.run(parse("--quick", "--quantizer", "acsgd", "--bits", "2", "--group-size", "128", "--json")) == 0
    out = capsys.readouterr().out
    rows = json.loads(out[out.index("[") :])
    assert len(rows) == 2 and all(row["quantize_gbps"] > 0 and 0.3 < row["rel_error"] < 0.8 for row in rows)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA unavailable here)")
def test_the_device_table_on_a_gpu(capsys):
    assert bench.run(parse("--device", "cuda", "--quick", "--json")) == 0
    out = capsys.readouterr().out
    rows = json.loads(out[out.index("[") :])
    assert {row["quantizer"] for row in rows} == {"aqsgd", "acsgd"}
    assert all(row["quantize_share"] > 0 and row["copy_gbps"] > 0 for row in rows)
    assert all(row["device"] == torch.cuda.get_device_name() for row in rows)
    assert all(row["quantize_hbm"] is None or 0 < row["quantize_hbm"] < 1.2 for row in rows)
