"""Generates the Python modules of proto/*.proto with grpcio-tools, importable as `swarm.proto.*`."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path


def generate(proto_dir: Path, out_dir: Path) -> list[Path]:
    """Compile every .proto in `proto_dir` into `out_dir`; returns the files written.

    The .proto files import each other as "swarm/proto/x.proto", so the generated modules import
    `swarm.proto.x_pb2`; a virtual include path maps that prefix onto `proto_dir`.
    """
    from grpc_tools import protoc  # dev dependency: only needed to regenerate

    written = []
    with tempfile.TemporaryDirectory() as tmp:
        sources = sorted(proto_dir.glob("*.proto"))
        include = Path(protoc.__file__).parent / "_proto"
        args = [
            "protoc",
            f"-Iswarm/proto={proto_dir}",
            f"-I{include}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *[f"swarm/proto/{p.name}" for p in sources],
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {[p.name for p in sources]}")
        for generated in sorted((Path(tmp) / "swarm" / "proto").iterdir()):
            target = out_dir / generated.name
            shutil.copyfile(generated, target)
            written.append(target)
    return written
