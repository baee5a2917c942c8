#!/bin/sh
# Entrypoint of the compose testbed's containers (docker/compose.yaml):
#   1. shape eth0's egress with tc from RATE (Mbit/s; 0 or unset: unshaped) and LINKS ("ADDR=RATE ...":
#      per-destination rates, an htb class each), with exactly the commands the namespace testbed runs
#      (`swarm testbed shape`, the same code as `swarm testbed up`); needs cap_add NET_ADMIN;
#   1b. behind the NAT router (GATEWAY set), route through it;
#   2. hand DELAY (ms) to swarm-peer's application shaper as --delay-ms: netem is not assumed to exist;
#   3. exec the command.
# SWARM_DRY_RUN=1 prints the ip/tc commands, a line "--", then the final argv one per line, and exits
# (the unit tests check it this way, without Docker or root). SHAPE_DEV overrides the interface.
set -eu

dev="${SHAPE_DEV:-eth0}"
rate="${RATE:-0}"
delay="${DELAY:-0}"

shape() {
    # LINKS is split on whitespace on purpose: one --to per ADDR=RATE
    # shellcheck disable=SC2086
    set -- --dev "$dev" --rate-mbit "$rate" $(for link in ${LINKS:-}; do printf -- '--to %s ' "$link"; done)
    if [ -n "${SWARM_DRY_RUN:-}" ]; then
        swarm testbed shape "$@" --dry-run
    else
        swarm testbed shape "$@"
    fi
}
shape

# behind the compose testbed's NAT router (GATEWAY: its LAN address): route everything through it
if [ -n "${GATEWAY:-}" ]; then
    if [ -n "${SWARM_DRY_RUN:-}" ]; then
        echo "ip route replace default via $GATEWAY"
    else
        ip route replace default via "$GATEWAY"
    fi
fi

if [ "${1:-}" = "swarm-peer" ] && [ -n "$delay" ] && [ "$delay" != "0" ]; then
    set -- "$@" --delay-ms "$delay"
fi

if [ -n "${SWARM_DRY_RUN:-}" ]; then
    echo "--"
    printf '%s\n' "$@"
    exit 0
fi
exec "$@"
