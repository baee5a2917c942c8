#!/usr/bin/env bash
# The wheels scripts/gpu-device-run.sh installs on a GPU machine without network (docs/GPU.md): what swarm needs
# that its image (Python 3.12, torch, Triton, transformers, numpy, scipy, grpcio, ...) lacks or has at other versions.
#   scripts/gpu-wheels.sh [DIR]     # default: .whl in the checkout (add /.whl/ to .git/info/exclude); needs pip + network
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest="${1:-$root/.whl}"
python="${PYTHON:-python3}"
mkdir -p "$dest"
binary=(
    hivemind==1.1.12 zstandard==0.25.0 cryptography==50.0.2 cffi==2.1.1 pycparser==3.12
    protobuf==7.36.2 grpcio==1.85.3 # proto/*_pb2*.py check the runtime against the versions they were generated with
    base58==2.1.1 ConfigArgParse==1.9.0 netaddr==1.3.0 py-cid==0.5.0 py-multibase==2.0.0 py-multicodec==1.0.0
    py-multihash==3.0.0 morphys==1.0 blake3==1.0.11 mmh3==5.3.1 pydantic==2.14.4 pydantic-core==2.50.5
    annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
)
source_only=(varint==1.0.2 prefetch_generator==1.0.3 python-baseconv==1.2.2) # pure Python, published as sources
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
for spec in "${binary[@]}"; do
    "$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" -d "$dest" "$spec"
done
"$python" -m pip wheel -q --no-deps -w "$dest" "${source_only[@]}"
ls "$dest"
du -sh "$dest"
