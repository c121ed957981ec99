"""Nodes/Register refuses hosts no node can be at (issue 21, item 4): link-local,
metadata, unspecified, multicast and broadcast addresses, and with --node-networks any
address outside them. The decision is pure (controlplane.nodeurls); a real daemon applies it."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import grpc
import pytest

from controlplane.daemon import Daemon
from controlplane.nodeurls import NodeNetworks, host_problem, literal_address, names_to_resolve, node_hosts
from tests.conftest import Client, DaemonFactory, daemon_settings
from tests.factories import node_request

NONE = NodeNetworks()
TEN = NodeNetworks.parse(["10.0.0.0/16", "fd00:1::/64"])


@pytest.mark.parametrize(
    ("host", "why"),
    [
        ("169.254.169.254", "metadata service's address"),
        ("[fd00:ec2::254]", "metadata service's address"),
        ("::ffff:169.254.169.254", "metadata service's address"),
        ("2852039166", "metadata service's address"),  # 169.254.169.254 as a resolver reads it
        ("0xa9.0xfe.0xa9.0xfe", "metadata service's address"),
        ("169.254.1.1", "link-local"),
        ("fe80::1", "link-local"),
        ("fe80::1%eth0", "link-local"),
        ("0.0.0.0", "unspecified"),
        ("0.1.2.3", "unspecified"),
        ("::", "unspecified"),
        ("224.0.0.1", "multicast"),
        ("ff02::1", "multicast"),
        ("255.255.255.255", "broadcast"),
        ("metadata.google.internal", "metadata service's name"),
        ("Metadata.Google.Internal.", "metadata service's name"),
    ],
)
def test_no_node_is_at_these_hosts(host: str, why: str) -> None:
    problem = host_problem("http_url", host, NONE, {})
    assert problem.startswith(f"http_url host {host!r} is refused: ")
    assert why in problem


@pytest.mark.parametrize("host", ["127.0.0.1", "10.0.0.7", "::1", "2001:db8::1", "d-0.vllm", "p"])
def test_other_hosts_pass_without_an_allowlist(host: str) -> None:
    assert host_problem("http_url", host, NONE, {}) == ""
    assert names_to_resolve([host], NONE) == set()  # names are not resolved without one


def test_an_allowlist_takes_only_its_networks() -> None:
    assert host_problem("engine_url", "10.0.3.4", TEN, {}) == ""
    assert host_problem("engine_url", "fd00:1::9", TEN, {}) == ""
    assert host_problem("engine_url", "10.1.0.1", TEN, {}) == (
        "engine_url host '10.1.0.1' is refused: 10.1.0.1 is outside the node networks "
        "(--node-networks 10.0.0.0/16,fd00:1::/64)"
    )
    # (an allowlist never lets a forbidden address in)
    assert "link-local" in host_problem("http_url", "169.254.0.9", NodeNetworks.parse(["0.0.0.0/0"]), {})


def test_with_an_allowlist_names_must_resolve_into_it() -> None:
    hosts = ["d-0.vllm", "10.0.0.1", "metadata.google.internal", "D-1.VLLM."]
    assert names_to_resolve(hosts, TEN) == {"d-0.vllm", "d-1.vllm"}
    assert host_problem("http_url", "d-0.vllm", TEN, {"d-0.vllm": ["10.0.0.9"]}) == ""
    assert host_problem("http_url", "d-0.vllm", TEN, {"d-0.vllm": ["10.0.0.9", "192.168.1.1"]}) == (
        "http_url host 'd-0.vllm' is refused: it resolves to 192.168.1.1, 192.168.1.1 is outside "
        "the node networks (--node-networks 10.0.0.0/16,fd00:1::/64)"
    )
    assert host_problem("http_url", "d-0.vllm", TEN, {}) == (
        "http_url host 'd-0.vllm' is refused: it does not resolve, and with --node-networks set "
        "a node's name must resolve into them"
    )


def test_networks_parse_and_refuse_what_is_no_network() -> None:
    assert str(NodeNetworks.parse(["10.0.0.5", "fd00::/8"])) == "10.0.0.5/32,fd00::/8"
    with pytest.raises(ValueError, match=re.escape("node network '10.0.0/33' is not a CIDR")):
        NodeNetworks.parse(["10.0.0/33"])


def test_node_hosts_and_literals() -> None:
    assert node_hosts("http://[fe80::1]:80/", "", "10.0.0.7") == [
        ("http_url", "fe80::1"),
        ("side_channel_host", "10.0.0.7"),
    ]
    assert literal_address("d-0") is None
    assert str(literal_address("[::1]")) == "::1"


async def _refusal(client: Client, **fields: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await client.nodes.Register(node_request(**fields), timeout=10)
    return info.value


async def test_register_refuses_a_metadata_url(client: Client) -> None:
    """The attack of issue 21: a node whose http_url is the cloud metadata service."""
    err = await _refusal(client, http_url="http://169.254.169.254/latest/meta-data/")
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == ("http_url host '169.254.169.254' is refused: a cloud metadata service's address")
    err = await _refusal(client, engine_url="http://[fe80::1]:8000")
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "engine_url host 'fe80::1' is refused: a link-local address" in (err.details() or "")
    err = await _refusal(client, side_channel_host="224.0.0.251")
    assert err.details() == "side_channel_host host '224.0.0.251' is refused: a multicast address"
    await client.nodes.Register(node_request(), timeout=10)  # (the same, at a good address)


async def test_register_under_an_allowlist(
    make_daemon: DaemonFactory, etcd_endpoint: str, connect: Callable[[Daemon], Client]
) -> None:
    base = daemon_settings(etcd_endpoint)
    networks = NodeNetworks.parse(["127.0.0.0/8", "10.0.0.0/24"])
    d = await make_daemon(replace(base, nodes=replace(base.nodes, networks=networks)))
    client = connect(d)
    await client.nodes.Register(node_request("d-a", http_url="http://localhost:8100"), timeout=10)
    err = await _refusal(client, engine_id="d-b", http_url="http://10.0.1.5:8100")
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == (
        "http_url host '10.0.1.5' is refused: 10.0.1.5 is outside the node networks "
        "(--node-networks 127.0.0.0/8,10.0.0.0/24)"
    )
    err = await _refusal(client, engine_id="d-c", http_url="http://no-such-node.invalid:8100")
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "http_url host 'no-such-node.invalid' is refused: it does not resolve" in (err.details() or "")
