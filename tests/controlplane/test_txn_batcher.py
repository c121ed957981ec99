"""Group commit (controlplane.etcd.TxnBatcher) against a fake etcd whose answers the
test releases: what leaves when, and in which batch."""

from __future__ import annotations

import asyncio

import pytest
from aetcd import rpc

from controlplane.errors import StoreUnavailable
from controlplane.etcd import LeaseGone, TxnBatcher


class FakeEtcd:
    """`kvstub.Txn` that records each request and answers when the test says so."""

    def __init__(self) -> None:
        self.kvstub = self
        self.sent: list[rpc.TxnRequest] = []
        self.answers: list[asyncio.Future[rpc.TxnResponse]] = []

    def Txn(self, req: rpc.TxnRequest, timeout: float) -> asyncio.Future[rpc.TxnResponse]:
        self.sent.append(req)
        fut: asyncio.Future[rpc.TxnResponse] = asyncio.get_running_loop().create_future()
        self.answers.append(fut)
        return fut

    def answer(self, i: int) -> None:
        req = self.sent[i]
        if req.compare or not req.success or not req.success[0].HasField("request_txn"):
            self.answers[i].set_result(rpc.TxnResponse(succeeded=True))  # one txn on its own
            return
        resp = rpc.TxnResponse(succeeded=True)
        resp.header.revision = 100 + i  # as etcd: on the outer response only
        for _ in req.success:
            resp.responses.add().response_txn.succeeded = True
        self.answers[i].set_result(resp)


def txn(key: bytes, lease: int = 0) -> rpc.TxnRequest:
    put = rpc.PutRequest(key=key, value=b"v", lease=lease)
    return rpc.TxnRequest(success=[rpc.RequestOp(request_put=put)])


def batch_size(req: rpc.TxnRequest) -> int:
    nested = [op for op in req.success if op.HasField("request_txn")]
    return len(nested) or 1


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_lone_request_leaves_at_once_and_later_ones_wait_as_one_batch() -> None:
    etcd = FakeEtcd()
    b = TxnBatcher(etcd, 1.0, max_items=8)  # type: ignore[arg-type]
    first = asyncio.create_task(b.submit("t", txn(b"/a"), (b"/a",)))
    await settle()
    assert len(etcd.sent) == 1  # no waiting for company
    rest = [asyncio.create_task(b.submit("t", txn(k), (k,))) for k in (b"/b", b"/c", b"/d")]
    await settle()
    assert len(etcd.sent) == 1  # one batch in flight: the others wait for it
    etcd.answer(0)
    await first
    await settle()
    assert len(etcd.sent) == 2 and batch_size(etcd.sent[1]) == 3
    etcd.answer(1)
    batched = await asyncio.gather(*rest)
    assert all(r.succeeded for r in batched)
    assert [r.header.revision for r in batched] == [101] * 3  # each sees the batch's revision
    await b.close()


async def test_a_full_batch_waiting_goes_out_in_parallel() -> None:
    etcd = FakeEtcd()
    b = TxnBatcher(etcd, 1.0, max_items=4, max_burst=3)  # type: ignore[arg-type]
    tasks = [
        asyncio.create_task(b.submit("t", txn(f"/k{i}".encode()), (f"/k{i}".encode(),))) for i in range(13)
    ]
    await settle()
    # The first alone, then full batches of 4 while fewer than 3 are in flight.
    assert [batch_size(r) for r in etcd.sent] == [1, 4, 4]
    for i in range(len(etcd.sent)):
        etcd.answer(i)
    await settle()
    assert [batch_size(r) for r in etcd.sent] == [1, 4, 4, 4]
    etcd.answer(3)
    assert len(await asyncio.gather(*tasks)) == 13
    await b.close()


async def test_transactions_on_one_key_never_share_a_batch() -> None:
    etcd = FakeEtcd()
    b = TxnBatcher(etcd, 1.0, max_items=8)  # type: ignore[arg-type]
    first = asyncio.create_task(b.submit("t", txn(b"/x"), (b"/x",)))
    await settle()
    same = [asyncio.create_task(b.submit("t", txn(b"/same"), (b"/same",))) for _ in range(2)]
    other = asyncio.create_task(b.submit("t", txn(b"/y"), (b"/y",)))
    await settle()
    etcd.answer(0)
    await settle()
    assert batch_size(etcd.sent[1]) == 2  # /same and /y; the second /same waits
    etcd.answer(1)
    await settle()
    assert batch_size(etcd.sent[2]) == 1
    etcd.answer(2)
    await asyncio.gather(first, *same, other)
    await b.close()


async def test_closing_answers_every_waiting_caller() -> None:
    etcd = FakeEtcd()
    b = TxnBatcher(etcd, 1.0, max_items=8)  # type: ignore[arg-type]
    first = asyncio.create_task(b.submit("t", txn(b"/a"), (b"/a",)))  # in flight, never answered
    await settle()
    queued = [asyncio.create_task(b.submit("t", txn(k), (k,))) for k in (b"/b", b"/c")]
    await settle()
    await b.close()
    late = asyncio.create_task(b.submit("t", txn(b"/d"), (b"/d",)))
    for caller in (*queued, late):
        with pytest.raises(StoreUnavailable, match="closed"):
            await caller
    assert len(etcd.sent) == 1  # nothing leaves after close
    first.cancel()


async def test_closing_answers_the_callers_of_a_batch_in_flight() -> None:
    etcd = FakeEtcd()
    b = TxnBatcher(etcd, 1.0, max_items=8)  # type: ignore[arg-type]
    first = asyncio.create_task(b.submit("t", txn(b"/a"), (b"/a",)))
    await settle()
    queued = [asyncio.create_task(b.submit("t", txn(k), (k,))) for k in (b"/b", b"/c")]
    await settle()
    etcd.answer(0)
    await first
    await settle()
    assert batch_size(etcd.sent[1]) == 2  # in flight, never answered
    await b.close()
    for caller in queued:
        with pytest.raises(StoreUnavailable, match="closed"):
            await caller


async def test_a_lease_etcd_no_longer_has_fails_only_the_items_naming_it() -> None:
    """etcd refuses a whole batch for one lost lease (nothing applied): the items go again
    grouped by the leases they name, and only that lease's fail. Each caller used to retry
    once; a second stale lease in the retry batch then failed healthy claims as 'etcd
    unavailable'."""
    etcd = FakeEtcd()
    b = TxnBatcher(etcd, 1.0, max_items=8)  # type: ignore[arg-type]
    first = asyncio.create_task(b.submit("t", txn(b"/x"), (b"/x",)))
    await settle()
    leases = {b"/ok": 1, b"/stale": 2, b"/fine": 1}
    batched = [asyncio.create_task(b.submit("t", txn(k, lease), (k,))) for k, lease in leases.items()]
    await settle()
    etcd.answer(0)
    await first
    await settle()
    assert batch_size(etcd.sent[1]) == 3
    etcd.answers[1].set_exception(LeaseGone("etcdserver: requested lease not found"))
    await settle()
    assert [batch_size(r) for r in etcd.sent[2:]] == [2, 1]  # lease 1's two, lease 2's one
    etcd.answer(2)
    etcd.answers[3].set_exception(LeaseGone("etcdserver: requested lease not found"))
    ok, stale, fine = await asyncio.gather(*batched, return_exceptions=True)
    assert isinstance(stale, LeaseGone)
    assert isinstance(ok, rpc.TxnResponse) and ok.succeeded and isinstance(fine, rpc.TxnResponse)
    # Closed while such a batch goes again: its callers are answered too.
    first = asyncio.create_task(b.submit("t", txn(b"/x"), (b"/x",)))
    await settle()
    batched = [asyncio.create_task(b.submit("t", txn(k, lease), (k,))) for k, lease in leases.items()]
    await settle()
    etcd.answer(4)
    await first
    await settle()
    etcd.answers[5].set_exception(LeaseGone("etcdserver: requested lease not found"))
    await settle()
    assert len(etcd.sent) == 8  # the two groups, on their way
    await b.close()
    answers = await asyncio.gather(*batched, return_exceptions=True)
    assert all(isinstance(a, StoreUnavailable) for a in answers), answers
