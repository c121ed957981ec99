"""KV events over real ZMQ: PUB stream, replay, hashes, eviction, reset, restart."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest_asyncio
import zmq
import zmq.asyncio

from emulator.kvevents import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    KVEventBatch,
    decode_batch,
    decode_seq,
    encode_seq,
)
from kvferry.blockhash import block_hashes, external_block_hash
from tests.emulator.conftest import StartEmulator
from tests.emulator.helpers import Client, async_test, conversation

TOPIC = "kv@test"


@pytest_asyncio.fixture
async def zctx() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


async def _subscribe(ctx: zmq.asyncio.Context, endpoint: str) -> zmq.asyncio.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
    sub.connect(endpoint)
    await asyncio.sleep(1.0)  # let the subscription reach the publisher (ms; a loaded VM, more)
    return sub


async def _receive(sub: zmq.asyncio.Socket) -> tuple[int, KVEventBatch]:
    topic, seq, payload = await asyncio.wait_for(sub.recv_multipart(), timeout=3)
    assert topic == TOPIC.encode()
    return decode_seq(seq), decode_batch(payload)


async def _replay(
    ctx: zmq.asyncio.Context, endpoint: str, start: int, topic: str = ""
) -> list[tuple[int, bytes]]:
    """Everything a DEALER gets for one replay request, up to the end marker, in vLLM
    0.32's shape: ``[b"", topic, seq, payload]`` per batch (the topic frame there even
    when empty), ``[b"", b"", seq -1, b""]`` at the end."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        await dealer.send_multipart([b"", encode_seq(start)])
        answers: list[tuple[int, bytes]] = []
        while True:
            empty, topic_frame, seq, payload = await asyncio.wait_for(dealer.recv_multipart(), timeout=3)
            assert empty == b""
            if seq == END_SEQ:
                assert (topic_frame, payload) == (b"", b"")
                return answers
            assert topic_frame == topic.encode()
            answers.append((decode_seq(seq), payload))
    finally:
        dealer.close()


def _events(batches: list[KVEventBatch]) -> list[Event]:
    return [event for batch in batches for event in batch.events]


@async_test(timeout=15)
async def test_stored_events_match_the_engines_hashes(
    start_emulator: StartEmulator, http: Client, zctx: zmq.asyncio.Context
) -> None:
    emu = await start_emulator(kv_events_port=0, kv_events_replay_port=0, kv_events_topic=TOPIC)
    assert emu.kv_events_endpoint is not None
    sub = await _subscribe(zctx, emu.kv_events_endpoint)
    messages = conversation()
    answer = await http.chat(
        emu, messages, max_tokens=40, ignore_eos=True, return_token_ids=True, session_id="conv-3"
    )
    seq, batch = await _receive(sub)
    assert seq == 0
    assert batch.data_parallel_rank == 0
    (stored,) = batch.events
    assert isinstance(stored, BlockStored)
    prompt = answer.body["prompt_token_ids"]
    full = len(prompt) // 16
    hashes = block_hashes(prompt, 16)
    assert stored.block_hashes == [external_block_hash(h) for h in hashes]
    assert stored.parent_block_hash is None
    assert stored.token_ids == prompt[: full * 16]
    assert (stored.block_size, stored.medium, stored.session_id) == (16, "GPU", "conv-3")

    # Decoding fills more blocks; their events chain on the prompt's last block.
    sequence = prompt + answer.body["choices"][0]["token_ids"]
    computed = len(sequence) - 1
    later: list[KVEventBatch] = []
    while (
        sum(len(e.block_hashes) for e in _events(later) if isinstance(e, BlockStored)) < computed // 16 - full
    ):
        later.append((await _receive(sub))[1])
    all_hashes = block_hashes(sequence[:computed], 16)
    first_later = _events(later)[0]
    assert isinstance(first_later, BlockStored)
    assert first_later.parent_block_hash == external_block_hash(all_hashes[full - 1])
    assert [h for e in _events(later) if isinstance(e, BlockStored) for h in e.block_hashes] == [
        external_block_hash(h) for h in all_hashes[full:]
    ]
    sub.close()


@async_test(timeout=15)
async def test_replay_returns_buffered_batches(
    start_emulator: StartEmulator, http: Client, zctx: zmq.asyncio.Context
) -> None:
    emu = await start_emulator(kv_events_port=0, kv_events_replay_port=0, kv_events_topic=TOPIC)
    assert emu.kv_events_replay_endpoint is not None
    sub = await _subscribe(zctx, str(emu.kv_events_endpoint))
    for i in range(3):
        await http.chat(emu, [{"role": "user", "content": f"Topic {i}. " * 10}], max_tokens=2)
    live = [await _receive(sub) for _ in range(3)]
    assert [seq for seq, _ in live] == [0, 1, 2]

    replayed = await _replay(zctx, emu.kv_events_replay_endpoint, 0, TOPIC)
    assert [seq for seq, _ in replayed] == [0, 1, 2]
    assert [decode_batch(payload) for _, payload in replayed] == [batch for _, batch in live]
    assert [seq for seq, _ in await _replay(zctx, emu.kv_events_replay_endpoint, 2, TOPIC)] == [2]
    assert await _replay(zctx, emu.kv_events_replay_endpoint, 99, TOPIC) == []

    req = zctx.socket(zmq.REQ)  # a REQ client gets the first answer
    req.setsockopt(zmq.LINGER, 0)
    req.connect(emu.kv_events_replay_endpoint)
    await req.send(encode_seq(1))
    topic, seq, payload = await asyncio.wait_for(req.recv_multipart(), timeout=3)
    assert topic == TOPIC.encode() and decode_seq(seq) == 1 and payload == replayed[1][1]
    req.close()
    sub.close()


@async_test(timeout=15)
async def test_eviction_and_reset_events(
    start_emulator: StartEmulator, http: Client, zctx: zmq.asyncio.Context
) -> None:
    emu = await start_emulator(
        kv_events_port=0, kv_events_replay_port=0, kv_events_topic=TOPIC, num_blocks=20, block_size=16
    )
    first = [{"role": "user", "content": "First conversation. " * 8}]  # 12 of the 20 blocks
    second = [{"role": "user", "content": "Second conversation. " * 8}]
    a = await http.chat(emu, first, max_tokens=1, return_token_ids=True)
    await http.chat(emu, second, max_tokens=1)
    await asyncio.sleep(0.05)
    batches = [decode_batch(p) for _, p in await _replay(zctx, str(emu.kv_events_replay_endpoint), 0, TOPIC)]
    removed = [h for e in _events(batches) if isinstance(e, BlockRemoved) for h in e.block_hashes]
    first_hashes = [external_block_hash(h) for h in block_hashes(a.body["prompt_token_ids"], 16)]
    assert removed  # the second conversation needed blocks the first one had cached
    assert set(removed) <= set(first_hashes)
    assert first_hashes[-1] in removed  # tail blocks go first (freed last-to-first, LRU)
    assert first_hashes[0] not in removed

    async with http.session.post(emu.http_url + "/reset_prefix_cache") as response:
        assert response.status == 200
    await asyncio.sleep(0.05)
    batches = [decode_batch(p) for _, p in await _replay(zctx, str(emu.kv_events_replay_endpoint), 0, TOPIC)]
    assert isinstance(_events(batches)[-1], AllBlocksCleared)
    assert (await http.state(emu))["cached_blocks"] == 0


@async_test(timeout=15)
async def test_restart_is_a_new_generation(
    start_emulator: StartEmulator, http: Client, zctx: zmq.asyncio.Context
) -> None:
    old = await start_emulator(kv_events_port=0, kv_events_replay_port=0)
    await http.chat(old, conversation(), max_tokens=3)
    await asyncio.sleep(0.05)
    assert len(await _replay(zctx, str(old.kv_events_replay_endpoint), 0)) >= 1
    await old.stop()

    new = await start_emulator(kv_events_port=0, kv_events_replay_port=0)
    assert new.engine_id != old.engine_id
    assert await _replay(zctx, str(new.kv_events_replay_endpoint), 0) == []
    await http.chat(new, conversation(), max_tokens=3)
    await asyncio.sleep(0.05)
    replayed = await _replay(zctx, str(new.kv_events_replay_endpoint), 0)
    assert replayed[0][0] == 0


@async_test()
async def test_no_prefix_caching_means_no_events(
    start_emulator: StartEmulator, http: Client, zctx: zmq.asyncio.Context
) -> None:
    emu = await start_emulator(kv_events_port=0, kv_events_replay_port=0, enable_prefix_caching=False)
    await http.chat(emu, conversation(), max_tokens=3)
    second = await http.chat(emu, conversation(), max_tokens=3)
    assert second.count("cached") == 0
    await asyncio.sleep(0.05)
    assert await _replay(zctx, str(emu.kv_events_replay_endpoint), 0) == []
