"""Addresses, checked one way for every process: engine and sidecar URLs (the daemon
and every settings parser disagreed once: the daemon refused what a sidecar had
accepted at start-up), listen addresses and advertised host:port pairs."""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit


def is_http_url(url: str) -> bool:
    """An http:// or https:// URL (scheme in any case) with a host."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return False
    return parts.scheme.lower() in ("http", "https") and bool(parts.hostname)


def listen_host_port(listen: str) -> tuple[str, int]:
    """(host, port) of a listen address HOST:PORT or [IPV6]:PORT (an empty host: all)."""
    host, _, port = listen.rpartition(":")
    if not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"listen address {listen!r} must be host:port")
    return host.strip("[]") or "0.0.0.0", int(port)


def split_host_port(value: str, what: str) -> tuple[str, int | None]:
    """An address given as HOST, HOST:PORT, IPV6, [IPV6] or [IPV6]:PORT -> (host, port or
    None). Raises ValueError naming `what` and the problem."""
    text = value.strip()
    if "/" in text or "@" in text:
        raise ValueError(f"{what} {value!r}: expected HOST or HOST:PORT, not a URL")
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"{what} {value!r}: expected [IPV6] or [IPV6]:PORT")
        _check_ipv6(host, what, value)
        return host, _port(rest[1:], what, value) if rest else None
    if text.count(":") > 1:  # a bare IPv6 address, as a manifest's $(POD_IP) can be
        _check_ipv6(text, what, value)
        return text, None
    host, sep, port = text.partition(":")
    if not host or any(c.isspace() or c in "[]" for c in host):
        raise ValueError(f"{what} {value!r}: expected HOST or HOST:PORT")
    return host, _port(port, what, value) if sep else None


def local_address(listen: str, port: int) -> str:
    """HOST:PORT a client on this host reaches a server listening on `listen` at (its bound
    `port`): its host, a wildcard one as loopback."""
    host, _ = listen_host_port(listen)
    return join_host_port("127.0.0.1" if host in ("0.0.0.0", "::") else host, port)


def join_host_port(host: str, port: int) -> str:
    """HOST:PORT, an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _check_ipv6(host: str, what: str, value: str) -> None:
    try:
        ipaddress.IPv6Address(host)
    except ValueError:
        raise ValueError(f"{what} {value!r}: {host!r} is not an IPv6 address") from None


def _port(text: str, what: str, value: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"{what} {value!r}: port {text!r} must be 1..65535")
    return int(text)


def is_loopback(host: str) -> bool:
    """Whether `host` means "this machine" and so cannot be handed to another one."""
    h = host.strip().strip("[]").lower()
    if h in ("", "localhost", "localhost.localdomain") or h.endswith(".localhost"):
        return True
    try:
        ip = ipaddress.ip_address(h)
    except ValueError:
        return False
    return ip.is_loopback or ip.is_unspecified
