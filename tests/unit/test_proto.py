"""The generated protobuf/gRPC modules are exactly what the .proto files compile to (never hand-edited)."""

from __future__ import annotations

from pathlib import Path

import pytest

from swarm.proto.codegen import generate

PROTO = Path(__file__).resolve().parents[2] / "proto"


def test_generated_modules_match_the_proto_files(tmp_path):
    pytest.importorskip("grpc_tools", reason="grpcio-tools (a dev dependency) regenerates the modules")
    written = generate(PROTO, tmp_path)
    assert {p.name for p in written} >= {"wire_pb2.py", "stage_pb2.py", "stage_pb2_grpc.py"}
    for fresh in written:
        committed = PROTO / fresh.name
        assert committed.exists(), f"{fresh.name} is not committed; run scripts/gen_proto.py"
        assert committed.read_text() == fresh.read_text(), (
            f"proto/{fresh.name} differs from what proto/*.proto compiles to; run scripts/gen_proto.py"
        )


def test_every_proto_has_its_generated_module():
    for source in PROTO.glob("*.proto"):
        assert (PROTO / f"{source.stem}_pb2.py").exists(), f"{source.name} was never compiled"
