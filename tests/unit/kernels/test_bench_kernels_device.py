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
