#!/bin/sh
# The compose testbed's NAT router (`swarm testbed compose --nat I,J`; swarm/testbed/nat_routers.py builds the same
# in a namespace): masquerade the LANs' outgoing connections behind UPLINK_ADDRESS, forward the replies back,
# and nothing else: nothing new inwards (no port forwarding), nothing from one LAN to another. Needs cap_add
# NET_ADMIN and sysctls net.ipv4.ip_forward=1. SWARM_DRY_RUN=1 prints the iptables commands (the uplink as
# $up) and exits.
set -eu

if [ -n "${SWARM_DRY_RUN:-}" ]; then
    up='$up'
    run() { echo "$@"; }
else
    up=$(ip -o -4 addr show | awk -v a="$UPLINK_ADDRESS/" 'index($4, a) == 1 {print $2; exit}')
    run() { "$@"; }
fi

run iptables -t nat -A POSTROUTING -o "$up" -j MASQUERADE
run iptables -P FORWARD DROP
run iptables -A FORWARD ! -i "$up" -o "$up" -j ACCEPT
run iptables -A FORWARD -i "$up" -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT

[ -n "${SWARM_DRY_RUN:-}" ] && exit 0
exec sleep infinity
