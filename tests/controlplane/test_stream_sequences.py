"""Leases/Stream ops in odd orders and shapes: a prompt_follows lookup whose prompt never
comes, comes twice or comes for an unknown id, bad ops mixed in, the stream closed
mid-op. Whatever the order, every op is answered and no coroutine is left unawaited."""

from __future__ import annotations

import gc
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.daemon import Daemon
from controlplane.server import stream as stream_module
from controlplane.service import lookups as lookups_module
from kvferry.v1 import leases_pb2
from tests.conftest import Client
from tests.factories import lease_request, lookup_request, node_request
from tests.polling import eventually

Op = tuple[str, int, int]  # (kind, op id, conversation or prompt size)

_KINDS = ("early", "prompt", "peek_early", "nameless_early", "plain", "empty", "register")
_ops = st.lists(
    st.tuples(st.sampled_from(_KINDS), st.integers(0, 3), st.integers(0, 2)), min_size=1, max_size=8
)


def lease_op(kind: str, op_id: int, n: int, prefix: str) -> leases_pb2.LeaseOp:
    conversation = f"{prefix}-{n}"
    if kind == "early":
        return leases_pb2.LeaseOp(
            id=op_id, lookup=leases_pb2.LookupRequest(conversation_id=conversation, prompt_follows=True)
        )
    if kind == "prompt":  # n == 0: an empty prompt (the caller could not make it)
        return leases_pb2.LeaseOp(id=op_id, prompt=leases_pb2.LookupPrompt(prompt_tokens=500 * n))
    if kind == "peek_early":
        return leases_pb2.LeaseOp(
            id=op_id,
            lookup=leases_pb2.LookupRequest(conversation_id=conversation, prompt_follows=True, peek=True),
        )
    if kind == "nameless_early":
        return leases_pb2.LeaseOp(id=op_id, lookup=leases_pb2.LookupRequest(prompt_follows=True))
    if kind == "plain":
        return leases_pb2.LeaseOp(id=op_id, lookup=lookup_request(conversation))
    if kind == "register":
        return leases_pb2.LeaseOp(id=op_id, register=lease_request(conversation))
    return leases_pb2.LeaseOp(id=op_id)  # no op at all


@pytest.fixture
def serving(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many Leases/Stream calls the daemon is serving ([count]): a prompt that never
    comes is waited for 0.2 s, not 10."""
    monkeypatch.setattr(lookups_module, "PROMPT_WAIT_S", 0.2)
    count = [0]
    serve = stream_module.OpStream.serve

    async def counted(self: Any, requests: Any, context: Any) -> AsyncIterator[Any]:
        count[0] += 1
        try:
            async for batch in serve(self, requests, context):
                yield batch
        finally:
            count[0] -= 1

    monkeypatch.setattr(stream_module.OpStream, "serve", counted)
    return count


async def run_sequence(client: Client, ops: list[Op], one_batch: bool, cancel: bool) -> None:
    prefix = uuid.uuid4().hex[:8]
    call = client.leases.Stream()
    msgs = [lease_op(kind, op_id, n, prefix) for kind, op_id, n in ops]
    for batch in [msgs] if one_batch else [[m] for m in msgs]:
        await call.write(leases_pb2.LeaseOpBatch(ops=batch))
    if cancel:  # closed mid-op
        call.cancel()
        return
    await call.done_writing()
    results = [r async for batch in call for r in batch.results]
    assert await call.code() == grpc.StatusCode.OK
    prompts = sum(1 for kind, _, _ in ops if kind == "prompt")
    # Every op but a prompt has one answer; a prompt has one only when refused.
    assert len(ops) - prompts <= len(results) <= len(ops)


@pytest.mark.filterwarnings("error::RuntimeWarning")
@settings(max_examples=30, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_ops, one_batch=st.booleans(), cancel=st.booleans())
async def test_odd_op_sequences_leave_no_coroutine_unawaited(
    daemon: Daemon, client: Client, serving: list[int], ops: list[Op], one_batch: bool, cancel: bool
) -> None:
    await client.nodes.Register(node_request("d-1"))
    await run_sequence(client, ops, one_batch, cancel)

    async def served() -> bool:
        return serving[0] == 0

    await eventually(served)  # the daemon is done with the call (a cancelled one too)
    gc.collect()  # an unawaited coroutine in a reference cycle warns only when collected


@pytest.mark.filterwarnings("error::RuntimeWarning")
async def test_a_bad_prompt_follows_lookup_creates_no_coroutine(client: Client) -> None:
    await client.nodes.Register(node_request("d-1"))
    call = client.leases.Stream()
    bad = leases_pb2.LookupRequest(conversation_id="c", prompt_follows=True, peek=True)
    await call.write(leases_pb2.LeaseOpBatch(ops=[leases_pb2.LeaseOp(id=1, lookup=bad)]))
    prompt = leases_pb2.LeaseOp(id=1, prompt=leases_pb2.LookupPrompt())
    await call.write(leases_pb2.LeaseOpBatch(ops=[prompt]))
    await call.done_writing()
    results = [r async for batch in call for r in batch.results]
    assert results and all(r.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] for r in results)
    gc.collect()
