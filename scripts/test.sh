#!/usr/bin/env bash
# The test command (see README): lint, then the whole test suite. Extra arguments go to pytest (one run, as given).
#
# Without arguments the suite runs as four pytest processes side by side, the way CI runs it:
#   - tests/integration minus the files below, in the foreground;
#   - the files below (the long multi-process swarms, and every test that makes network namespaces: those
#     count the namespaces left over, so they never run beside each other), in the background;
#   - tests/unit/runtime, in the background: its tests wait on deadlines (heartbeats, dead peers, hung calls)
#     more than they compute, about 3x their CPU time in the suite; with them the live freezing and per-link
#     codec tests (two of the longest of the rest of tests/integration), which keeps the four runs about equally
#     long;
#   - the rest of tests/ (the other unit tests), in the background.
# The integration tests mostly wait on processes starting, DHT records and plans: one after another they keep
# about one of CI's 2 cores busy. The background runs' output is shown once all are done; the exit status is the
# first failure's. A new integration file lands in the foreground run.
#
# Four runs and their swarms' processes already fill CI's 2 cores, so torch computes on one thread in each
# (OMP_NUM_THREADS=1 unless set): with more, OpenMP's waiting threads spin against the other runs' work. With it
# and the fourth run the suite took 13.8 min and 24.4 CPU-min here, against 15.3 and 27.2 as three runs.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/env.sh"
cd "$root"
ruff check .
if [ "$#" -gt 0 ]; then
    exec python -m pytest -q "$@"
fi
swarms=(
    tests/integration/test_churn.py tests/integration/test_netns.py tests/integration/test_nat_netns.py
    tests/integration/test_torch_baseline.py tests/integration/test_churn_peers.py
    tests/integration/test_attacks_quick.py tests/integration/test_throttled.py
    tests/integration/test_owned_failover.py tests/integration/test_planner_failover.py
    tests/integration/test_replan.py tests/integration/test_netns_firewall.py
)
logs="$(mktemp -d)"
pids=()
cleanup() {
    for pid in ${pids[@]+"${pids[@]}"}; do
        if kill -0 "$pid" 2>/dev/null; then
            kill "$pid" 2>/dev/null || true
            wait "$pid" 2>/dev/null || true
        fi
    done
    rm -rf "$logs"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
python -m pytest -q "${swarms[@]}" >"$logs/swarms" 2>&1 &
pids+=("$!")
beside_runtime=(tests/integration/test_freeze_live.py tests/integration/test_per_link_codecs.py)
python -m pytest -q tests/unit/runtime "${beside_runtime[@]}" >"$logs/runtime" 2>&1 &
pids+=("$!")
python -m pytest -q tests --ignore=tests/integration --ignore=tests/unit/runtime >"$logs/unit" 2>&1 &
pids+=("$!")
ignores=()
for file in "${swarms[@]}" "${beside_runtime[@]}"; do
    ignores+=(--ignore="$file")
done
rc=0
python -m pytest -q tests/integration "${ignores[@]}" || rc=$?
names=("the long swarm tests (${swarms[*]})" "tests/unit/runtime and ${beside_runtime[*]}" "the rest of tests/unit")
files=(swarms runtime unit)
for i in "${!pids[@]}"; do
    code=0
    wait "${pids[$i]}" || code=$?
    echo "--- ${names[$i]}, run beside the rest of tests/integration: exit status $code ---"
    cat "$logs/${files[$i]}"
    if [ "$rc" -eq 0 ]; then
        rc=$code
    fi
done
pids=()
exit "$rc"
