#!/usr/bin/env bash
# The main job: a local swarm training on the embedded data set (see README). Extra arguments go to `swarm demo`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/env.sh"
cd "$root"
exec swarm demo "$@"
