#!/usr/bin/env bash
# The one command for the GPU machine (the device tool's `run`, carry [".whl"]; README's nvidia-h200 notes):
#   bash scripts/gpu-device-run.sh             # there: python3 holds torch+CUDA, nothing can be downloaded
#   bash scripts/gpu-device-run.sh --dry-run   # here: the same steps on the CPU (PYTHON=... to pick the python)
# 1. installs the wheels in .whl/ (what swarm needs that the machine's image lacks: hivemind and its needs,
#    zstandard, cryptography, and protobuf/grpcio at the versions proto/ was generated with) into /tmp/site;
# 2. makes this checkout importable as `swarm` without installing it (scripts/swarm_checkout.py: a .pth in the
#    interpreter's site-packages, or a sitecustomize in /tmp/site where that is not writable or on --dry-run);
# 3. runs scripts/gpu-check.sh with what is left of GPU_RUN_BUDGET_S (default 420 s for the whole script, 40 s kept
#    for a part's kill grace, the summary and the archive; each part has its own timeout): give the run 60 s more;
# 4. leaves under $OUT (default ./gpu-device-run): summary.json, gpu-check.log (all output) and gpu-check.tar.gz
#    (each part's output and the demo's logs): 3 files, within what the device tool brings back.
# Exits with gpu-check's status (1: a part failed; the others still ran and are in the summary).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
dry=()
[[ ${1:-} == --dry-run ]] && dry=(--dry-run)
out="${OUT:-$root/gpu-device-run}"
python="${PYTHON:-python3}"
site="${GPU_SITE:-/tmp/site}"
work="${GPU_WORK:-/tmp/gpu-check}"
budget="${GPU_RUN_BUDGET_S:-420}"
mkdir -p "$out" "$site"
rm -rf "$work"
exec > >(tee "$out/gpu-check.log") 2>&1
echo "gpu-device-run: $(date -u +%FT%TZ) on $(hostname); $("$python" --version 2>&1) at $(command -v "$python")"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem \
    --format=csv,noheader
wheels=("${GPU_WHEELS:-$root/.whl}"/*.whl)  # GPU_WHEELS=/nowhere on a dry run by another python than 3.12
if [[ -e ${wheels[0]} ]]; then
    echo "installing ${#wheels[@]} wheels into $site"
    timeout 90 "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" "${wheels[@]}" || echo "!! the wheels did not install (the parts that need them will fail)"
else
    echo "!! no wheels in ${GPU_WHEELS:-$root/.whl} (carry .whl: see docs/GPU.md)"
fi
cp "$root/scripts/swarm_checkout.py" "$site/"
export SWARM_CHECKOUT="$root" PYTHONPATH="$site:$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
hook='import os; os.environ.get("SWARM_CHECKOUT") and __import__("swarm_checkout")'
purelib="$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
if ((${#dry[@]} == 0)) && echo "$hook" 2>/dev/null >"$purelib/swarm-checkout.pth"; then
    echo "swarm importable from $root through $purelib/swarm-checkout.pth"
else
    echo "import swarm_checkout" >"$site/sitecustomize.py"
    echo "swarm importable from $root through $site/sitecustomize.py"
fi
timeout 90 "$python" - <<'EOF' || echo "!! the import check exited $? (a FAILED line above: the parts that need it fail)"
import importlib
for name in ("swarm.proto.stage_pb2", "swarm.compression", "swarm.kernels", "swarm.daemon.peer", "hivemind",
             "zstandard", "cryptography", "transformers"):
    try:
        module = importlib.import_module(name)
        print(f"import {name}: ok {getattr(module, '__version__', '')} ({module.__file__})")
    except Exception as error:
        print(f"import {name}: FAILED {type(error).__name__}: {error}")
EOF
status=0
OUT="$work" PYTHON="$python" GPU_CHECK_BUDGET_S=$((budget - SECONDS - 40)) \
    bash "$root/scripts/gpu-check.sh" "${dry[@]}" || status=$?
cp "$work/summary.json" "$out/" 2>/dev/null || echo "!! no summary.json (see gpu-check.log)"
tar -czf "$out/gpu-check.tar.gz" -C "$(dirname "$work")" --exclude=checkpoints --exclude=run "$(basename "$work")"
ls -la "$out"
echo "gpu-device-run: status $status"
exit $status
