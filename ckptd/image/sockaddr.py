"""TCP endpoints as images record them: raw sockaddr_in / sockaddr_in6 bytes."""

from __future__ import annotations

import ipaddress

AF_INET, AF_INET6 = 2, 10

Endpoint = tuple[bytes, int]  # (IPv6 or v4-mapped address, port)


def endpoint(raw: bytes) -> Endpoint:
    """A sockaddr_in or sockaddr_in6 as an IPv6 address and a port, so that
    an IPv4 client and the IPv6 socket a dual-stack listener accepted match."""
    family = int.from_bytes(raw[0:2], "little")
    port = int.from_bytes(raw[2:4], "big")
    if family == AF_INET:
        return b"\0" * 10 + b"\xff\xff" + raw[4:8], port
    return raw[8:24], port


def show_endpoint(ep: Endpoint) -> str:
    addr, port = ep
    if addr[:12] == b"\0" * 10 + b"\xff\xff":
        return f"{'.'.join(str(b) for b in addr[12:])}:{port}"
    return f"[{':'.join(addr[i : i + 2].hex() for i in range(0, 16, 2))}]:{port}"


def ip_sockaddr(address: str, port: int = 0) -> bytes:
    """A textual IPv4 or IPv6 address as raw sockaddr bytes (for endpoint())."""
    ip = ipaddress.ip_address(address)
    if ip.version == 4:
        return AF_INET.to_bytes(2, "little") + port.to_bytes(2, "big") + ip.packed + b"\0" * 8
    return AF_INET6.to_bytes(2, "little") + port.to_bytes(2, "big") + b"\0" * 4 + ip.packed + b"\0" * 4
