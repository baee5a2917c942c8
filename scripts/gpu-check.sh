#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: the CUDA tests and the GPU benchmarks in one go, results under $OUT (or ./gpu-check).
#   scripts/gpu-check.sh            # pytest -m cuda, the Triton kernel cases on the GPU, bench kernels/model --device cuda
# Needs a CUDA build of torch and triton in the environment (scripts/env.sh installs the CPU build; on a GPU machine
# install the CUDA wheel of the same torch version first). Exits non-zero if any part fails; every part runs.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
out="${OUT:-$root/gpu-check}"
mkdir -p "$out"
python="${PYTHON:-python}"
status=0
if ! "$python" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu-check: CUDA is not available to $python (torch $("$python" -c 'import torch; print(torch.__version__)'))" >&2
    exit 2
fi
"$python" -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))' | tee "$out/device.txt"
run() {  # name, command...: runs it, keeps its output, remembers a failure
    local name="$1"
    shift
    echo "== $name: $*"
    if ! "$@" >"$out/$name.txt" 2>&1; then
        echo "!! $name failed (see $out/$name.txt)"
        status=1
    fi
    tail -n 25 "$out/$name.txt"
}
# the tests marked cuda, and the Triton kernels' cases, which run directly on the GPU when CUDA is there
run pytest-cuda timeout 900 "$python" -m pytest -q -m cuda -rs tests/unit
run pytest-triton timeout 900 "$python" -m pytest -q -rs \
    tests/unit/kernels/test_kernels_triton_cases.py tests/unit/kernels/test_kernels_triton_sym_cases.py
run bench-kernels timeout 900 "$python" -m swarm.cli bench kernels --device cuda --json
if "$python" -c 'import importlib.util, sys; sys.exit(0 if importlib.util.find_spec("swarm.bench.model") else 1)'; then
    run bench-model timeout 900 "$python" -m swarm.cli bench model --device cuda --json
else
    echo "== bench-model: skipped (swarm.bench.model is not in this tree yet)"
fi
exit $status
