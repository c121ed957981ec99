"""kvferry.leaseclient.LeaseStream, the client of Leases/Stream: batching under load and
by encoded size, deadlines, a lost stream, and ops given up on (did they leave? do late
answers reach the hook?), against a real daemon or a scripted call."""

from __future__ import annotations

import asyncio
from typing import Any, NamedTuple

import grpc
import pytest

from kvferry.v1 import leases_pb2
from realvllm.process import free_port
from tests.conftest import Client
from tests.factories import lease_request, lookup_request, node_request, tokens


async def test_lease_stream_client_batches_under_load_and_survives_timeouts(client: Client) -> None:
    from kvferry.leaseclient import LeaseOpError, LeaseStream

    await client.nodes.Register(node_request("d-1"))
    stream = LeaseStream(client.channel)
    try:
        regs = await asyncio.gather(*(stream.register(lease_request(f"b-{i}"), 10) for i in range(200)))
        assert all(r.lease.engine_id == "d-1" for r in regs)
        looks = await asyncio.gather(*(stream.lookup(lookup_request(f"b-{i}"), 10) for i in range(200)))
        assert all(r.decision == leases_pb2.PULL for r in looks)
        bad = lease_request("b-bad")
        bad.conversation_id = ""
        with pytest.raises(LeaseOpError) as refused:
            await stream.register(bad, 10)
        e = refused.value
        assert e.code == grpc.StatusCode.INVALID_ARGUMENT and "conversation_id" in e.message
        assert not e.stream_lost  # the daemon's answer to that op: no reason to change replica
        # A deadline too short to be met fails that call only; the stream goes on.
        with pytest.raises(LeaseOpError) as late:
            await stream.lookup(lookup_request("b-0"), 0.000001)
        assert late.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and not late.value.stream_lost
        again = await stream.lookup(lookup_request("b-1", peek=True), 10)
        assert again.reason == "already_claimed"
    finally:
        await stream.close()


def test_batches_are_cut_by_encoded_size_in_order() -> None:
    from kvferry.framing import by_size

    ops = [
        leases_pb2.LookupRequest(conversation_id=c * size)
        for c, size in zip("abcdef", (40, 40, 40, 200, 10, 10), strict=True)
    ]
    sizes = [op.ByteSize() for op in ops]
    runs = list(by_size(ops, budget=100))
    assert [op for run in runs for op in run] == ops
    assert [len(run) for run in runs] == [2, 1, 1, 2]  # the 200-byte one alone, over the budget
    assert all(sum(op.ByteSize() for op in run) <= 100 for run in runs if len(run) > 1)
    assert sizes[3] > 100
    assert list(by_size(ops[3:4], budget=1)) == [ops[3:4]]


def test_encoded_runs_are_the_batches_protobuf_would_encode_cut_as_by_size_cuts() -> None:
    from kvferry.framing import by_size, encoded_runs

    results = [
        leases_pb2.LeaseOpResult(id=i, lookup=leases_pb2.LookupResponse(detail="x" * size))
        for i, size in enumerate((0, 40, 100, 300, 20_000, 5, 70_000))
    ]
    field = leases_pb2.LeaseOpResultBatch.RESULTS_FIELD_NUMBER
    for budget in (1, 150, 30_000, 1 << 20):
        runs = list(encoded_runs([r.SerializeToString() for r in results], field, budget))
        expected = [leases_pb2.LeaseOpResultBatch(results=run) for run in by_size(results, budget)]
        assert runs == [b.SerializeToString() for b in expected]  # (byte for byte)
        assert [list(leases_pb2.LeaseOpResultBatch.FromString(m).results) for m in runs] == [
            list(b.results) for b in expected
        ]
    assert list(encoded_runs([], field)) == []


async def test_long_conversations_ops_and_answers_stay_under_the_message_limit(client: Client) -> None:
    """100 registrations of 64k-token conversations at once (~11 MB) and their 100 PULL
    answers (~4.5 MB): in one message each, over the daemon's 4 MiB limit and this client's,
    gRPC would end the stream and fail every op on it."""
    from kvferry.leaseclient import LeaseStream

    await client.nodes.Register(node_request("d-1"))
    n = 65536
    seq = tokens(n)
    reqs = [lease_request(f"long-{i}", num_tokens=n, seq=seq) for i in range(100)]
    assert sum(r.ByteSize() for r in reqs) > 8 * 1024 * 1024
    prompt = lookup_request("", prompt_tokens=n + 100, seq=seq + tokens(100, start=7))
    stream = LeaseStream(client.channel)
    try:
        regs = await asyncio.gather(*(stream.register(r, 60) for r in reqs))
        assert all(r.lease.num_tokens == n for r in regs)
        looks = []
        for i in range(100):
            ask = leases_pb2.LookupRequest()
            ask.CopyFrom(prompt)
            ask.conversation_id = f"long-{i}"
            looks.append(stream.lookup(ask, 60))
        answers = await asyncio.gather(*looks)
        assert all(a.decision == leases_pb2.PULL and a.reusable_tokens == n for a in answers)
        assert sum(a.ByteSize() for a in answers) > 4 * 1024 * 1024
    finally:
        await stream.close()


async def test_a_lost_lease_stream_says_so() -> None:
    """No daemon at the address: the op fails as UNAVAILABLE with stream_lost, the one case
    in which the sidecar moves to another replica."""
    from kvferry.leaseclient import LeaseOpError, LeaseStream

    channel = grpc.aio.insecure_channel(f"127.0.0.1:{free_port()}")
    stream = LeaseStream(channel)
    try:
        await stream.register(lease_request("x"), 10)
        raise AssertionError("expected an error")
    except LeaseOpError as e:
        assert e.code == grpc.StatusCode.UNAVAILABLE and e.stream_lost
        assert not e.sent  # it never left: sending it again is safe
    finally:
        await stream.close()
        await channel.close(None)


def _stream_on(call: Any, late_answer_s: float = 10.0) -> tuple[Any, grpc.aio.Channel]:
    """A LeaseStream whose Leases/Stream call is `call` (the test's), and its channel
    (never used; close it)."""
    from kvferry.leaseclient import LeaseStream

    channel = grpc.aio.insecure_channel("127.0.0.1:9")
    stream = LeaseStream(channel, late_answer_s, opener=lambda: call)
    return stream, channel


class _StuckCall:
    """A Leases/Stream call whose first write never completes (a daemon that stopped
    reading: gRPC flow control holds the client back)."""

    def __init__(self) -> None:
        self.written: list[int] = []
        self._never: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def write(self, batch: leases_pb2.LeaseOpBatch) -> None:
        self.written += [op.id for op in batch.ops]
        await self._never

    async def read(self) -> Any:
        await self._never

    async def done_writing(self) -> None:
        pass

    def cancel(self) -> None:
        pass


class _ScriptedCall:
    """A Leases/Stream call whose answers the test hands over (`answer`, `end`)."""

    def __init__(self) -> None:
        self.written: list[int] = []
        self.ops: list[leases_pb2.LeaseOp] = []
        self._results: asyncio.Queue[Any] = asyncio.Queue()

    async def write(self, batch: leases_pb2.LeaseOpBatch) -> None:
        self.written += [op.id for op in batch.ops]
        self.ops += batch.ops

    async def read(self) -> Any:
        return await self._results.get()

    def answer(self, result: leases_pb2.LeaseOpResult) -> None:
        self._results.put_nowait(leases_pb2.LeaseOpResultBatch(results=[result]))

    def end(self) -> None:
        self._results.put_nowait(grpc.aio.EOF)  # type: ignore[attr-defined]

    async def done_writing(self) -> None:
        pass

    def cancel(self) -> None:
        pass


async def test_late_answers_reach_the_hook_only_when_they_are_answers() -> None:
    """A lookup given up on (deadline, cancelled caller) still hands a later answer to its
    hook; not an error answer, not after the stream's late_answer_s, not when the stream
    ends first. Nothing is left behind either way."""
    from kvferry.leaseclient import LeaseOpError

    first = _ScriptedCall()
    stream, channel = _stream_on(first, late_answer_s=0.2)
    hooked: list[leases_pb2.LookupResponse] = []

    async def given_up(conversation: str) -> None:
        async def prompt() -> leases_pb2.LookupPrompt:
            return leases_pb2.LookupPrompt(prompt_tokens=100)

        with pytest.raises(LeaseOpError):
            await stream.lookup_with_prompt(
                leases_pb2.LookupRequest(conversation_id=conversation), prompt(), 0.01, hooked.append
            )

    await given_up("error")  # op 1
    first.answer(leases_pb2.LeaseOpResult(id=1, error=leases_pb2.OpError(code=14, message="etcd down")))
    await given_up("expired")  # op 2
    await asyncio.sleep(0.3)  # past late_answer_s: no longer waited for
    first.answer(leases_pb2.LeaseOpResult(id=2, lookup=leases_pb2.LookupResponse(reason="too late")))
    await given_up("answered")  # op 3
    first.answer(
        leases_pb2.LeaseOpResult(id=3, lookup=leases_pb2.LookupResponse(reason="pull", claimed=True))
    )
    await given_up("stream ends")  # op 4
    await asyncio.sleep(0.05)
    first.end()
    await asyncio.sleep(0.05)
    assert [h.reason for h in hooked] == ["pull"]
    assert not stream._pending and not stream._written and not stream._outbox
    assert first.written == [1, 1, 2, 2, 3, 3, 4, 4]  # each lookup, then its prompt
    await stream.close()
    await channel.close(None)


async def test_an_answer_is_not_used_past_its_validity_however_long_the_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A lookup's answer is used at most ANSWER_VALID_S after its op left (an owner paused
    after deciding may answer after its shards were taken over and the claim's blocks
    freed: controlplane.owners). A prompt ready only after that: the lookup is given up at
    once, not after the caller's 30 s, and the answer, when it comes, goes to the late hook
    (which releases). Within the bound the caller's own wait holds (the second lookup)."""
    import kvferry.leaseclient
    from kvferry.leaseclient import LeaseOpError
    from tests.polling import eventually

    monkeypatch.setattr(kvferry.leaseclient, "ANSWER_VALID_S", 0.2)
    call = _ScriptedCall()
    stream, channel = _stream_on(call)
    hooked: list[leases_pb2.LookupResponse] = []
    ready = asyncio.Event()

    async def prompt() -> leases_pb2.LookupPrompt:
        await ready.wait()
        return leases_pb2.LookupPrompt(prompt_tokens=100)

    req = leases_pb2.LookupRequest(conversation_id="c")
    looking = asyncio.ensure_future(stream.lookup_with_prompt(req, prompt(), 30.0, hooked.append))
    await eventually(lambda: bool(call.written))  # (the lookup has left)
    await asyncio.sleep(0.3)  # past the validity (time itself is the condition), no prompt yet
    ready.set()
    with pytest.raises(LeaseOpError) as late:
        await asyncio.wait_for(looking, 10)  # (not the 30 s the caller would wait)
    assert late.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and late.value.sent
    assert "an answer is valid 0.2s from when its op left" in late.value.message
    call.answer(leases_pb2.LeaseOpResult(id=1, lookup=leases_pb2.LookupResponse(reason="pull", claimed=True)))
    await eventually(lambda: bool(hooked))
    assert [h.reason for h in hooked] == ["pull"]

    monkeypatch.setattr(kvferry.leaseclient, "ANSWER_VALID_S", 60.0)  # (room on a busy machine)
    looking = asyncio.ensure_future(stream.lookup_with_prompt(req, prompt(), 30.0, hooked.append))
    await eventually(lambda: call.written.count(2) == 2)  # (the lookup, its prompt: one id)
    call.answer(leases_pb2.LeaseOpResult(id=2, lookup=leases_pb2.LookupResponse(reason="pull", claimed=True)))
    assert (await asyncio.wait_for(looking, 10)).reason == "pull"
    await stream.close()
    await channel.close(None)


class _VerifyingLookup(NamedTuple):
    """A lookup_verifying call out on a scripted stream, its prompt not yet made."""

    call: _ScriptedCall
    stream: Any
    channel: grpc.aio.Channel
    hooked: list[leases_pb2.LookupResponse]
    ready: asyncio.Future[None]
    looking: asyncio.Future[leases_pb2.LookupResponse]


async def _verifying_lookup_out() -> _VerifyingLookup:
    """Op 1, a lookup_verifying of conversation "c" (30 s deadline, late answers to
    `hooked`), written to the stream; the caller sets `ready` when its prompt is made."""
    from tests.polling import eventually

    call = _ScriptedCall()
    stream, channel = _stream_on(call)
    hooked: list[leases_pb2.LookupResponse] = []
    ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    req = leases_pb2.LookupRequest(conversation_id="c")
    looking = asyncio.ensure_future(stream.lookup_verifying(req, ready, 30.0, hooked.append))
    await eventually(lambda: bool(call.written))
    return _VerifyingLookup(call, stream, channel, hooked, ready, looking)


async def test_a_lookup_the_caller_verifies_sends_no_prompt_and_keeps_the_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """lookup_verifying: the lookup leaves with caller_verifies, the caller's prompt is
    waited for but never sent, and the answer is used within ANSWER_VALID_S of the op's
    leaving, else handed to the late hook."""
    import kvferry.leaseclient
    from kvferry.leaseclient import LeaseOpError
    from tests.polling import eventually

    monkeypatch.setattr(kvferry.leaseclient, "ANSWER_VALID_S", 0.2)
    call, stream, channel, hooked, ready, looking = await _verifying_lookup_out()
    await asyncio.sleep(0.3)  # past the validity (time itself is the condition)
    ready.set_result(None)
    with pytest.raises(LeaseOpError) as late:
        await asyncio.wait_for(looking, 10)
    assert late.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    call.answer(leases_pb2.LeaseOpResult(id=1, lookup=leases_pb2.LookupResponse(reason="pull", claimed=True)))
    await eventually(lambda: bool(hooked))

    monkeypatch.setattr(kvferry.leaseclient, "ANSWER_VALID_S", 60.0)
    req = leases_pb2.LookupRequest(conversation_id="c")
    failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    failed.set_exception(RuntimeError("the tokenizer failed"))  # (its owner's to see)
    looking = asyncio.ensure_future(stream.lookup_verifying(req, failed, 30.0))
    await eventually(lambda: call.written == [1, 2])  # (the lookups alone: no prompt ops)
    assert all(op.lookup.caller_verifies for op in call.ops)
    call.answer(leases_pb2.LeaseOpResult(id=2, lookup=leases_pb2.LookupResponse(reason="pull", claimed=True)))
    assert (await asyncio.wait_for(looking, 10)).reason == "pull"
    await stream.close()
    await channel.close(None)


async def test_an_answer_already_in_is_not_used_past_its_validity(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With caller_verifies the daemon answers at once, usually before the prompt is
    tokenized: an answer that came while the prompt took longer than ANSWER_VALID_S is
    not used either (a timeout never fires on a future already done); it goes to the late
    hook, which releases."""
    import kvferry.leaseclient
    from kvferry.leaseclient import LeaseOpError
    from tests.polling import eventually

    monkeypatch.setattr(kvferry.leaseclient, "ANSWER_VALID_S", 0.2)
    call, stream, channel, hooked, ready, looking = await _verifying_lookup_out()
    call.answer(leases_pb2.LeaseOpResult(id=1, lookup=leases_pb2.LookupResponse(reason="pull", claimed=True)))
    await eventually(lambda: stream._pending[1].done())  # (the answer is in)
    await asyncio.sleep(0.3)  # past the validity (time itself is the condition)
    ready.set_result(None)
    with pytest.raises(LeaseOpError) as late:
        await asyncio.wait_for(looking, 10)
    assert late.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and late.value.sent
    assert "an answer is valid 0.2s from when its op left" in late.value.message
    await eventually(lambda: bool(hooked))
    assert [h.reason for h in hooked] == ["pull"]
    assert not stream._pending and not stream._written
    await stream.close()
    await channel.close(None)


async def test_an_op_given_up_on_says_whether_it_left() -> None:
    """`sent` is what the sidecar goes by to send a registration again or not: an op in a
    write that never finished may still reach the daemon; one still waiting to leave when
    its caller gives up is taken back, and never leaves."""
    from kvferry.leaseclient import LeaseOpError

    call = _StuckCall()
    stream, channel = _stream_on(call)
    first = asyncio.ensure_future(stream.register(lease_request("a"), 0.3))
    await asyncio.sleep(0.05)  # the writer is stuck in the write of the first op
    with pytest.raises(LeaseOpError) as second:
        await stream.register(lease_request("b"), 0.1)
    assert second.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and not second.value.sent
    with pytest.raises(LeaseOpError) as stuck:
        await first
    assert stuck.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and stuck.value.sent
    assert call.written == [1]  # the second op never left, nor will it
    assert not stream._outbox and not stream._pending and not stream._written
    await stream.close()
    await channel.close(None)


async def test_a_lookup_given_up_on_before_it_left_never_leaves() -> None:
    """Not even with a late hook: sent later (the stream was still connecting), it would
    claim what the conversation holds by then, which may be the retention of the very
    turn that went on without it; releasing that costs the next turn its reuse, and the
    blocks it should have freed stay held for D's TTL."""
    from kvferry.leaseclient import LeaseOpError

    call = _StuckCall()
    stream, channel = _stream_on(call)
    stuck = asyncio.ensure_future(stream.register(lease_request("a"), 0.5))
    await asyncio.sleep(0.05)  # the writer is stuck in the write of the first op
    hooked: list[leases_pb2.LookupResponse] = []

    async def prompt() -> leases_pb2.LookupPrompt:
        return leases_pb2.LookupPrompt(prompt_tokens=100)

    with pytest.raises(LeaseOpError) as late:
        await stream.lookup_with_prompt(
            leases_pb2.LookupRequest(conversation_id="c"), prompt(), 0.05, hooked.append
        )
    assert late.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and not late.value.sent
    assert not stream._outbox and list(stream._pending) == [1]  # only the stuck register
    with pytest.raises(LeaseOpError):
        await stuck
    assert call.written == [1] and not hooked
    await stream.close()
    await channel.close(None)
