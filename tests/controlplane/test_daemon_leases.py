"""Leases against a real daemon on a real etcd."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from controlplane.daemon import Daemon
from kvferry.structs import struct_to_dict
from kvferry.v1 import leases_pb2
from tests.conftest import Client
from tests.factories import d_params, lease_request, lookup_request, node_request, tokens
from tests.polling import eventually


async def test_finished_turn_is_pulled_once_then_recomputed(client: Client) -> None:
    await client.nodes.Register(node_request("d-1"))
    reg = await client.leases.Register(lease_request("conv-1", num_tokens=1000))
    assert reg.lease.generation == 1 and not reg.replaced

    first = await client.leases.Lookup(lookup_request("conv-1", prompt_tokens=1200))
    assert first.decision == leases_pb2.PULL
    assert first.reason == "pull" and first.claimed
    assert first.reusable_tokens == 1000
    params = struct_to_dict(first.kv_transfer_params)
    expected = d_params("d-1", 1000)
    assert params["remote_block_ids"] == expected["remote_block_ids"]
    assert params["remote_num_tokens"] == 1000
    assert params["do_remote_decode"] is True and params["do_remote_prefill"] is False
    assert params["remote_port"] == 5600 and isinstance(params["remote_port"], int)
    assert params["some_future_key"] == {"kept": True}, "unknown keys are forwarded"

    second = await client.leases.Lookup(lookup_request("conv-1", prompt_tokens=1200))
    assert second.decision == leases_pb2.RECOMPUTE
    assert second.reason == "already_claimed"
    assert not second.HasField("kv_transfer_params") and not second.HasField("release_params")


async def test_peek_does_not_claim(client: Client) -> None:
    await client.nodes.Register(node_request("d-1"))
    await client.leases.Register(lease_request("conv-p"))
    for _ in range(3):
        peek = await client.leases.Lookup(lookup_request("conv-p", peek=True))
        assert peek.decision == leases_pb2.PULL and not peek.claimed and peek.reusable_tokens == 1000
        # nothing was handed out: params a caller forwarded would be read again by the claim's P
        assert not peek.HasField("kv_transfer_params") and not peek.HasField("release_params")
    real = await client.leases.Lookup(lookup_request("conv-p"))
    assert real.decision == leases_pb2.PULL and real.claimed


async def test_no_lease(client: Client) -> None:
    resp = await client.leases.Lookup(lookup_request("never-registered"))
    assert resp.decision == leases_pb2.RECOMPUTE and resp.reason == "no_lease"


async def test_prefix_verification_trims_to_matching_blocks(client: Client) -> None:
    await client.nodes.Register(node_request("d-1"))
    d_seq = tokens(1000)
    await client.leases.Register(lease_request("conv-edit", num_tokens=1000, seq=d_seq))
    # The client dropped part of the previous answer: the prompt diverges at token 500.
    prompt = d_seq[:500] + tokens(700, start=9000)
    resp = await client.leases.Lookup(lookup_request("conv-edit", prompt_tokens=len(prompt), seq=prompt))
    assert resp.decision == leases_pb2.PULL and resp.reason == "partial_pull"
    assert resp.reusable_tokens == 496  # 31 full matching blocks of 16
    params = struct_to_dict(resp.kv_transfer_params)
    assert params["remote_num_tokens"] == 496
    assert params["remote_block_ids"] == [list(range(100, 131))]


async def test_mismatch_from_first_block_recomputes_and_releases(client: Client) -> None:
    await client.nodes.Register(node_request("d-1"))
    await client.leases.Register(lease_request("conv-mm", num_tokens=1000, seq=tokens(1000)))
    prompt = tokens(1200, start=777)
    resp = await client.leases.Lookup(lookup_request("conv-mm", prompt_tokens=1200, seq=prompt))
    assert resp.decision == leases_pb2.RECOMPUTE and resp.reason == "prefix_mismatch"
    release = struct_to_dict(resp.release_params)
    assert release["remote_num_tokens"] == 0 and release["do_remote_decode"] is True
    assert resp.claimed, "release params free D's blocks, so the retention is consumed"
    again = await client.leases.Lookup(lookup_request("conv-mm", prompt_tokens=1200, seq=prompt))
    assert again.reason == "already_claimed"


async def test_below_threshold_recomputes_with_release(client: Client) -> None:
    await client.nodes.Register(node_request("d-1"))
    await client.leases.Register(lease_request("conv-small", num_tokens=40))
    resp = await client.leases.Lookup(lookup_request("conv-small", prompt_tokens=100))
    assert resp.decision == leases_pb2.RECOMPUTE and resp.reason == "below_threshold"
    assert struct_to_dict(resp.release_params)["remote_num_tokens"] == 0


async def test_expiry(client: Client) -> None:
    await client.nodes.Register(node_request("d-1"))
    # Inside the 10 s safety margin: not handed out, but D can still be told to free.
    await client.leases.Register(lease_request("conv-x", expires_in=6))
    resp = await client.leases.Lookup(lookup_request("conv-x"))
    assert resp.decision == leases_pb2.RECOMPUTE and resp.reason == "expired"
    assert resp.HasField("release_params")


async def test_expired_past_deadline(make_daemon, connect) -> None:  # type: ignore[no-untyped-def]
    from controlplane.policy import Policy

    d = await make_daemon(policy=Policy(safety_margin_s=5.0, default_lifetime_s=1.0))
    c = connect(d)
    await c.nodes.Register(node_request("d-1"))
    await c.leases.Register(lease_request("conv-old"))  # default lifetime 1 s
    await asyncio.sleep(1.2)
    resp = await c.leases.Lookup(lookup_request("conv-old"))
    assert resp.reason == "expired" and not resp.HasField("release_params")
    listed = await c.leases.List(leases_pb2.ListLeasesRequest())
    assert not listed.leases, "expired leases are not listed as live"


async def test_the_claim_marker_of_an_expired_retention_says_expired(client: Client) -> None:
    """A lookup that took a retention past its deadline handed nothing out: the lookups
    after it, meeting its claim marker, said already_claimed ("handed out 0.3s ago")."""
    await client.nodes.Register(node_request("d-1"))
    await client.leases.Register(lease_request("conv-late", expires_in=1.0))
    deadline = time.time() + 1.0

    async def past_deadline() -> bool:  # (still in etcd: its GC lease outlives the deadline)
        return time.time() > deadline + 0.1

    await eventually(past_deadline)
    first = await client.leases.Lookup(lookup_request("conv-late"))
    assert first.decision == leases_pb2.RECOMPUTE and first.reason == "expired" and first.claimed
    assert not first.HasField("release_params")
    again = await client.leases.Lookup(lookup_request("conv-late"))
    assert again.decision == leases_pb2.RECOMPUTE and again.reason == "expired"
    assert not again.claimed and not again.HasField("release_params")
    peek = await client.leases.Lookup(lookup_request("conv-late", peek=True))
    assert peek.reason == "expired"


async def test_tenants_never_see_each_other(client: Client) -> None:
    await client.nodes.Register(node_request("d-1"))
    await client.leases.Register(lease_request("shared-id", tenant="acme"))
    other = await client.leases.Lookup(lookup_request("shared-id", tenant="globex"))
    assert other.reason == "no_lease"
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await client.leases.Get(leases_pb2.GetLeaseRequest(tenant="globex", conversation_id="shared-id"))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    listed = await client.leases.List(leases_pb2.ListLeasesRequest(tenant="globex"))
    assert not listed.leases
    mine = await client.leases.Lookup(lookup_request("shared-id", tenant="acme"))
    assert mine.decision == leases_pb2.PULL


async def test_newer_retention_replaces(client: Client) -> None:
    await client.nodes.Register(node_request("d-1"))
    await client.leases.Register(lease_request("conv-r", num_tokens=500))
    second = await client.leases.Register(lease_request("conv-r", num_tokens=900))
    assert second.replaced
    resp = await client.leases.Lookup(lookup_request("conv-r", prompt_tokens=2000))
    assert resp.reusable_tokens == 900


async def test_a_lookup_leaves_its_own_requests_retention_to_the_next_turn(client: Client) -> None:
    """A lookup that reaches the daemon after its own turn went on without it and registered
    (it came late) must not take that retention: it is the next turn's to pull."""
    await client.nodes.Register(node_request("d-1"))
    reg = lease_request("conv-own", num_tokens=900)
    reg.request_id = "kvf-turn-2"
    await client.leases.Register(reg)
    got = await client.leases.Get(leases_pb2.GetLeaseRequest(conversation_id="conv-own"))
    assert got.request_id == "kvf-turn-2"

    late = lookup_request("conv-own", prompt_tokens=900)
    late.request_id = "kvf-turn-2"
    own = await client.leases.Lookup(late)
    assert own.decision == leases_pb2.RECOMPUTE and own.reason == "own_turn" and not own.claimed
    assert not own.HasField("kv_transfer_params") and not own.HasField("release_params")

    after = await client.leases.Get(leases_pb2.GetLeaseRequest(conversation_id="conv-own"))
    assert not after.claimed and after.num_tokens == 900  # back as it was
    nxt = lookup_request("conv-own", prompt_tokens=1400)
    nxt.request_id = "kvf-turn-3"
    pulled = await client.leases.Lookup(nxt)
    assert pulled.decision == leases_pb2.PULL and pulled.claimed and pulled.reusable_tokens == 900


async def test_get_of_a_claimed_retention_shows_what_its_marker_knows(client: Client) -> None:
    """A retention a lookup took is gone from etcd; Get showed its marker with an empty
    engine and request. The marker names the request whose lookup took it and, when the
    claim found the retention expired or about to, its engine and deadline."""
    await client.nodes.Register(node_request("d-1"))
    await client.leases.Register(lease_request("taken"))
    ask = lookup_request("taken")
    ask.request_id = "kvf-turn-2"
    assert (await client.leases.Lookup(ask)).decision == leases_pb2.PULL
    got = await client.leases.Get(leases_pb2.GetLeaseRequest(conversation_id="taken"))
    assert got.claimed and got.claimed_at.seconds > 0 and got.request_id == "kvf-turn-2"
    assert got.engine_id == "" and not got.HasField("expires_at")  # (the claim read neither)

    await client.leases.Register(lease_request("late", expires_in=6))  # inside the safety margin
    ask = lookup_request("late")
    ask.request_id = "kvf-turn-9"
    assert (await client.leases.Lookup(ask)).reason == "expired"
    got = await client.leases.Get(leases_pb2.GetLeaseRequest(conversation_id="late"))
    assert got.claimed and got.engine_id == "d-1" and got.request_id == "kvf-turn-9"
    assert 0 < got.expires_at.ToNanoseconds() / 1e9 - time.time() <= 6


async def test_a_retention_replaced_unclaimed_comes_back_to_be_released(client: Client) -> None:
    """No turn claimed it (its next turn skipped the lookup): D still holds its blocks, and
    nothing else will free them before D's TTL. Its release params come back to the
    registering sidecar; not for the same D request registered again, nor an expired one."""
    await client.nodes.Register(node_request("d-1"))
    await client.leases.Register(
        lease_request("conv-u", num_tokens=500, params=d_params("d-1", 500, "req-a"))
    )
    again = await client.leases.Register(
        lease_request("conv-u", num_tokens=500, params=d_params("d-1", 500, "req-a"))
    )
    assert again.replaced and not again.HasField("release_params")  # the same request's blocks
    newer = await client.leases.Register(
        lease_request("conv-u", num_tokens=900, params=d_params("d-1", 900, "req-b"))
    )
    assert newer.replaced
    release = struct_to_dict(newer.release_params)
    assert release["remote_request_id"] == "req-a" and release["remote_num_tokens"] == 0
    assert release["do_remote_decode"] is True
    pulled = await client.leases.Lookup(lookup_request("conv-u", prompt_tokens=1200))
    assert pulled.decision == leases_pb2.PULL and pulled.reusable_tokens == 900  # the newer one
    # Claimed (handed out): never handed back for release, whatever comes next.
    after_claim = await client.leases.Register(
        lease_request("conv-u", num_tokens=1300, params=d_params("d-1", 1300, "req-e"))
    )
    assert not after_claim.replaced and not after_claim.HasField("release_params")

    await client.leases.Register(
        lease_request("conv-x", num_tokens=500, params=d_params("d-1", 500, "req-c"), expires_in=0.5)
    )
    await asyncio.sleep(0.6)
    after_expiry = await client.leases.Register(
        lease_request("conv-x", num_tokens=500, params=d_params("d-1", 500, "req-d"))
    )
    assert after_expiry.replaced and not after_expiry.HasField("release_params")  # D freed them


async def test_list_pages_and_filters(client: Client) -> None:
    await client.nodes.Register(node_request("d-1"))
    await client.nodes.Register(node_request("d-2", side_channel_port=5601))
    for i in range(25):
        await client.leases.Register(lease_request(f"c/{i:02d}", engine_id="d-1" if i % 2 else "d-2"))
    seen: list[str] = []
    token = ""
    pages = 0
    while True:
        page = await client.leases.List(leases_pb2.ListLeasesRequest(page_size=10, page_token=token))
        pages += 1
        seen += [lease.conversation_id for lease in page.leases]
        token = page.next_page_token
        if not token:
            break
    assert sorted(seen) == [f"c/{i:02d}" for i in range(25)] and pages == 3
    only = await client.leases.List(leases_pb2.ListLeasesRequest(engine_id="d-1", page_size=100))
    assert len(only.leases) == 12 and {x.engine_id for x in only.leases} == {"d-1"}


async def test_a_filtered_listing_reads_a_bounded_part_of_the_store_per_call(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine's few leases among many: each call reads a bounded number of retentions and
    returns a short (even empty) page with a token, never the whole store in one call."""
    from controlplane.service import retentions

    monkeypatch.setattr(retentions, "LIST_EXAMINED", 5)
    await client.nodes.Register(node_request("d-1"))
    await client.nodes.Register(node_request("d-2", side_channel_port=5601))
    for i in range(20):
        await client.leases.Register(lease_request(f"c/{i:02d}", engine_id="d-2" if i == 13 else "d-1"))
    seen, token, calls = [], "", 0
    while True:
        page = await client.leases.List(
            leases_pb2.ListLeasesRequest(engine_id="d-2", page_size=100, page_token=token)
        )
        calls += 1
        seen += [lease.conversation_id for lease in page.leases]
        token = page.next_page_token
        if not token:
            break
    assert seen == ["c/13"] and calls >= 4
    got = await client.leases.Get(leases_pb2.GetLeaseRequest(conversation_id="c/03"))
    assert got.engine_id == "d-1" and got.num_tokens == 1000 and got.expires_at.seconds > 0


async def test_revoke(client: Client) -> None:
    await client.nodes.Register(node_request("d-1"))
    await client.leases.Register(lease_request("conv-rv"))
    resp = await client.leases.Revoke(leases_pb2.RevokeLeaseRequest(conversation_id="conv-rv"))
    assert resp.found and struct_to_dict(resp.release_params)["remote_num_tokens"] == 0
    assert resp.lease.engine_id == "d-1" and resp.lease.num_tokens == 1000 and resp.lease.block_size == 16
    after = await client.leases.Lookup(lookup_request("conv-rv"))
    assert after.reason == "no_lease"
    again = await client.leases.Revoke(leases_pb2.RevokeLeaseRequest(conversation_id="conv-rv"))
    assert not again.found and not again.HasField("lease")


async def test_revoke_hands_no_release_for_blocks_d_no_longer_holds(client: Client) -> None:
    """D restarted since (its blocks went with the process), or the lease expired: a
    release would send a prefill node to notify an engine that holds nothing for it."""
    await client.nodes.Register(node_request("d-1"))
    await client.leases.Register(lease_request("conv-restarted"))
    await client.nodes.Register(node_request("d-1"))  # the engine came back: a new generation
    await client.leases.Register(lease_request("conv-expired", expires_in=0.5))
    resp = await client.leases.Revoke(leases_pb2.RevokeLeaseRequest(conversation_id="conv-restarted"))
    assert resp.found and resp.lease.generation == 1 and not resp.release_params.fields
    await asyncio.sleep(0.6)
    resp = await client.leases.Revoke(leases_pb2.RevokeLeaseRequest(conversation_id="conv-expired"))
    assert resp.found and not resp.release_params.fields


async def test_a_retention_holding_freed_blocks_is_only_pulled_whole(client: Client) -> None:
    """D's params name vLLM's null block in a group (a sliding window's freed positions):
    the registration says so, and a lookup that would pull part of it recomputes."""
    from tests.factories import d_params

    await client.nodes.Register(node_request("d-1"))
    params = d_params("d-1", 1008)
    full = params["remote_block_ids"][0]
    params["remote_block_ids"] = [full, [0] * 40 + full[40:]]  # the window: the last 23 blocks
    for name in ("whole", "part"):
        await client.leases.Register(lease_request(name, num_tokens=1008, params=dict(params)))
    whole = await client.leases.Lookup(lookup_request("whole", prompt_tokens=1300))
    assert whole.decision == leases_pb2.PULL and whole.reusable_tokens == 1008
    part = await client.leases.Lookup(lookup_request("part", prompt_tokens=700))
    assert (part.decision, part.reason) == (leases_pb2.RECOMPUTE, "whole_only")
    assert part.release_params.fields["remote_num_tokens"].number_value == 0


async def test_a_slow_claim_is_decided_on_the_time_it_ended(daemon: Daemon, client: Client) -> None:
    """The claim's etcd round trip took long (etcd loaded): D's deadline is nearer when the
    answer leaves than when the lookup arrived, and the safety margin counts from then."""
    await client.nodes.Register(node_request("d-1"))
    margin = daemon.settings.policy.safety_margin_s
    await client.leases.Register(lease_request("conv-slow", expires_in=margin + 0.3))
    store = daemon.control_plane.owned
    claim = store.claim

    async def slow_claim(*args, **kwargs):  # type: ignore[no-untyped-def]
        await asyncio.sleep(0.5)
        return await claim(*args, **kwargs)

    store.claim = slow_claim  # type: ignore[method-assign]
    store.claim_now = lambda *args, **kwargs: None  # type: ignore[method-assign]  # (the awaited path)
    res = await client.leases.Lookup(lookup_request("conv-slow"))
    assert (res.decision, res.reason) == (leases_pb2.RECOMPUTE, "expired"), res
    assert res.release_params.fields  # still held by D: released


async def test_a_retention_past_its_deadline_is_not_put_back(daemon: Daemon, client: Client) -> None:
    await client.nodes.Register(node_request("d-1"))
    await client.leases.Register(lease_request("conv-late", expires_in=5))
    store = daemon.control_plane.owned
    now = time.time()
    taken = await store.claim("default", "conv-late", now)
    assert taken.taken is not None
    assert not await store.unclaim("default", "conv-late", taken.taken, taken.marker_revision, now + 6)
    stored, marker = await store.read("default", "conv-late")
    assert stored is None and marker is not None


async def test_a_listing_page_fits_a_clients_message_limit(client: Client) -> None:
    """A page was cut by count alone: 500 leases of long conversations (the CLI's page) made
    a reply of tens of MiB, over a client's 4 MiB receive limit, and `leases ls` failed.
    A page now ends before ~1 MiB; the next one starts at the lease that did not fit."""
    await client.nodes.Register(node_request("d-1"))
    n, tokens = 24, 32768
    for i in range(n):
        await client.leases.Register(
            lease_request(f"long/{i:02d}", num_tokens=tokens, seq=list(range(tokens)))
        )
    seen: list[str] = []
    token, pages = "", 0
    while True:
        page = await client.leases.List(leases_pb2.ListLeasesRequest(page_size=500, page_token=token))
        assert page.leases and page.ByteSize() <= 1_200_000, page.ByteSize()
        seen += [lease.conversation_id for lease in page.leases]
        pages += 1
        token = page.next_page_token
        if not token:
            break
    assert seen == [f"long/{i:02d}" for i in range(n)] and pages > 1
