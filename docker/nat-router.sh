#!/bin/sh
# The compose testbed's NAT router (`swarm testbed compose --nat I,J`; swarm/testbed/nat.py builds the same
# in a namespace): masquerade the LAN's outgoing connections behind UPLINK_ADDRESS, forward replies back, and
# nothing new inwards (no port forwarding). Needs cap_add NET_ADMIN and sysctls net.ipv4.ip_forward=1.
# SWARM_DRY_RUN=1 prints the iptables commands (with the interfaces as $up/$lan) and exits.
set -eu

dev_of() { ip -o -4 addr show | awk -v a="$1/" 'index($4, a) == 1 {print $2; exit}'; }

if [ -n "${SWARM_DRY_RUN:-}" ]; then
    up='$up' lan='$lan'
    run() { echo "$@"; }
else
    up=$(dev_of "$UPLINK_ADDRESS")
    lan=$(dev_of "$LAN_ADDRESS")
    run() { "$@"; }
fi

run iptables -t nat -A POSTROUTING -o "$up" -j MASQUERADE
run iptables -P FORWARD DROP
run iptables -A FORWARD -i "$lan" -o "$up" -j ACCEPT
run iptables -A FORWARD -i "$up" -o "$lan" -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT

[ -n "${SWARM_DRY_RUN:-}" ] && exit 0
exec sleep infinity
