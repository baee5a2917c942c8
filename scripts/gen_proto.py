"""Regenerate the protobuf/gRPC modules in proto/ from the .proto files (never edit the generated files)."""

from __future__ import annotations

import sys
from pathlib import Path

from swarm.proto.codegen import generate

if __name__ == "__main__":
    root = Path(__file__).resolve().parents[1]
    for path in generate(root / "proto", root / "proto"):
        print(f"wrote {path.relative_to(root)}")
    sys.exit(0)
