#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: the GPU figures and the CUDA tests in one go, results under $OUT (or ./gpu-check).
#   scripts/gpu-check.sh             # everything on CUDA, within $GPU_CHECK_BUDGET_S seconds (default 420)
#   scripts/gpu-check.sh --dry-run   # the same parts on the CPU with tiny sizes and no pytest: checks this script
# Parts, most valuable first, each under its own timeout and the budget left (a part that fails or times out is
# reported and the others still run):
#   bench-kernels       the Triton kernels' GB/s, against the measured copy and the HBM's nominal peak
#   bench-gpt2-small    tokens/s per stage and boundary bytes per token (swarm bench model --device cuda)
#   bench-llama-100m    the same for llama-100m (built from a local config, nothing downloaded)
#   demo                a 2-peer swarm whose stages compute on CUDA, trained end to end (swarm demo --device cuda)
#   pytest-cuda         the tests marked cuda
#   pytest-triton       the Triton kernels' cases, compiled for and run on the GPU
#   kernel-sweep        only when GPU_CHECK_PARTS names it: scripts/kernel_sweep.py $KERNEL_SWEEP_ARGS
# $OUT/summary.json holds every figure (scripts/gpu_summary.py writes it and prints the summary last).
# Environment: PYTHON (default python), OUT, GPU_CHECK_BUDGET_S, GPU_CHECK_PARTS (names of the parts to run, space
# separated; default all). Exits 1 if any part failed or timed out, 2 without CUDA.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
dry=0
case "${1:-}" in
    "") ;;
    --dry-run) dry=1 ;;
    -h | --help)
        sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'
        exit 0
        ;;
    *)
        echo "gpu-check: unknown argument $1 (expected --dry-run or nothing)" >&2
        exit 2
        ;;
esac
out="${OUT:-$root/gpu-check}"
mkdir -p "$out"
python="${PYTHON:-python}"
budget="${GPU_CHECK_BUDGET_S:-420}"
export PYTHONUNBUFFERED=1
started=$SECONDS
device=cuda
if ((dry)); then
    device=cpu
elif ! "$python" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu-check: CUDA is not available to $python (torch $("$python" -c 'import torch; print(torch.__version__)'))" >&2
    exit 2
fi
timeout 90 "$python" - >"$out/device.json" <<'EOF'
import importlib, json, platform, sys
info = {"python": platform.python_version(), "executable": sys.executable}
for name in ("torch", "triton", "transformers", "hivemind", "grpc", "google.protobuf", "zstandard", "cryptography"):
    try:
        info[name] = importlib.import_module(name).__version__
    except Exception as error:  # a missing or broken package is a figure too
        info[name] = f"unavailable: {type(error).__name__}: {error}"
import torch
info["cuda"] = torch.version.cuda
if torch.cuda.is_available():
    props = torch.cuda.get_device_properties(0)
    info.update(device=torch.cuda.get_device_name(0), memory_gib=round(props.total_memory / 2**30, 1),
                multiprocessors=props.multi_processor_count, capability=f"{props.major}.{props.minor}")
print(json.dumps(info))
EOF
cat "$out/device.json"
status=0
: >"$out/parts.tsv"
reap() { # text: SIGKILL what this script started that still runs with `text` in its command line (the demo's
    # bootstrap node and peers run in sessions of their own, which a timeout's signal to its group misses)
    local pid
    for pid in $(grep -l -a -s -F -- "$1" /proc/[0-9]*/cmdline | cut -d/ -f3); do
        if [[ $pid != "$$" ]] && kill -9 "$pid" 2>/dev/null; then
            echo "   reaped pid $pid"
        fi
    done
}
run() { # name, cap seconds, command...: runs it under min(cap, budget left); keeps stdout and stderr apart
    local name="$1" cap="$2"
    shift 2
    if [[ -n ${GPU_CHECK_PARTS:-} && " $GPU_CHECK_PARTS " != *" $name "* ]]; then
        return
    fi
    local left=$((budget - (SECONDS - started)))
    local limit=$((cap < left ? cap : left))
    if ((limit < 15)); then
        echo "== $name: skipped (${left}s of the ${budget}s budget left)"
        printf '%s\tskipped\t0\n' "$name" >>"$out/parts.tsv"
        return
    fi
    echo "== $name (${limit}s): $*"
    local t0=$SECONDS rc=0
    # SIGINT first: Python unwinds (the demo stops its peers, pytest prints its summary); SIGKILL 20 s later
    timeout -s INT -k 20 "$limit" "$@" >"$out/$name.out" 2>"$out/$name.err" || rc=$?
    local took=$((SECONDS - t0)) result=ok
    if ((rc == 124 || rc == 137 || rc == 130)); then
        result=timeout
    elif ((rc != 0)); then
        result="failed:$rc"
    fi
    [[ $result == ok ]] || status=1
    printf '%s\t%s\t%s\n' "$name" "$result" "$took" >>"$out/parts.tsv"
    echo "-- $name: $result in ${took}s"
    tail -n 12 "$out/$name.err"
    tail -n 8 "$out/$name.out"
}
cli=("$python" -m swarm.cli)
demo_shape=(--batch-size 16 --seq-len 128)
echo '{"batch_size": 16, "seq_len": 128}' >"$out/demo-shape.json"
if ((dry)); then
    run bench-kernels 120 "${cli[@]}" bench kernels --quick --bits 2 --json
    run bench-gpt2-small 300 "${cli[@]}" bench model --model gpt2-tiny --stages 2 --iters 1 --json
    run bench-llama-100m 300 "${cli[@]}" bench model --model llama-tiny --stages 2 --iters 1 --json
    run demo 300 "${cli[@]}" demo --peers 2 "${demo_shape[@]}" --train-samples 32 --epochs 1 --rate-mbit 0 --json \
        --out "$out/demo"
    reap "$out/demo/"
else
    # 512 MiB of float32: several times the 50-60 MB L2, so the kernels stream from HBM
    run bench-kernels 120 "${cli[@]}" bench kernels --device cuda --sizes-kib 524288 --repeats 20 --json
    for model in gpt2-small llama-100m; do
        run "bench-$model" 120 "${cli[@]}" bench model --device cuda --model "$model" --stages 2 --micro-batch 8 \
            --seq-len 512 --iters 5 --json
    done
    run demo 180 "${cli[@]}" demo --device cuda --peers 2 "${demo_shape[@]}" --train-samples 128 --epochs 1 \
        --rate-mbit 0 --json --out "$out/demo"
    reap "$out/demo/"
    mapfile -t cuda_tests < <(grep -rl "mark.cuda" tests/unit | sort)
    run pytest-cuda 150 "$python" -m pytest -q -rs -m cuda -p no:cacheprovider "${cuda_tests[@]}"
    run pytest-triton 180 "$python" -m pytest -q -rs -p no:cacheprovider \
        tests/unit/kernels/test_kernels_triton_cases.py tests/unit/kernels/test_kernels_triton_sym_cases.py
    if [[ " ${GPU_CHECK_PARTS:-} " == *" kernel-sweep "* ]]; then # only when named: the launch choices' sweep
        # shellcheck disable=SC2086 # KERNEL_SWEEP_ARGS: the sweep's own flags (--tiles, --warps, --bits)
        run kernel-sweep 300 "$python" scripts/kernel_sweep.py ${KERNEL_SWEEP_ARGS:-}
    fi
fi
"$python" "$root/scripts/gpu_summary.py" "$out" || status=1
echo "gpu-check: ${SECONDS}s, status $status; figures in $out/summary.json"
exit $status
