#!/usr/bin/env bash
# The test command (see README): lint, then the whole test suite. Extra arguments go to pytest (one run, as given).
#
# Without arguments the suite runs as two pytest processes side by side: tests/integration in the foreground and
# the rest (tests/unit, CPU-bound, one process) beside it, its output shown once both are done. The integration
# tests mostly wait on processes starting, DHT records and plans: on a 2-core machine they keep about one core
# busy, so the unit suite runs in the other instead of after them. The exit status is the first failure's.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/env.sh"
cd "$root"
ruff check .
if [ "$#" -gt 0 ]; then
    exec python -m pytest -q "$@"
fi
unit_log="$(mktemp)"
unit=""
cleanup() {
    if [ -n "$unit" ] && kill -0 "$unit" 2>/dev/null; then
        kill "$unit" 2>/dev/null || true
        wait "$unit" 2>/dev/null || true
    fi
    rm -f "$unit_log"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
python -m pytest -q tests --ignore=tests/integration >"$unit_log" 2>&1 &
unit=$!
integration_rc=0
python -m pytest -q tests/integration || integration_rc=$?
unit_rc=0
wait "$unit" || unit_rc=$?
unit=""
echo "--- tests/unit (ran beside tests/integration) ---"
cat "$unit_log"
if [ "$integration_rc" -ne 0 ]; then
    exit "$integration_rc"
fi
exit "$unit_rc"
