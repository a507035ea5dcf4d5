"""Stand-in for sglang.srt.utils.network: `NetworkAddress` as SGLang defines it (parse,
IPv6 brackets, to_tcp), without the rest of the module (psutil, ZMQ authentication)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass


def _is_ipv6(host: str) -> bool:
    try:
        ipaddress.IPv6Address(host)
        return True
    except ValueError:
        return False


def _wrap(host: str) -> str:
    return f"[{host}]" if _is_ipv6(host) else host


def _parse_port(s: str) -> int:
    try:
        port = int(s)
    except ValueError:
        raise ValueError(f"Invalid port number: {s!r}")
    if not (0 <= port <= 65535):
        raise ValueError(f"Port out of range (0-65535): {port}")
    return port


@dataclass(frozen=True)
class NetworkAddress:
    host: str
    port: int

    def __post_init__(self):
        if self.host.startswith("[") and self.host.endswith("]"):
            object.__setattr__(self, "host", self.host[1:-1])

    @property
    def is_ipv6(self) -> bool:
        return _is_ipv6(self.host)

    def to_url(self, scheme: str = "http") -> str:
        return f"{scheme}://{_wrap(self.host)}:{self.port}"

    def to_tcp(self) -> str:
        return self.to_url("tcp")

    @staticmethod
    def parse(addr: str) -> NetworkAddress:
        """`[::1]:8000`, `127.0.0.1:8000` or `host:8000`; bare IPv6 is ambiguous."""
        if not addr:
            raise ValueError("Empty address string")
        if addr.startswith("["):
            close = addr.find("]")
            if close == -1:
                raise ValueError(f"Missing closing bracket in IPv6 address: {addr!r}")
            host = addr[1:close]
            if not _is_ipv6(host):
                raise ValueError(f"Invalid IPv6 address inside brackets: {host!r}")
            rest = addr[close + 1 :]
            if not rest.startswith(":") or len(rest) < 2:
                raise ValueError(f"Expected ':port' after closing bracket, got: {rest!r}")
            return NetworkAddress(host, _parse_port(rest[1:]))
        if ":" not in addr:
            raise ValueError(f"Missing port in address (expected host:port): {addr!r}")
        host, port_str = addr.rsplit(":", 1)
        if not host:
            raise ValueError(f"Empty host in address: {addr!r}")
        if ":" in host and _is_ipv6(host):
            raise ValueError(f"Bare IPv6 address without brackets is ambiguous: {addr!r}")
        return NetworkAddress(host, _parse_port(port_str))
