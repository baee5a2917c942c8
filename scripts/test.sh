#!/usr/bin/env bash
# The test command (see README): lint, then the whole test suite. Extra arguments go to pytest (one run, as given).
#
# Without arguments the suite runs as three pytest processes side by side, the way CI runs it:
#   - tests/integration minus the files below, in the foreground;
#   - the files below (the long multi-process swarms, and every test that makes network namespaces: those
#     count the namespaces left over, so they never run beside each other), in the background;
#   - the rest of tests/ (tests/unit: CPU-bound, one process), in the background.
# The integration tests mostly wait on processes starting, DHT records and plans: one after another they keep
# about one of CI's 2 cores busy. The background runs' output is shown once all are done; the exit status is the
# first failure's. A new integration file lands in the foreground run.
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
python -m pytest -q "${swarms[@]}" >"$logs/swarms" 2>&1 &
pids+=("$!")
python -m pytest -q tests --ignore=tests/integration >"$logs/unit" 2>&1 &
pids+=("$!")
ignores=()
for file in "${swarms[@]}"; do
    ignores+=(--ignore="$file")
done
rc=0
python -m pytest -q tests/integration "${ignores[@]}" || rc=$?
names=("the long swarm tests (${swarms[*]})" "tests/unit")
for i in "${!pids[@]}"; do
    code=0
    wait "${pids[$i]}" || code=$?
    echo "--- ${names[$i]}, run beside the rest of tests/integration: exit status $code ---"
    cat "$logs/$([ "$i" -eq 0 ] && echo swarms || echo unit)"
    if [ "$rc" -eq 0 ]; then
        rc=$code
    fi
done
pids=()
exit "$rc"
