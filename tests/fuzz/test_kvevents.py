"""The sidecar's KV-event socket (its ZMQ SUB to the engine's publisher) under hostile
messages: random, truncated and oversized msgpack payloads, payloads of the wrong shape,
wrong topics, wrong frame counts, seq frames of the wrong size, seqs going backwards,
repeating and jumping. The sidecar runs in its own process behind a fake publisher
(tests/sidecar/helpers.FakePublisher): it must log (a warning, never an error), count
and carry on: a good batch sent after the junk reaches the daemon's index, and its
memory stays within a bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvferry.v1 import nodes_pb2, nodes_pb2_grpc
from realvllm.process import free_port
from tests.fuzz.campaign import fuzz
from tests.fuzz.processes import Deployment, Proc, http_status, node_alive, sidecar_argv
from tests.polling import eventually
from tests.sidecar.helpers import FakePublisher

TOPIC = b"kv"
ENGINE_ID = "fuzz-kv"
SEQ_MAX = 2**63 - 1


@dataclass
class KvSidecar:
    """A sidecar subscribed to `publisher`, its process, and where its index is read."""

    proc: Proc
    url: str
    publisher: FakePublisher
    daemon: str
    high: int = -1
    """The highest seq sent since the last wrap: the next good batch goes one past it (at
    or a little below what the sidecar has seen, a batch is skipped as delivered twice)."""
    sentinel: int = 1 << 40

    def metric(self, name: str) -> float:
        """A counter of the sidecar's /kvferry/metrics (summed over its labels)."""
        import urllib.request

        with urllib.request.urlopen(self.url + "/kvferry/metrics", timeout=5) as r:
            text = r.read().decode()
        return sum(float(m) for m in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))

    async def indexed(self, block_hash: int) -> bool:
        async with grpc.aio.insecure_channel(self.daemon) as ch:
            scores = await nodes_pb2_grpc.NodesStub(ch).Score(
                nodes_pb2.ScoreRequest(block_hashes=[block_hash])
            )
        return any(s.engine_id == ENGINE_ID and s.cached_blocks == 1 for s in scores.scores)

    async def carries_on(self) -> None:
        """Good batches, next in sequence, reach the daemon's index: one at first, another
        each second it is not there (after a replay, seqs below the last one are taken
        for batches delivered twice for 2 s: a seq that wrapped to 0 waits that out)."""
        self.sentinel += 1
        block = self.sentinel

        async def indexed() -> bool:
            if self.high < SEQ_MAX:
                self.high += 1
            else:  # a new engine: seq 0, and a replay buffer of its own
                self.high = 0
                self.publisher.kept.clear()
            good = batch({"type": "BlockStored", "block_hashes": [block]})
            await self.publisher.publish(self.high, good)
            with contextlib.suppress(TimeoutError):
                await eventually(lambda: self.indexed(block), within=1.0, interval=0.05)
                return True
            return False

        await eventually(indexed, within=20)
        assert self.proc.alive(), self.proc.log_tail()
        errors = [e for e in self.proc.logs() if e.get("level") in ("error", "critical")]
        assert not errors, errors[:3]


def batch(*events: Any) -> bytes:
    return msgspec.msgpack.encode([1.0, list(events), 0])


@pytest.fixture
async def kv(live: Deployment, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[KvSidecar]:
    publisher = FakePublisher(topic=TOPIC)
    await publisher.start()
    port = free_port()
    extra = [
        "--kv-events-endpoint",
        publisher.endpoint,
        "--kv-events-replay-endpoint",
        publisher.replay_endpoint,
    ]
    extra += ["--kv-events-topic", TOPIC.decode()]
    proc = Proc("sidecar-kv", sidecar_argv(live.engine_url, port, live.daemon_address, ENGINE_ID, *extra),
                tmp_path_factory.mktemp("sidecar-kv"))  # fmt: skip
    proc.start()
    sc = KvSidecar(proc, f"http://127.0.0.1:{port}", publisher, live.daemon_address)
    try:
        await asyncio.to_thread(proc.wait, node_alive(live.daemon_address, ENGINE_ID))
        await asyncio.to_thread(proc.wait, lambda: http_status(sc.url + "/kvferry/metrics") == 200)
        await eventually(lambda: _replayed(sc), within=20)  # (subscribed: what follows is not lost)
        await sc.carries_on()
        yield sc
    finally:
        proc.stop()
        await publisher.close()


async def _replayed(sc: KvSidecar) -> bool:
    return await asyncio.to_thread(sc.metric, "kvferry_sidecar_kv_replays_total") >= 1


# -- what is sent ------------------------------------------------------------------------

_int = st.integers(-(2**63), 2**64 - 1)  # (what msgpack carries)
_hashes = st.lists(st.one_of(st.integers(-(2**63), 2**64 - 1), st.binary(max_size=40)), max_size=20)
_events = st.one_of(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "Nope", ""])},
        optional={
            "block_hashes": st.one_of(_hashes, _int, st.text(max_size=5)),
            "parent_block_hash": st.integers(0, 2**64 - 1),
            "block_size": _int,
            "token_ids": st.lists(st.integers(0, 2**31), max_size=8),
        },
    ),
    st.tuples(st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared"]), _hashes).map(list),
    _int,
    st.text(max_size=8),
    st.none(),
)


@st.composite
def payloads(draw: st.DrawFn) -> bytes:
    """A payload: a batch of odd events, one of the wrong shape, one cut short, or junk."""
    kind = draw(st.sampled_from(["events", "shape", "cut", "junk", "deep"]))
    if kind == "events":
        return batch(*draw(st.lists(_events, max_size=6)))
    if kind == "shape":
        odd = st.one_of(
            st.none(),
            _int,
            st.text(max_size=8),
            st.dictionaries(st.text(max_size=4), _int, max_size=3),
        )
        return msgspec.msgpack.encode(draw(st.lists(odd, max_size=4)))
    if kind == "cut":
        whole = batch(*draw(st.lists(_events, min_size=1, max_size=4)))
        return whole[: draw(st.integers(0, len(whole) - 1))]
    if kind == "deep":
        return b"\x93\xcb" + b"\0" * 8 + b"\x91" * draw(st.integers(100, 5000))
    return draw(st.binary(max_size=200))


def seq_frame(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


@st.composite
def messages(draw: st.DrawFn) -> tuple[list[bytes], int | None]:
    """Frames of one message, and the seq it carries (None: not a well-framed one)."""
    kind = draw(st.sampled_from(["good", "good", "topic", "frames", "seq_size"]))
    if kind == "frames":
        return draw(
            st.lists(st.binary(max_size=30), min_size=1, max_size=5).filter(lambda f: len(f) != 3)
        ), None
    if kind == "seq_size":
        bad = draw(st.binary(max_size=12).filter(lambda b: len(b) != 8))
        return [TOPIC, bad, draw(payloads())], None
    seq = draw(st.one_of(st.integers(-5, 40), st.sampled_from([-(2**63), SEQ_MAX, 2**32, 10**6])))
    topic = TOPIC if kind == "good" else TOPIC + draw(st.binary(min_size=1, max_size=4))
    return [topic, seq_frame(seq), draw(payloads())], seq if kind == "good" else None


@fuzz(12, shrink=False)
@given(sent=st.lists(messages(), min_size=1, max_size=8))
async def test_the_sidecar_carries_on_after_any_messages(
    kv: KvSidecar, sent: list[tuple[list[bytes], int | None]]
) -> None:
    for frames, seq in sent:
        await kv.publisher.pub.send_multipart(frames)
        if seq is not None:
            kv.high = max(kv.high, seq)
    await kv.carries_on()


#: Oversized payloads sent at once (4 MiB each: junk, a msgpack string, a batch cut short),
#: and the resident memory the sidecar may keep of them.
OVERSIZED = 24
KV_MEMORY_BOUND_KIB = 48 * 1024


async def test_oversized_payloads_are_skipped_and_not_kept(kv: KvSidecar) -> None:
    size = 4 * 1024 * 1024
    huge_batch = batch({"type": "BlockStored", "block_hashes": list(range(size // 9))})
    payloads = [
        bytes(range(256)) * (size // 256),
        msgspec.msgpack.encode([1.0, "x" * size, 0]),
        huge_batch[: len(huge_batch) // 2],
    ]
    await kv.carries_on()
    before = kv.proc.rss_kib()
    for i in range(OVERSIZED):
        kv.high += 1
        await kv.publisher.pub.send_multipart([TOPIC, seq_frame(kv.high), payloads[i % len(payloads)]])
    await kv.carries_on()
    after = kv.proc.rss_kib()
    print(f"sidecar VmRSS {before} -> {after} KiB over {OVERSIZED} payloads of 4 MiB")
    assert after - before < KV_MEMORY_BOUND_KIB, (before, after)
    malformed = await asyncio.to_thread(kv.metric, "kvferry_sidecar_kv_events_malformed_total")
    assert malformed >= OVERSIZED, malformed
