"""Pure decisions of the router about where a turn goes: node choice, retries after a
failure, engine URLs and daemon replicas avoided for a while, the lookup breaker."""

from __future__ import annotations

from typing import Any

import pytest

from router.choice import (
    Node,
    alike,
    choose_decode,
    choose_prefill,
    fresh_retry_node,
    worth_scoring,
)
from router.decisions import (
    Breaker,
    Failure,
    FailureKind,
    Retry,
    retry_after,
    retry_decode_elsewhere,
    spends_retry,
)
from router.nodes import DirectRoutes, base_model_of, static_nodes
from router.upstream import tokens_of

# -- node choice ----------------------------------------------------------------------------


def _nodes() -> list[Node]:
    return [
        Node("p1", "prefill", "http://p1", indexed_blocks=10),
        Node("p2", "prefill", "http://p2", indexed_blocks=10),
        Node("b1", "both", "http://b1"),
        Node("d1", "decode", "http://d1"),
        Node("d2", "decode", "http://d2"),
    ]


def test_decode_is_the_least_busy_and_ties_rotate() -> None:
    nodes = _nodes()
    assert choose_decode(nodes, {"d1": 2, "d2": 1, "b1": 3}).engine_id == "d2"  # type: ignore[union-attr]
    picks = {choose_decode(nodes, {"b1": 5}, t).engine_id for t in range(4)}  # type: ignore[union-attr]
    assert picks == {"d1", "d2"}
    assert choose_decode([Node("p", "prefill", "u")], {}) is None
    # A D of P's block size first, however busy (P's KV, and the next turn's digests, are in
    # blocks of that size); another only when there is none.
    mixed = [*nodes, Node("d32", "decode", "http://d32", block_size=32)]
    assert choose_decode(mixed, {"d1": 9, "d2": 9, "b1": 9}, block_size=32).engine_id == "d32"  # type: ignore[union-attr]
    assert choose_decode(mixed, {"d1": 9, "d2": 9, "b1": 9}, block_size=16).engine_id != "d32"  # type: ignore[union-attr]
    assert choose_decode(nodes, {}, block_size=64) is not None


def test_prefill_prefers_the_cached_prefix_unless_much_busier() -> None:
    nodes = _nodes()
    assert choose_prefill(nodes, {"p1": 1, "b1": 1}).engine_id == "p2"  # type: ignore[union-attr]
    cached = {"p1": 50, "p2": 3}
    assert choose_prefill(nodes, {"p1": 3}, cached).engine_id == "p1"  # type: ignore[union-attr]
    assert choose_prefill(nodes, {"p1": 9}, cached, load_slack=4).engine_id == "p2"  # type: ignore[union-attr]
    assert choose_prefill(nodes, {}, exclude={"p1", "p2", "b1"}) is None
    assert choose_prefill(nodes, {}, cached, exclude={"p1"}).engine_id == "p2"  # type: ignore[union-attr]


def test_a_p_is_only_traded_for_one_of_the_same_model_and_block_size() -> None:
    """The prompt's token ids came from one P's tokenizer, its digests (and a pull's params,
    D's blocks) are in its block size: a P chosen after that must take the same."""
    tokenized = Node("p1", "prefill", "http://p1", model="m", block_size=16)
    nodes = [
        tokenized,
        Node("p2", "prefill", "http://p2", model="m", block_size=16),
        Node("p3", "prefill", "http://p3", model="m", block_size=64),
        Node("p4", "prefill", "http://p4", model="other", block_size=16),
        Node("p5", "prefill", "http://p5", model="", block_size=16),  # model not known yet
        Node("d1", "decode", "http://d1", model="m", block_size=16),
    ]
    assert [n.engine_id for n in alike(nodes, tokenized)] == ["p1", "p2"]
    cached = {"p3": 500, "p4": 500, "p5": 500, "p2": 1}
    assert choose_prefill(alike(nodes, tokenized), {}, cached).engine_id == "p2"  # type: ignore[union-attr]


def test_a_tokenize_answer_nested_too_deep_is_no_answer() -> None:
    assert tokens_of(b'{"tokens": [1, 2], "x": ' + b"[" * 1000 + b"]" * 1000 + b"}") is None


def test_a_fresh_retry_leaves_an_unreachable_p_for_any_other() -> None:
    """Without D's params any P of the model will do: an unreachable P is left for one of
    another block size rather than tried again (which answered the client 502)."""
    p1 = Node("p1", "prefill", "http://p1", model="m", block_size=16)
    p2 = Node("p2", "prefill", "http://p2", model="m", block_size=32)
    nodes = [p1, p2, Node("d1", "decode", "http://d1", model="m", block_size=16)]
    assert fresh_retry_node(p1, nodes, {"p1"}, {}, unreachable=True) is p2
    assert fresh_retry_node(p1, nodes, {"p1"}, {}, unreachable=False) is p1  # it answered: again
    assert fresh_retry_node(p1, [p1], {"p1"}, {}, unreachable=True) is p1  # no other


def test_scoring_only_when_it_can_change_the_choice() -> None:
    nodes = _nodes()
    assert worth_scoring(nodes)
    assert not worth_scoring([n for n in nodes if n.engine_id != "p2"], exclude={"b1"})
    assert not worth_scoring([Node("p1", "prefill", "u"), Node("p2", "prefill", "v")])


def test_static_nodes_and_the_base_model_of_a_models_answer() -> None:
    nodes = static_nodes(["http://a", "http://b"], ["http://b", "http://c"], "m", 32)
    assert [(n.engine_id, n.role) for n in nodes] == [
        ("http://a", "prefill"),
        ("http://b", "both"),
        ("http://c", "decode"),
    ]
    assert all(n.block_size == 32 and n.model == "m" for n in nodes)
    answer = {"data": [{"id": "lora-1", "parent": "base"}, {"id": "base", "parent": None}]}
    assert base_model_of(answer) == "base"
    assert base_model_of({"data": "nope"}) == "" == base_model_of([])


# -- retries ----------------------------------------------------------------------------------


def test_a_failed_pull_is_retried_once_without_params() -> None:
    five = Failure(FailureKind.STATUS, 500)
    assert retry_after(five, sent_remote=True, attempt=0, other_node_available=False) is Retry.FRESH
    assert retry_after(Failure(FailureKind.STATUS, 400), True, 0, False) is Retry.FRESH
    assert retry_after(five, True, 1, True) is None


def test_without_params_only_an_unreachable_p_is_retried_elsewhere() -> None:
    connect = Failure(FailureKind.CONNECT)
    assert retry_after(connect, False, 0, True) is Retry.OTHER_NODE
    assert retry_after(connect, False, 0, False) is None
    assert retry_after(Failure(FailureKind.STATUS, 500), False, 0, True) is None
    assert retry_after(Failure(FailureKind.STATUS, 404), False, 0, True) is None
    assert retry_after(Failure(FailureKind.TIMEOUT), True, 0, True) is None


def test_an_unreachable_p_hands_the_params_to_another_p() -> None:
    """P never saw the daemon's params: another P pulls the same blocks (not recompute)."""
    connect = Failure(FailureKind.CONNECT)
    assert retry_after(connect, sent_remote=True, attempt=0, other_node_available=True) is Retry.OTHER_NODE
    assert retry_after(connect, sent_remote=True, attempt=0, other_node_available=False) is Retry.FRESH
    assert not spends_retry(Retry.OTHER_NODE, sent_remote=True)  # a failing pull there still gets FRESH
    assert spends_retry(Retry.OTHER_NODE, sent_remote=False) and spends_retry(Retry.FRESH, sent_remote=True)


def test_decode_goes_elsewhere_only_when_d_never_saw_the_request() -> None:
    assert retry_decode_elsewhere(Failure(FailureKind.CONNECT), True)
    assert not retry_decode_elsewhere(Failure(FailureKind.CONNECT), False)
    assert not retry_decode_elsewhere(Failure(FailureKind.PROTOCOL), True)
    assert not retry_decode_elsewhere(Failure(FailureKind.TIMEOUT), True)
    nodes = _nodes()
    assert choose_decode(nodes, {}, exclude={"d1", "d2"}).engine_id == "b1"  # type: ignore[union-attr]
    assert choose_decode(nodes, {}, exclude={"d1", "d2", "b1"}) is None


def test_client_errors_are_4xx_statuses_only() -> None:
    assert Failure(FailureKind.STATUS, 404).client_error
    assert not Failure(FailureKind.STATUS, 503).client_error
    assert not Failure(FailureKind.CONNECT).client_error


def test_breaker_pauses_lookups_doubling_and_closes_on_success() -> None:
    b = Breaker(0.1, 1.0)
    assert b.allows(0.0)
    b.record(False, 10.0)
    assert not b.allows(10.05) and b.allows(10.1)
    b.record(False, 10.1)
    assert not b.allows(10.25) and b.allows(10.3)
    for _ in range(10):
        b.record(False, 20.0)
    assert b.open_until == pytest.approx(21.0)
    b.record(True, 21.0)
    assert b.allows(21.0) and b.failures == 0


# -- engine URLs and daemon replicas avoided for a while -------------------------------------------


def test_an_unreachable_engine_url_is_avoided_for_a_while() -> None:
    now = [100.0]
    routes = DirectRoutes(retry_after_s=60.0, clock=lambda: now[0])
    p = Node(engine_id="p-1", role="prefill", url="http://10.0.0.1:8100", engine_url="http://10.0.0.1:8000")
    plain = Node(engine_id="p-2", role="prefill", url="http://10.0.0.2:8100")
    assert routes.url(p) == p.engine_url and routes.url(plain) == plain.url
    assert not routes.unreachable(plain, plain.url)  # nothing to fall back from
    assert routes.unreachable(p, p.engine_url)
    assert routes.url(p) == p.url
    assert not routes.unreachable(p, p.url)  # the sidecar itself failed: a real failure
    now[0] += 61
    assert routes.url(p) == p.engine_url  # tried again later


async def test_no_score_is_asked_while_the_breaker_holds_lookups_back() -> None:
    """A failing daemon: a scored turn does not wait for Score to fail as well."""
    import time

    from router.daemon_client import DaemonClient
    from router.settings import DaemonSettings

    control = DaemonClient(["127.0.0.1:1"], DaemonSettings(addresses=("127.0.0.1:1",)))
    asked: list[object] = []
    control._replica.nodes.Score = lambda *a, **k: asked.append(a)  # type: ignore[method-assign]
    control.breaker.record(False, time.monotonic())
    try:
        assert await control.score([1, 2]) == {} and asked == []
    finally:
        await control.close()


async def test_lookups_leave_a_replica_that_keeps_answering_late() -> None:
    """A replica that keeps its connection but answers no lookup in time (hung, or
    overloaded): after three in a row the next lookups go to another replica. Only one that
    could not be reached was left before; lookups skipped reuse while a healthy one idled.
    Lookups out together (one slow etcd round) are late together: they count once."""
    import asyncio
    import time

    import grpc

    from kvferry.leaseclient import LeaseOpError
    from router.daemon_client import LATE_FAILOVER, DaemonClient
    from router.settings import DaemonSettings

    addresses = ("127.0.0.1:1", "127.0.0.1:2")
    control = DaemonClient(list(addresses), DaemonSettings(addresses=addresses))

    async def late(req: object, message: Any, *args: object) -> object:
        await asyncio.sleep(0.01)
        raise LeaseOpError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline")

    async def lookup() -> Any:
        prompt: asyncio.Future[tuple[list[int], bytes] | None] = asyncio.get_running_loop().create_future()
        prompt.set_result(None)
        return await control.lookup_early("", "c", prompt)

    hung = control._replica
    hung.stream.lookup_verifying = late  # type: ignore[method-assign]
    try:
        await asyncio.gather(*(lookup() for _ in range(LATE_FAILOVER)))
        assert control._replica is hung and hung.late == 1
        for i in range(LATE_FAILOVER - 1):
            assert control._replica is hung, i
            control.breaker.open_until = 0.0  # (the breaker's pause over)
            reuse = await lookup()
            assert (reuse.decision, reuse.reason) == ("SKIPPED", "daemon_timeout")
        assert control._replica is not hung and control._replica.address == addresses[1]
        assert time.monotonic() < control.breaker.open_until  # (the breaker counted them)
    finally:
        await control.close()


async def test_one_late_lookup_does_not_open_the_breaker_two_in_a_row_do() -> None:
    """On a saturated machine an answer is read late now and then: each late one opening the
    breaker skipped reuse for every turn of the pause (bench.busy: 96 of 702 turns that
    could pull). One late answer leaves the breaker closed; LATE_TRIPS in a row open it;
    an answer in time resets the count."""
    import asyncio
    import time

    import grpc

    from kvferry.leaseclient import LeaseOpError
    from router.daemon_client import LATE_TRIPS, DaemonClient
    from router.settings import DaemonSettings

    addresses = ("127.0.0.1:1", "127.0.0.1:2")
    control = DaemonClient(list(addresses), DaemonSettings(addresses=addresses))
    answers_late = True

    async def answer(req: object, message: Any, *args: object) -> object:
        await asyncio.sleep(0.001)
        if answers_late:
            raise LeaseOpError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline")
        from kvferry.v1 import leases_pb2

        return leases_pb2.LookupResponse()

    async def lookup() -> Any:
        prompt: asyncio.Future[tuple[list[int], bytes] | None] = asyncio.get_running_loop().create_future()
        prompt.set_result(None)
        return await control.lookup_early("", "c", prompt)

    control._replica.stream.lookup_verifying = answer  # type: ignore[method-assign]
    try:
        assert LATE_TRIPS == 2
        await lookup()
        assert control.breaker.allows(time.monotonic())  # one late: still closed
        answers_late = False
        await lookup()  # in time: the count starts again
        answers_late = True
        await lookup()
        assert control.breaker.allows(time.monotonic())
        await lookup()  # the second late one in a row
        assert not control.breaker.allows(time.monotonic())
    finally:
        await control.close()
