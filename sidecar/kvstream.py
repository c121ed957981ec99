"""The engine's KV-event stream over ZMQ, folded into the mirror.

SUB to the engine's PUB endpoint: multipart ``[topic, seq, payload]``. On
start, and whenever the seq jumps, the missing batches are asked of the replay
endpoint (DEALER: ``[b"", start seq]`` -> ``[b"", topic, seq, payload]`` ... until
seq -1, or ``[b"", seq, payload]`` from older releases: `replay_answer`) before
going on; SUB keeps queueing live messages meanwhile, and those the replay
already covered are skipped (see `SeqTracker`), as is a batch delivered twice. A
seq back at 0 (or far back) is a new engine process (`EngineInstance.restart`);
the publisher going away puts the engine in doubt at once (kvmonitor.py). What
cannot be replayed (no replay endpoint, the engine's buffer no longer reaches
back, a replay timing out) makes the next batch a reset: the daemon gets the
mirror as it stands.
A payload (or a message) that does not decode is counted and skipped, never fatal;
the warnings about them are thinned (`kvferry.logs.Throttle`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog
import zmq
import zmq.asyncio

from kvferry.logs import Throttle
from kvferry.tasks import cancel_and_wait
from sidecar.engine import EngineInstance
from sidecar.kvevents import (
    Cleared,
    Decoder,
    MalformedPayload,
    Removed,
    Stored,
    decode_seq,
    encode_seq,
    replay_answer,
)
from sidecar.kvindex import KvMirror, SeqTracker, Verdict, replay_outcome
from sidecar.kvmonitor import watch_publisher
from sidecar.metrics import SidecarMetrics
from sidecar.settings import KvEventSettings

log = structlog.get_logger(__name__)

#: After a replay that timed out, gaps are not replayed again for this long.
REPLAY_COOLDOWN_S = 5.0
#: A replay ends within this many answer timeouts, however much it still sends.
REPLAY_WHOLE_TIMEOUTS = 30
#: Messages handled between two yields to the event loop.
_YIELD_EVERY = 64
#: At most one warning about malformed messages this often (each is counted all the same).
MALFORMED_LOG_EVERY_S = 10.0


class KvIngest:
    """Subscribes to one engine's KV events (data-parallel rank `rank`'s: `settings` are
    that rank's endpoints) and keeps `mirror` up to date."""

    def __init__(
        self,
        settings: KvEventSettings,
        ctx: zmq.asyncio.Context,
        mirror: KvMirror,
        instance: EngineInstance,
        metrics: SidecarMetrics,
        on_change: Callable[[], None],
        rank: int = 0,
    ) -> None:
        self._s = settings
        self._rank = rank
        self._ctx = ctx
        self._mirror = mirror
        self._instance = instance
        self._metrics = metrics
        self._on_change = on_change
        self._tracker = SeqTracker()
        self._decoder = Decoder()
        self._replay_after = 0.0
        self._malformed_log = Throttle(MALFORMED_LOG_EVERY_S)
        instance.on_restart(self._engine_restarted)

    def _engine_restarted(self) -> None:
        self._mirror.forget()
        self._tracker.restart()
        self._on_change()

    async def run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 0)  # never drop: a gap costs a replay, a queue only memory
        sub.setsockopt(zmq.SUBSCRIBE, self._s.topic.encode())
        sub.connect(self._s.endpoint)
        monitor = asyncio.create_task(
            watch_publisher(sub, self._instance, self._rank), name="kvevents-monitor"
        )
        sync: zmq.Socket[bytes] = zmq.Socket.shadow(sub.underlying)
        log.info(
            "kvevents.subscribed",
            endpoint=self._s.endpoint,
            replay=self._s.replay_endpoint or None,
            rank=self._rank,
        )
        try:
            await self._catch_up(0)
            while True:
                await sub.poll(zmq.POLLIN)
                handled = 0
                while True:
                    try:
                        frames = sync.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        await self._on_message(frames)
                    except Exception:  # a bug must not stop the stream
                        log.exception("kvevents.message.failed")
                        self._mirror.request_reset()
                    handled += 1
                    if handled % _YIELD_EVERY == 0:
                        await asyncio.sleep(0)
        finally:
            await cancel_and_wait([monitor])
            sub.close(linger=0)

    async def _on_message(self, frames: list[bytes]) -> None:
        self._metrics.kv_payloads.labels("live").inc()
        try:
            if len(frames) != 3:
                raise ValueError(f"{len(frames)} frames, expected 3")
            seq = decode_seq(frames[1])
        except ValueError as e:
            self._malformed(None, str(e))
            return
        loop = asyncio.get_running_loop()
        verdict = self._tracker.classify(seq, loop.time())
        if verdict is Verdict.RESTART:
            log.warning("kvevents.seq.backwards", seq=seq, expected=self._tracker.expected)
            self._instance.restart("kv_seq")
            verdict = self._tracker.classify(seq, loop.time())
        if verdict is Verdict.GAP:
            self._metrics.kv_gaps.inc()
            log.info("kvevents.gap", expected=self._tracker.expected, seq=seq)
            await self._catch_up(self._tracker.expected)
            verdict = self._tracker.classify(seq, loop.time())
            if verdict is Verdict.GAP:  # what is missing cannot be had: go on from here
                self._mirror.request_reset()
                self._tracker.skip_to(seq)
                verdict = Verdict.APPLY
        if verdict is Verdict.APPLY:
            self._apply(frames[2], seq)

    def _apply(self, payload: bytes, seq: int) -> None:
        """Fold batch `seq` in, and count it applied even when folding failed: asked for
        again, it would fail again (every later batch read as a gap, and replayed)."""
        try:
            self._fold(payload, seq)
        except Exception:  # a bug must not stop the stream, nor stall it on this batch
            log.exception("kvevents.message.failed", seq=seq)
            self._mirror.request_reset()
        self._tracker.applied(seq)

    def _fold(self, payload: bytes, seq: int) -> None:
        try:
            batch = self._decoder.decode(payload)
        except MalformedPayload as e:
            self._malformed(seq, str(e))
            return
        stored = removed = cleared = 0
        for event in batch.events:
            if isinstance(event, Stored):
                stored += 1
            elif isinstance(event, Removed):
                removed += 1
            elif isinstance(event, Cleared):
                cleared += 1
        m = self._metrics.kv_events
        if stored:
            m.labels("BlockStored").inc(stored)
        if removed:
            m.labels("BlockRemoved").inc(removed)
        if cleared:
            m.labels("AllBlocksCleared").inc(cleared)
        if batch.unknown:
            self._metrics.kv_unknown.inc(batch.unknown)
        self._mirror.apply(batch.events, seq, self._rank)
        self._on_change()

    def _malformed(self, seq: int | None, error: str) -> None:
        self._metrics.kv_malformed.inc()
        left_out = self._malformed_log.due(asyncio.get_running_loop().time())
        if left_out is not None:
            log.warning("kvevents.payload.malformed", seq=seq, error=error, left_out=left_out)

    async def _catch_up(self, start: int) -> None:
        """Replay from `start` and fold in what comes back."""
        loop = asyncio.get_running_loop()
        if not self._s.replay_endpoint or loop.time() < self._replay_after:
            if start > 0:
                self._metrics.kv_replays.labels("unavailable").inc()
                self._mirror.request_reset()
            return
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        # vLLM sends its whole buffer (up to 10,000 batches) in a tight loop, and its
        # ROUTER drops what a peer's queue cannot take: take everything as it comes.
        dealer.setsockopt(zmq.RCVHWM, 0)
        dealer.connect(self._s.replay_endpoint)
        seqs: list[int] = []
        outcome = "complete"
        try:
            await dealer.send_multipart([b"", encode_seq(start)])
            # A timeout per answer (a full buffer takes long), and a bound on the whole.
            whole = loop.time() + REPLAY_WHOLE_TIMEOUTS * self._s.replay_timeout_s
            while True:
                async with asyncio.timeout_at(min(whole, loop.time() + self._s.replay_timeout_s)):
                    frames = await dealer.recv_multipart()
                try:
                    answer = replay_answer(frames)
                except ValueError as e:
                    self._malformed(None, str(e))
                    continue
                if answer.end:
                    break
                seq = answer.seq
                self._metrics.kv_payloads.labels("replay").inc()
                seqs.append(seq)
                if seq >= self._tracker.expected:
                    self._apply(answer.payload, seq)
                if len(seqs) % _YIELD_EVERY == 0:  # (queued answers come back without a suspension)
                    await asyncio.sleep(0)
            if not replay_outcome(start, seqs):
                outcome = "incomplete"
        except TimeoutError:
            outcome = "timeout"
            self._replay_after = loop.time() + REPLAY_COOLDOWN_S
        finally:
            dealer.close(linger=0)
        if outcome != "complete":
            self._mirror.request_reset()
            log.warning("kvevents.replay.lossy", outcome=outcome, start=start, replayed=len(seqs))
        self._metrics.kv_replays.labels(outcome).inc()
        self._tracker.replayed(seqs[-1] if seqs else None, loop.time())
