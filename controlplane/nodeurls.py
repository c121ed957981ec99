"""Where a node may say it is: the hosts of a registration's URLs and side channel.

A registered node's `http_url` is where routers send client turns (prompts, bearer
keys), its `engine_url` where prefill requests go, its `side_channel_host` where peers
pull KV blocks from. A registration naming a host no node can be at is refused here:
a link-local address (169.254.0.0/16, fe80::/10), a cloud metadata service
(169.254.169.254, fd00:ec2::254, metadata.google.internal, ...), the unspecified
address, a multicast or the broadcast address; and, when the operator lists the node
networks (`--node-networks CIDR,...`), any address outside them.

Names: without an allowlist a host name is taken as it is (only the metadata services'
well-known names are refused), never resolved: the daemon's resolver need not be the
routers', and the answer may change after the registration anyway. With an allowlist a
name must resolve, and every address it resolves to must be allowed: a name that does
not resolve is refused. (DNS can still change afterwards; an operator who needs more
pins the nodes' URLs to addresses and keeps a NetworkPolicy on egress.) Legacy numeric
forms that resolvers take as IPv4 addresses ("2852039166", "0xa9.254.169.254") are
read as the addresses they are, not as names.

Pure: no I/O. The async caller resolves the names `names_to_resolve` gives (see
controlplane.service.nodes) and passes the answers in.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

#: Names of cloud metadata services (a trailing dot and the case do not matter).
METADATA_NAMES = frozenset(
    {
        "metadata.google.internal",
        "metadata.goog",
        "metadata",
        "instance-data",
        "instance-data.ec2.internal",
    }
)
#: Addresses of cloud metadata services (AWS, GCP, Azure, OpenStack; AWS over IPv6;
#: Alibaba; Oracle's is the first).
METADATA_ADDRESSES = frozenset(
    ipaddress.ip_address(a) for a in ("169.254.169.254", "fd00:ec2::254", "100.100.100.200")
)
_THIS_NETWORK = ipaddress.ip_network("0.0.0.0/8")  # (a connect to 0.x reaches this host on Linux)
_BROADCAST = ipaddress.ip_address("255.255.255.255")


@dataclass(frozen=True)
class NodeNetworks:
    """The operator's allowlist of the networks node addresses must lie in (empty: any
    address not refused outright)."""

    networks: tuple[IpNetwork, ...] = ()

    @classmethod
    def parse(cls, items: Iterable[str]) -> NodeNetworks:
        """From CIDRs ("10.0.0.0/16", "fd00:1::/64"; a bare address is a /32 or /128).
        Raises ValueError naming the one that is not a network."""
        nets = []
        for item in items:
            try:
                nets.append(ipaddress.ip_network(item.strip(), strict=False))
            except ValueError as e:
                raise ValueError(f"node network {item!r} is not a CIDR (10.0.0.0/16, fd00::/64): {e}") from e
        return cls(tuple(nets))

    def __bool__(self) -> bool:
        return bool(self.networks)

    def __str__(self) -> str:
        return ",".join(str(n) for n in self.networks)

    def allows(self, ip: IpAddress) -> bool:
        """Whether `ip` lies in one of the networks (or there are none)."""
        return not self.networks or any(ip in n for n in self.networks)


def address_problem(ip: IpAddress, networks: NodeNetworks) -> str:
    """Why no node can be at `ip` ("" = it can)."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # ::ffff:169.254.169.254 reaches 169.254.169.254
    if ip in METADATA_ADDRESSES:
        return "a cloud metadata service's address"
    if ip.is_link_local:
        return "a link-local address (169.254.0.0/16, fe80::/10)"
    if ip.is_unspecified or ip in _THIS_NETWORK:
        return "the unspecified address"
    if ip.is_multicast:
        return "a multicast address"
    if ip == _BROADCAST:
        return "the broadcast address"
    if not networks.allows(ip):
        return f"{ip} is outside the node networks (--node-networks {networks})"
    return ""


def literal_address(host: str) -> IpAddress | None:
    """The address `host` names without a resolver: an IPv4 or IPv6 literal (a zone id
    allowed), or a legacy numeric IPv4 form a resolver would read as one. None: a name."""
    h = host.strip().strip("[]")
    try:
        return ipaddress.ip_address(h)
    except ValueError:
        pass
    try:
        return ipaddress.IPv4Address(socket.inet_aton(h))  # (pure: parses, resolves nothing)
    except OSError:
        return None


def _name(host: str) -> str:
    return host.strip().rstrip(".").lower()


def names_to_resolve(hosts: Iterable[str], networks: NodeNetworks) -> set[str]:
    """The host names the caller must resolve before `host_problem` can judge them: none
    without an allowlist (see the module's docstring)."""
    if not networks:
        return set()
    return {_name(h) for h in hosts if h and literal_address(h) is None and _name(h) not in METADATA_NAMES}


def host_problem(field: str, host: str, networks: NodeNetworks, resolved: Mapping[str, Sequence[str]]) -> str:
    """Why `host`, given as `field`, is refused ("" = it is not). `resolved`: the addresses
    of each name `names_to_resolve` returned (a name missing or with none: it did not
    resolve)."""
    ip = literal_address(host)
    if ip is not None:
        why = address_problem(ip, networks)
        return f"{field} host {host!r} is refused: {why}" if why else ""
    name = _name(host)
    if name in METADATA_NAMES:
        return f"{field} host {host!r} is refused: a cloud metadata service's name"
    if not networks:
        return ""
    addresses = resolved.get(name, ())
    if not addresses:
        return (
            f"{field} host {host!r} is refused: it does not resolve, and with --node-networks "
            "set a node's name must resolve into them"
        )
    for text in addresses:
        why = address_problem(ipaddress.ip_address(text.partition("%")[0]), networks)
        if why:
            return f"{field} host {host!r} is refused: it resolves to {text}, {why}"
    return ""


def url_host(url: str) -> str:
    """The host of `url` ("" = none, or not a URL)."""
    try:
        return urlsplit(url).hostname or ""
    except ValueError:
        return ""


def node_hosts(http_url: str, engine_url: str, side_channel_host: str) -> list[tuple[str, str]]:
    """(field, host) of each address a registration names (those given)."""
    out = [(f, url_host(u)) for f, u in (("http_url", http_url), ("engine_url", engine_url)) if u]
    if side_channel_host:
        out.append(("side_channel_host", side_channel_host))
    return [(f, h) for f, h in out if h]
