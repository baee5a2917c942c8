"""The address a peer announces for its gRPC stage service: the one other peers dial, never a wildcard."""

from __future__ import annotations

import ipaddress
import socket

__all__ = ["outward_address", "stage_address", "stage_announce_host"]

_PROBE_TARGETS = {4: ("8.8.8.8", 53), 6: ("2001:4860:4860::8888", 53)}
"""Public addresses a UDP socket is connected to (no packet is sent) to learn the outward interface."""


def outward_address(version: int = 4) -> str | None:
    """This machine's address on the route to the internet (IPv`version`), or None without such a route.

    Connecting a UDP socket only picks the route and the source address; nothing goes on the wire.
    """
    family = socket.AF_INET if version == 4 else socket.AF_INET6
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(_PROBE_TARGETS[version])
            host = s.getsockname()[0]
    except OSError:
        return None
    return None if ipaddress.ip_address(host).is_unspecified else host


def stage_announce_host(listen_host: str, announce_host: str | None = None, detect=outward_address) -> str:
    """The host part of the stage address to announce.

    Args:
        listen_host: the address the stage service listens on (--host).
        announce_host: the address other peers should dial (--announce-host), if given.
        detect: finds the outward address of an IP version (a parameter for tests).

    Returns:
        `announce_host` when given, else `listen_host` unless it is a wildcard (0.0.0.0 or ::), else the
        outward address detected.

    Raises:
        ValueError: the address to announce is a wildcard, not an IP address, or can't be detected.
    """
    if announce_host is not None:
        try:
            ip = ipaddress.ip_address(announce_host)
        except ValueError:
            raise ValueError(f"--announce-host: expected an IP address, got {announce_host!r}") from None
        if ip.is_unspecified:
            raise ValueError(f"--announce-host: {announce_host} is a wildcard, not an address other peers can dial")
        return announce_host
    listening = ipaddress.ip_address(listen_host)
    if not listening.is_unspecified:
        return listen_host
    found = detect(listening.version)
    if found is None:
        raise ValueError(
            f"--host {listen_host} listens on every interface, but no outward address could be detected "
            "(no route to the internet): pass --announce-host with the address other peers should dial"
        )
    return found


def stage_address(host: str, port: int) -> str:
    """'host:port' as gRPC dials it ('[v6]:port' for IPv6)."""
    return f"[{host}]:{port}" if ipaddress.ip_address(host).version == 6 else f"{host}:{port}"
