"""etcd going away under the daemon, and bad input: clear errors, nothing lost, no crash."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable
from dataclasses import replace

import grpc
import pytest
import structlog

from controlplane.daemon import Daemon
from controlplane.service.lookups import PROMPT_WAIT_S
from kvferry.v1 import leases_pb2, nodes_pb2
from tests.conftest import Client, DaemonFactory, EtcdProcess, daemon_settings
from tests.factories import d_params, lease_request, lookup_request, node_request
from tests.polling import eventually


async def test_etcd_stopped_and_restarted_under_the_daemon(
    private_etcd: EtcdProcess, make_daemon: DaemonFactory, connect
) -> None:  # type: ignore[no-untyped-def]
    d: Daemon = await make_daemon(daemon_settings(private_etcd.endpoint))
    c: Client = connect(d)
    await c.nodes.Register(node_request("d-1", liveness_ttl_seconds=30))
    await c.leases.Register(lease_request("before"))

    with structlog.testing.capture_logs() as logs:
        await private_etcd.stop()

        # Decided from memory while the shard's ownership and this replica's view of the
        # nodes (controlplane.solewriter) are provably current: seconds, then no more.
        async def unavailable() -> bool:
            down = await c.leases.Lookup(lookup_request("before", peek=True), timeout=10)
            assert down.decision == leases_pb2.PULL or down.reason == "store_unavailable", down
            return down.reason == "store_unavailable"

        await eventually(unavailable, within=10, interval=0.05)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await c.leases.Register(lease_request("during"), timeout=10)
        # (UNAVAILABLE: decided by the shard's owner, its write not taken; ABORTED: turned
        # away undecided, the ownership no longer confirmed)
        assert e.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED)
        assert "etcd" in (e.value.details() or "")
        await asyncio.sleep(1.5)  # several node refreshes fail meanwhile (every 0.5 s)

        await private_etcd.start()
        for _ in range(100):  # the daemon reconnects by itself
            up = await c.leases.Lookup(lookup_request("before", peek=True), timeout=10)
            if up.reason != "store_unavailable":
                break
            await asyncio.sleep(0.1)
        assert up.decision == leases_pb2.PULL, up
        for _ in range(50):
            if any(e["event"] == "nodes.refresh.recovered" for e in logs):
                break
            await asyncio.sleep(0.1)
    # One warning for the outage, not one per refresh, and a line when it is over.
    events = [e["event"] for e in logs if e["event"].startswith("nodes.refresh")]
    assert events == ["nodes.refresh.failed", "nodes.refresh.recovered"], events
    await c.leases.Register(lease_request("after"))
    assert (await c.leases.Lookup(lookup_request("after"))).decision == leases_pb2.PULL


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"conversation_id": ""}, "conversation_id is required"),
        ({"conversation_id": "x" * 300}, "conversation_id is 300 bytes"),
        ({"conversation_id": "a\nb"}, "conversation_id contains control characters"),
        ({"num_tokens": -5}, "num_tokens -5"),
        ({"block_digests": b"\x01" * 17}, "block_digests is 17 bytes, not a multiple"),
        ({"block_digests": b"\x01" * 16 * 100}, "block_digests has 100 digests"),
        ({"engine_id": ""}, "engine_id is required"),
        ({"block_size": 32}, "block_size 32 differs"),
    ],
)
async def test_bad_lease_registrations(client: Client, change: dict[str, object], field: str) -> None:
    await client.nodes.Register(node_request("d-1"))
    req = lease_request("conv-bad")
    for k, v in change.items():
        setattr(req, k, v)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await client.leases.Register(req)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in (e.value.details() or "")
    listed = await client.leases.List(leases_pb2.ListLeasesRequest())
    assert not listed.leases, "nothing half-written"


async def test_params_missing_what_p_needs(client: Client) -> None:
    await client.nodes.Register(node_request("d-1"))
    params = d_params("d-1", 1000)
    del params["remote_request_id"]
    params["remote_block_ids"] = []
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await client.leases.Register(lease_request("c", params=params))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = e.value.details() or ""
    assert "kv_transfer_params.remote_request_id is required" in details
    assert "kv_transfer_params.remote_block_ids is required" in details
    for not_a_list in (5, True, {"a": 1}, "1,2"):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await client.leases.Register(
                lease_request("c", params={**d_params("d-1", 1000), "remote_block_ids": not_a_list})
            )
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, not_a_list
        assert "remote_block_ids must be a list" in (e.value.details() or ""), not_a_list


async def test_expiry_in_the_past_and_unknown_engine(client: Client) -> None:
    await client.nodes.Register(node_request("d-1"))
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await client.leases.Register(lease_request("c", expires_in=-30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "expires_at" in (e.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await client.leases.Register(lease_request("c", engine_id="nobody"))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "nobody" in (e.value.details() or "")
    await client.nodes.Register(node_request("p-1", role=nodes_pb2.PREFILL))
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await client.leases.Register(lease_request("c", engine_id="p-1"))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "prefill" in (e.value.details() or "")


async def test_bad_lookups_and_nodes(client: Client) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await client.leases.Lookup(leases_pb2.LookupRequest(conversation_id="c", prompt_tokens=-1))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt_tokens" in (e.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await client.leases.Lookup(leases_pb2.LookupRequest(conversation_id="c", prompt_digests=b"abc"))
    assert "prompt_digests is 3 bytes" in (e.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as e:  # (it answered below_threshold)
        await client.leases.Lookup(leases_pb2.LookupRequest(conversation_id="c"))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt_tokens is required" in (e.value.details() or "")
    peek = await client.leases.Lookup(leases_pb2.LookupRequest(conversation_id="c", peek=True))
    assert peek.reason == "no_lease"  # a peek may leave it out (the router's stream probe does)
    for bad, text in [
        (node_request(role=7), "role 7"),
        (node_request(role=0), "role is missing: give PREFILL, DECODE or BOTH"),
        (node_request(block_size=0), "block_size 0"),
        (node_request(side_channel_port=0), "side_channel_port 0"),
        (node_request(http_url="ftp://x"), "http_url"),
        (node_request(engine_url="tcp://x"), "engine_url"),
        (
            node_request(engine_url="http://"),
            "engine_url 'http://' must be an http:// or https:// URL with a host",
        ),
        (node_request(engine_url="http://" + "x" * 2100), "engine_url is longer than 2048 bytes"),
        (node_request(engine_id=""), "engine_id is required"),
        (node_request(generation=2**64 - 1), "generation 18446744073709551615 must be below"),
    ]:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await client.nodes.Register(bad)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and text in (e.value.details() or ""), bad
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await client.leases.List(leases_pb2.ListLeasesRequest(page_token="!!not-a-token"))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_oversized_messages_are_refused(make_daemon: DaemonFactory, connect) -> None:  # type: ignore[no-untyped-def]
    from controlplane.settings import ServerSettings

    d = await make_daemon(
        server=ServerSettings(listen="127.0.0.1:0", metrics_port=-1, max_message_bytes=64 * 1024)
    )
    c = connect(d)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await c.leases.Lookup(leases_pb2.LookupRequest(conversation_id="c", prompt_digests=b"\0" * 16 * 8192))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (await c.leases.Lookup(lookup_request("c"))).reason == "no_lease", "the daemon is still serving"


async def test_etcd_members_named_by_dns_are_followed_to_new_addresses(
    etcd_endpoint: str,
    make_daemon: DaemonFactory,
    connect,
    monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
) -> None:
    """Members given by name (a StatefulSet's pods): gRPC resolves no list of names, so the
    daemon does, and again while it runs. A name that does not resolve yet is left out
    (the daemon crashed at start), and a member's pod restarted under a new address is
    followed (the daemon kept its old addresses until it restarted: etcd unavailable)."""
    import controlplane.etcd

    port = etcd_endpoint.rpartition(":")[2]
    table: dict[str, str | None] = {"etcd-0.test": "127.0.0.1", "etcd-1.test": None}

    def resolve(name: str) -> list[str]:
        ip = table.get(name)
        if ip is None:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [ip]

    monkeypatch.setattr(controlplane.etcd, "_resolve", resolve)
    settings = daemon_settings(etcd_endpoint)
    etcd = replace(settings.etcd, endpoints=(f"etcd-0.test:{port}", f"etcd-1.test:{port}"), dns_refresh_s=0.1)
    d = await make_daemon(replace(settings, etcd=etcd))
    client = connect(d)
    await client.nodes.Register(node_request("d-1"))

    async def registers() -> bool:
        try:
            await client.nodes.Register(node_request("d-1"), timeout=10)
        except grpc.aio.AioRpcError as e:  # (longer than the daemon's etcd timeout: its answer)
            assert e.code() == grpc.StatusCode.UNAVAILABLE, e
            return False
        return True

    table["etcd-0.test"] = "127.0.0.2"  # etcd-0 moved, to where no etcd listens
    await eventually(lambda: _negated(registers()), within=10)
    table["etcd-1.test"] = "127.0.0.1"  # etcd-1 is up, where the etcd is
    await eventually(registers, within=10)
    table.clear()  # DNS is down: the addresses last known stay in use
    await asyncio.sleep(0.3)
    assert await registers()


def test_several_etcd_endpoints_make_one_valid_grpc_target(monkeypatch: pytest.MonkeyPatch) -> None:
    """Several members were joined into "ipv6:1.2.3.4:2379,...", a target gRPC refuses:
    a daemon given more than one etcd endpoint could reach none of them."""
    import controlplane.etcd
    from controlplane.etcd import channel_target

    table = {"two.test": ["10.0.0.4", "10.0.0.3"]}

    def resolve(name: str) -> list[str]:
        if name not in table:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return sorted(table[name])

    monkeypatch.setattr(controlplane.etcd, "_resolve", resolve)
    assert channel_target(("10.0.0.1:2379", "10.0.0.2:2379")) == "ipv4:10.0.0.1:2379,10.0.0.2:2379"
    assert channel_target(("[fd00::1]:2379", "10.0.0.2:2379")) == "ipv6:[fd00::1]:2379,[::ffff:10.0.0.2]:2379"
    assert channel_target(("etcd.test:2379",)) == "dns:///etcd.test:2379"  # (gRPC resolves one name)
    assert channel_target(("none.test:2379", "10.0.0.2:2379")) == "ipv4:10.0.0.2:2379"
    assert channel_target(("none.test:2379", "nor.test:2379")) == "dns:///none.test:2379"
    known: dict[str, list[str]] = {}
    both = "ipv4:10.0.0.1:2379,10.0.0.3:2379,10.0.0.4:2379"
    assert channel_target(("10.0.0.1:2379", "two.test:2379"), known) == both  # every address
    table.clear()  # a DNS outage: the last addresses stay
    assert channel_target(("10.0.0.1:2379", "two.test:2379"), known) == both


async def _negated(check: Awaitable[bool]) -> bool:
    return not await check


async def test_a_claim_that_etcd_fails_after_goes_back(
    daemon: Daemon, client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """etcd fails between the claim and the rest of the decision (reading the node): nobody
    was handed the retention, and the claim was decided in its owner's memory, so it goes
    back for the next turn (it used to be spent, its release in the answer: an etcd claim
    could not be undone while etcd failed)."""
    from controlplane.errors import StoreUnavailable

    await client.nodes.Register(node_request("d-1"))
    await client.leases.Register(lease_request("c"))
    assert daemon.control_plane is not None

    async def failing(engine_id: str, fresh: bool = False) -> None:
        raise StoreUnavailable("etcd went away")

    monkeypatch.setattr(daemon.control_plane.nodes, "get", failing)
    resp = await client.leases.Lookup(lookup_request("c"))
    assert resp.decision == leases_pb2.RECOMPUTE and resp.reason == "store_unavailable", resp
    assert not resp.claimed and not resp.HasField("release_params")
    monkeypatch.undo()
    again = await client.leases.Lookup(lookup_request("c"))
    assert again.decision == leases_pb2.PULL and again.claimed, again


def _undecodable(batch: leases_pb2.LeaseOpBatch) -> bytes:
    """`batch` on the wire with its conversation id made invalid UTF-8 (which proto3
    strings must be): what a broken client could send."""
    raw = batch.SerializeToString()
    assert raw.count("ÿ".encode()) == 1
    return raw.replace("ÿ".encode(), b"\xff\xff")


async def test_a_message_that_does_not_decode_gets_invalid_argument(daemon: Daemon, client: Client) -> None:
    """Unary: INVALID_ARGUMENT naming the problem (it was UNKNOWN). Leases/Stream: the ops
    already running still answer (a claim etcd applied is not lost), then the stream
    ends with INVALID_ARGUMENT."""
    await client.nodes.Register(node_request("d-1"))
    await client.leases.Register(lease_request("claimed"))
    bad_lookup = lookup_request("ÿ").SerializeToString().replace("ÿ".encode(), b"\xff\xff")
    raw_lookup = client.channel.unary_unary(
        "/kvferry.v1.Leases/Lookup",
        request_serializer=lambda b: b,
        response_deserializer=leases_pb2.LookupResponse.FromString,
    )
    with pytest.raises(grpc.aio.AioRpcError) as unary:
        await raw_lookup(bad_lookup)
    assert unary.value.code() is grpc.StatusCode.INVALID_ARGUMENT, unary.value
    assert "does not decode" in (unary.value.details() or "")

    stream = client.channel.stream_stream(
        "/kvferry.v1.Leases/Stream",
        request_serializer=lambda b: b,
        response_deserializer=leases_pb2.LeaseOpResultBatch.FromString,
    )()
    await client.leases.Register(lease_request("waits"))
    early = leases_pb2.LookupRequest(conversation_id="waits", prompt_follows=True)
    good = leases_pb2.LeaseOpBatch(
        ops=[
            leases_pb2.LeaseOp(id=1, lookup=lookup_request("claimed")),
            leases_pb2.LeaseOp(id=3, lookup=early),
        ]
    )
    await stream.write(good.SerializeToString())
    bad = leases_pb2.LeaseOpBatch(ops=[leases_pb2.LeaseOp(id=2, lookup=lookup_request("ÿ"))])
    await stream.write(_undecodable(bad))
    results = []
    with pytest.raises(grpc.aio.AioRpcError) as ended:
        async with asyncio.timeout(PROMPT_WAIT_S / 2):  # the waiting lookup does not wait it out
            async for batch in stream:
                results.extend(batch.results)
    assert ended.value.code() is grpc.StatusCode.INVALID_ARGUMENT, ended.value
    answers = sorted((r.id, r.lookup.decision, r.lookup.reason) for r in results)
    assert answers == [(1, leases_pb2.PULL, "pull"), (3, leases_pb2.RECOMPUTE, "no_prompt")]


async def test_a_retention_larger_than_the_store_takes_is_refused_not_retried(client: Client) -> None:
    """A retention whose record etcd would refuse (a conversation of ~1M tokens at 16 a
    block) is refused at once, naming its size: with shard owners, a write etcd refuses
    would wait in the write-behind, retried, holding up its shard's later writes."""
    await client.nodes.Register(node_request("d-1"))
    tokens = 70_000 * 16
    req = lease_request("c-huge", num_tokens=tokens, params=d_params("d-1", 16))
    req.block_digests = b"\x01" * 16 * 70_000  # (1.1 MB of digests: ~1.5 MB as stored)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await client.leases.Register(req)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "more than the store takes" in (e.value.details() or "")
    small = lease_request("c-next")  # (the shard's next write is not held up)
    await asyncio.wait_for(client.leases.Register(small), 10)
    listed = await client.leases.List(leases_pb2.ListLeasesRequest())
    assert [r.conversation_id for r in listed.leases] == ["c-next"]
