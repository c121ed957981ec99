"""Lookups sent before their prompt is known (prompt_follows): the daemon claims while the
caller tokenizes and digests, and decides when the prompt arrives."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
import pytest
import structlog.testing

from controlplane.daemon import Daemon
from kvferry.leaseclient import LeaseStream
from kvferry.v1 import leases_pb2
from tests.conftest import Client, DaemonFactory, daemon_settings
from tests.factories import lease_request, lookup_request, node_request, tokens
from tests.polling import eventually


def early(conversation_id: str) -> leases_pb2.LookupRequest:
    return leases_pb2.LookupRequest(conversation_id=conversation_id, prompt_follows=True)


def prompt_of(req: leases_pb2.LookupRequest) -> leases_pb2.LookupPrompt:
    """`req`'s prompt as a LookupPrompt (its digests only if it gave some)."""
    prompt = leases_pb2.LookupPrompt(prompt_tokens=req.prompt_tokens)
    if req.HasField("prompt_digests"):
        prompt.prompt_digests = req.prompt_digests
    return prompt


async def peek_until(
    client: Client, conversation: str, done: Callable[[leases_pb2.LookupResponse], bool]
) -> None:
    """Peek at the conversation's retention until `done` holds of the answer (2 s at most)."""
    for _ in range(100):
        peek = await client.leases.Lookup(lookup_request(conversation, peek=True))
        if done(peek):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"never so: {peek}")


async def test_the_claim_is_made_before_the_prompt_arrives(client: Client) -> None:
    await client.nodes.Register(node_request("d-1"))
    await client.leases.Register(lease_request("c", seq=tokens(1000)))
    stream = LeaseStream(client.channel)
    ready = asyncio.Event()
    full = lookup_request("c", seq=tokens(1200))

    async def prompt() -> leases_pb2.LookupPrompt:
        await ready.wait()  # the caller is still tokenizing
        return prompt_of(full)

    answer = asyncio.create_task(
        stream.lookup_with_prompt(leases_pb2.LookupRequest(conversation_id="c"), prompt(), 5)
    )
    try:
        await peek_until(client, "c", lambda peek: peek.reason == "already_claimed")  # taken meanwhile
        ready.set()
        res = await answer
        assert res.decision == leases_pb2.PULL and res.reusable_tokens == 992  # whole blocks
        assert res.kv_transfer_params["remote_num_tokens"] == 992
    finally:
        await stream.close()


async def test_a_prompt_that_could_not_be_made_releases_the_blocks(client: Client) -> None:
    await client.nodes.Register(node_request("d-1"))
    await client.leases.Register(lease_request("c"))
    stream = LeaseStream(client.channel)

    async def no_prompt() -> None:
        return None  # e.g. tokenize failed

    try:
        res = await stream.lookup_with_prompt(leases_pb2.LookupRequest(conversation_id="c"), no_prompt(), 5)
    finally:
        await stream.close()
    assert res.decision == leases_pb2.RECOMPUTE and res.claimed and res.reason == "no_prompt"
    assert res.release_params["remote_num_tokens"] == 0


async def test_bad_uses_get_clear_errors(client: Client) -> None:
    await client.nodes.Register(node_request("d-1"))
    with pytest.raises(grpc.aio.AioRpcError) as unary:
        await client.leases.Lookup(leases_pb2.LookupRequest(conversation_id="c", prompt_follows=True))
    assert unary.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "Leases/Stream" in (unary.value.details() or "")

    call = client.leases.Stream()
    orphan = leases_pb2.LeaseOp(id=7, prompt=leases_pb2.LookupPrompt(prompt_tokens=10))
    await call.write(leases_pb2.LeaseOpBatch(ops=[orphan]))
    await call.done_writing()
    (res,) = [r async for batch in call for r in batch.results]
    assert res.id == 7 and res.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "no lookup on this stream is waiting" in res.error.message

    await client.leases.Register(lease_request("c"))
    stream = LeaseStream(client.channel)

    async def bad_digests() -> leases_pb2.LookupPrompt:
        return leases_pb2.LookupPrompt(prompt_tokens=100, prompt_digests=b"\x01" * 17)

    try:  # claimed already: the answer releases D's blocks and says why
        res = await stream.lookup_with_prompt(leases_pb2.LookupRequest(conversation_id="c"), bad_digests(), 5)
    finally:
        await stream.close()
    assert res.decision == leases_pb2.RECOMPUTE and res.reason == "no_prompt" and res.claimed
    assert "prompt_digests" in res.detail and res.release_params["remote_num_tokens"] == 0


async def test_waiting_lookups_never_block_the_stream(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    from controlplane.server import stream

    monkeypatch.setattr(stream, "STREAM_WINDOW", 4)
    await client.nodes.Register(node_request("d-1"))
    call = client.leases.Stream()
    early = [
        leases_pb2.LeaseOp(
            id=i, lookup=leases_pb2.LookupRequest(conversation_id=f"w{i}", prompt_follows=True)
        )
        for i in range(6)
    ]
    again = leases_pb2.LeaseOp(
        id=0, lookup=leases_pb2.LookupRequest(conversation_id="w0", prompt_follows=True)
    )
    plain = [leases_pb2.LeaseOp(id=100 + i, lookup=lookup_request(f"p{i}")) for i in range(6)]
    await call.write(leases_pb2.LeaseOpBatch(ops=[*early, again, *plain]))
    prompts = [leases_pb2.LeaseOp(id=i, prompt=leases_pb2.LookupPrompt(prompt_tokens=500)) for i in range(4)]
    await call.write(leases_pb2.LeaseOpBatch(ops=prompts))
    await call.done_writing()
    results = [r async for batch in call for r in batch.results]
    by_id: dict[int, list[leases_pb2.LeaseOpResult]] = {}
    for r in results:
        by_id.setdefault(r.id, []).append(r)
    full = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert [r.error.code for r in by_id[4] + by_id[5]] == [full, full]  # beyond the window: refused
    assert any(r.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] for r in by_id[0])  # id in use
    assert all(by_id[i][-1].lookup.reason == "no_lease" for i in range(1, 4))  # their prompts came
    assert all(by_id[100 + i][0].lookup.reason == "no_lease" for i in range(6))  # never held up


async def test_a_cancelled_caller_still_ends_the_daemons_wait(client: Client) -> None:
    await client.nodes.Register(node_request("d-1"))
    await client.leases.Register(lease_request("c"))
    stream = LeaseStream(client.channel)
    never = asyncio.Event()

    async def forever() -> leases_pb2.LookupPrompt:
        await never.wait()
        raise AssertionError("unreachable")

    try:
        task = asyncio.create_task(
            stream.lookup_with_prompt(leases_pb2.LookupRequest(conversation_id="c"), forever(), 5)
        )
        await peek_until(client, "c", lambda peek: peek.reason == "already_claimed")  # it left
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # The daemon got an empty prompt at once (not after 10 s): its op ended, and the
        # next lookup on the same stream is answered as usual.
        t0 = asyncio.get_running_loop().time()
        res = await stream.lookup(lookup_request("c"), 5)
        assert res.reason == "already_claimed" and asyncio.get_running_loop().time() - t0 < 2
    finally:
        await stream.close()


async def test_a_cancelled_callers_claim_is_handed_to_its_late_hook(client: Client) -> None:
    """The caller went away (a client that disconnected), but the daemon claimed D's blocks
    all the same: its answer, release params included, goes to the late hook, so that the
    router can have D free them instead of holding them for D's TTL."""
    await client.nodes.Register(node_request("d-1"))
    await client.leases.Register(lease_request("c"))
    stream = LeaseStream(client.channel)
    never = asyncio.Event()
    late: list[leases_pb2.LookupResponse] = []

    async def forever() -> leases_pb2.LookupPrompt:
        await never.wait()
        raise AssertionError("unreachable")

    try:
        task = asyncio.create_task(
            stream.lookup_with_prompt(
                leases_pb2.LookupRequest(conversation_id="c"), forever(), 5, late.append
            )
        )
        await peek_until(client, "c", lambda peek: peek.reason == "already_claimed")  # it left
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):
            if late:
                break
            await asyncio.sleep(0.02)
        [answer] = late
        assert answer.decision == leases_pb2.RECOMPUTE and answer.reason == "no_prompt" and answer.claimed
        assert answer.release_params.fields["remote_num_tokens"].number_value == 0
        assert not stream._pending and not stream._written
    finally:
        await stream.close()


async def test_prompt_in_the_same_message_as_its_lookup(client: Client) -> None:
    await client.nodes.Register(node_request("d-1"))
    await client.leases.Register(lease_request("c"))
    req = lookup_request("c")
    call = client.leases.Stream()
    both = [
        leases_pb2.LeaseOp(id=1, lookup=leases_pb2.LookupRequest(conversation_id="c", prompt_follows=True)),
        leases_pb2.LeaseOp(id=1, prompt=prompt_of(req)),
    ]
    await call.write(leases_pb2.LeaseOpBatch(ops=both))
    await call.done_writing()
    (res,) = [r async for batch in call for r in batch.results]
    assert res.id == 1 and res.lookup.decision == leases_pb2.PULL


async def test_a_claim_whose_caller_went_away_is_put_back_for_the_next_turn(client: Client) -> None:
    """The caller's stream ends (the router stopped, its connection broke) while the daemon
    holds a claim and waits for the prompt: no answer can reach anyone, so what the claim
    took goes back. It was spent: the next turn found already_claimed, D's blocks pinned."""
    await client.nodes.Register(node_request("d-1"))
    await client.leases.Register(lease_request("c"))
    call = client.leases.Stream()
    await call.write(leases_pb2.LeaseOpBatch(ops=[leases_pb2.LeaseOp(id=1, lookup=early("c"))]))
    await peek_until(client, "c", lambda peek: peek.reason == "already_claimed")  # taken meanwhile
    call.cancel()
    await peek_until(client, "c", lambda peek: (peek.decision, peek.reason) == (leases_pb2.PULL, "pull"))
    assert (await client.leases.Lookup(lookup_request("c"))).decision == leases_pb2.PULL


async def test_a_revoke_is_not_undone_by_a_claim_put_back(daemon: Daemon, client: Client) -> None:
    """An operator revokes the conversation while a claim that took its retention waits for
    its prompt; then the claim's caller goes away. The put-back must not bring back what
    the operator revoked."""
    await client.nodes.Register(node_request("d-1"))
    await client.leases.Register(lease_request("c"))
    call = client.leases.Stream()
    await call.write(leases_pb2.LeaseOpBatch(ops=[leases_pb2.LeaseOp(id=1, lookup=early("c"))]))
    await peek_until(client, "c", lambda peek: peek.reason == "already_claimed")  # taken meanwhile
    revoked = await client.leases.Revoke(leases_pb2.RevokeLeaseRequest(conversation_id="c"))
    assert not revoked.found  # (the claim holds it)
    with structlog.testing.capture_logs() as logs:
        call.cancel()

        async def tried() -> bool:  # the daemon saw the stream end and tried the put-back
            return any(e["event"].startswith("lookup.put_back") for e in logs)

        await eventually(tried)
    [put] = [e for e in logs if e["event"].startswith("lookup.put_back")]
    assert put["event"] == "lookup.put_back" and put["back"] is False, put
    assert (await client.leases.Lookup(lookup_request("c"))).reason == "no_lease"


async def test_settling_waits_for_a_claim_still_at_etcd_when_its_caller_left(
    daemon: Daemon, client: Client
) -> None:
    """A stop settles the claims of callers that went away before the store closes. One
    still at etcd when its caller left made its put-back only once done, after the
    settling had returned: the store then closed under it, and the retention was spent."""
    await client.nodes.Register(node_request("d-1"))
    await client.leases.Register(lease_request("c"))
    store = daemon.control_plane.owned
    claim = store.claim
    reached, claimed = asyncio.Event(), asyncio.Event()

    async def slow_claim(*args, **kwargs):  # type: ignore[no-untyped-def]
        reached.set()
        await asyncio.sleep(0.5)
        try:
            return await claim(*args, **kwargs)
        finally:
            claimed.set()

    store.claim = slow_claim  # type: ignore[method-assign]
    call = client.leases.Stream()
    await call.write(leases_pb2.LeaseOpBatch(ops=[leases_pb2.LeaseOp(id=1, lookup=early("c"))]))
    await reached.wait()
    call.cancel()
    await asyncio.sleep(0.1)  # the daemon sees the stream end while the claim is at etcd
    await daemon.control_plane.settle()
    assert claimed.is_set()  # settled: the claim is done, and what it took is back
    store.claim = claim  # type: ignore[method-assign]
    peek = await client.leases.Lookup(lookup_request("c", peek=True))
    assert (peek.decision, peek.reason) == (leases_pb2.PULL, "pull")


async def test_a_claim_whose_caller_gives_up_while_deciding_is_put_back(
    daemon: Daemon, client: Client
) -> None:
    """A unary Lookup whose deadline passes after its claim, while the daemon decides (a
    node read, say): the answer is lost, so the claim goes back rather than leave the next
    turn already_claimed."""
    await client.nodes.Register(node_request("d-1"))
    await client.leases.Register(lease_request("c"))
    cp = daemon.control_plane.lookups
    decide = cp._decide
    deciding = asyncio.Event()

    async def slow_decide(*args, **kwargs):  # type: ignore[no-untyped-def]
        deciding.set()  # the claim is applied; the caller gives up meanwhile
        await asyncio.sleep(30)
        return await decide(*args, **kwargs)

    cp._decide = slow_decide  # type: ignore[method-assign]
    # (the caller leaves once the daemon decides, not at a deadline shorter than a claim
    # can take on a loaded machine: one cancelled while its claim was at etcd may be spent)
    call = client.leases.Lookup(lookup_request("c"), timeout=60)
    await asyncio.wait_for(deciding.wait(), 20)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    cp._decide = decide  # type: ignore[method-assign]
    await peek_until(client, "c", lambda peek: (peek.decision, peek.reason) == (leases_pb2.PULL, "pull"))


async def test_a_daemon_stopping_puts_back_the_claims_of_lookups_still_waiting(
    make_daemon: DaemonFactory, etcd_endpoint: str
) -> None:
    """A stop ends every stream; a lookup still waiting for its prompt is cancelled, and the
    claim it made goes back before the store closes (else the next turn, on another
    replica, found already_claimed and D's blocks stayed pinned)."""
    first = await make_daemon()
    client = Client(first.address)
    try:
        await client.nodes.Register(node_request("d-1"))
        await client.leases.Register(lease_request("c"))
        call = client.leases.Stream()
        await call.write(leases_pb2.LeaseOpBatch(ops=[leases_pb2.LeaseOp(id=1, lookup=early("c"))]))
        await peek_until(client, "c", lambda peek: peek.reason == "already_claimed")
        await first.stop()
        call.cancel()
    finally:
        await client.close()
    second = await make_daemon(daemon_settings(etcd_endpoint, prefix=first.settings.etcd.prefix))
    other = Client(second.address)
    try:
        peek = await other.leases.Lookup(lookup_request("c", peek=True))
        assert (peek.decision, peek.reason) == (leases_pb2.PULL, "pull"), peek
    finally:
        await other.close()
