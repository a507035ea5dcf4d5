"""Stand-in for vllm.utils.network_utils: the four helpers the publisher imports, which it
uses only for a `tcp://*:0` endpoint. `get_ip` reads VLLM_HOST_IP and otherwise answers
loopback (vLLM's probes a route to a public address instead)."""

import ipaddress
import os
from urllib.parse import urlparse


def get_ip() -> str:
    return os.environ.get("VLLM_HOST_IP") or "127.0.0.1"


def is_valid_ipv6_address(address: str) -> bool:
    try:
        ipaddress.IPv6Address(address)
        return True
    except ValueError:
        return False


def get_tcp_uri(ip: str, port: int) -> str:
    return f"tcp://[{ip}]:{port}" if is_valid_ipv6_address(ip) else f"tcp://{ip}:{port}"


def split_zmq_path(path: str) -> tuple[str, str, str]:
    """(scheme, host, port) of a zmq path, as vLLM's: tcp needs both host and port."""
    parsed = urlparse(path)
    if not parsed.scheme:
        raise ValueError(f"Invalid zmq path: {path}")
    host = parsed.hostname or ""
    port = "" if parsed.port is None else str(parsed.port)
    if parsed.scheme == "tcp" and not (host and port):
        raise ValueError(f"Invalid zmq path: {path}")
    if parsed.scheme != "tcp" and port:
        raise ValueError(f"Invalid zmq path: {path}")
    return parsed.scheme, host, port
