#!/usr/bin/env bash
# The test command (see README): lint, then the whole test suite. Extra arguments go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/env.sh"
cd "$root"
ruff check .
exec python -m pytest -q "$@"
