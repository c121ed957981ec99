"""The emulated engine: prefill with prefix caching and remote pulls, decode, holds.

One engine per process start (a generation, with a fresh agent name, and a fresh
``engine_id`` unless one is configured, as vLLM's ``kv_transfer_config.engine_id``). It
owns the block pool and the side channel through which other engines read the
blocks it holds for them; its ``Puller`` (``emulator.pulls``) reads the blocks others
hold. Prefill work is serialized through one lock, the "GPU", so concurrent requests
queue; remote pulls and decode steps are not (NIXL reads run beside the compute,
decode steps are batched on a real engine).

Lifecycle of a request: ``submit`` prefills (local cache hit, remote pull per
``kv_transfer_params``, compute the rest) and returns a ``RunningRequest`` whose
``tokens()`` yields generated tokens. A normal finish (stop or length) may hold
the blocks for a remote reader and produce the ``kv_transfer_params`` that say
so; an abort never does.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from collections.abc import AsyncGenerator, Callable
from typing import Annotated, Any

import msgspec
import structlog

from emulator import kvmodel
from emulator.blocks import Block, BlockPool
from emulator.config import EmulatorConfig
from emulator.errors import CapacityExceeded, InvalidRequest
from emulator.hashing import BlockHasher
from emulator.holds import REGISTRATION_GENERATION, HeldBlockTable
from emulator.kvevents import Event
from emulator.metrics import EngineMetrics
from emulator.pulls import Puller
from emulator.sequence import GenerationSpec, KVSequence, PrefillStats
from emulator.sidechannel import SideChannelServer
from emulator.timing import modeled
from emulator.tokenizer import EOS_TOKEN_ID, VOCAB_SIZE
from emulator.transfer import HeldBlocks, describe_held_blocks
from kvferry.blockhash import none_hash

log = structlog.get_logger(__name__)


#: Prompt token ids, type and range checked in C (a 64k-token prompt is checked in well
#: under a millisecond; per-token Python checks cost several, counted by no timing model).
_PromptIds = list[Annotated[int, msgspec.Meta(ge=0, lt=VOCAB_SIZE)]]


class RunningRequest:
    """A prefilled request; iterate ``tokens()`` to decode it."""

    def __init__(self, engine: Engine, spec: GenerationSpec, seq: KVSequence, stats: PrefillStats) -> None:
        self._engine = engine
        self._seq = seq
        self._done = False
        self.spec = spec
        self.stats = stats
        self.output_token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.kv_transfer_params: dict[str, Any] | None = None
        """Set on a normal finish when the engine holds the blocks for a remote reader."""
        self.streams_params = engine.config.stream_kv_transfer_params
        """Whether a stream's last chunk carries `kv_transfer_params` (vLLM PR 40186)."""

    async def tokens(self) -> AsyncGenerator[tuple[int, bool], None]:
        """Yield ``(token, is_last)``; the request is finished before the last one."""
        engine, seq, spec = self._engine, self._seq, self.spec
        state = seq.first_state
        assert state is not None, "tokens() before the prefill"
        while True:
            token = kvmodel.sample(state, len(self.output_token_ids), ignore_eos=spec.ignore_eos)
            self.output_token_ids.append(token)
            seq.token_ids.append(token)
            engine.metrics.generation_tokens.inc()
            if token == EOS_TOKEN_ID and not spec.ignore_eos:
                reason: str | None = "stop"
            elif (
                len(self.output_token_ids) >= spec.max_tokens
                or len(seq.token_ids) >= engine.config.max_model_len
            ):
                reason = "length"
            else:
                reason = None
            if reason is not None:
                self._finish(reason)
                yield token, True
                return
            yield token, False
            state = await engine.decode_step(seq, state)

    def _finish(self, reason: str) -> None:
        self._done = True
        self.finish_reason = reason
        self.kv_transfer_params = self._engine.finish(self.spec, self._seq, reason)

    def abort(self) -> None:
        """Free the request's blocks unless it already finished; idempotent."""
        if self._done:
            return
        self._done = True
        self._engine.release(self._seq)


class Engine:
    """Block pool, prefill/decode and the NIXL-like holder of blocks."""

    def __init__(
        self,
        config: EmulatorConfig,
        *,
        emit: Callable[[Event], None] | None = None,
    ) -> None:
        self.config = config
        self.engine_id = config.engine_id or str(uuid.uuid4())
        self.none_hash = none_hash()
        self._hasher = BlockHasher(config.block_size, self.none_hash)
        self.pool = BlockPool(
            config.num_blocks,
            config.block_size,
            enable_caching=config.enable_prefix_caching,
            emit=emit,
        )
        self.metrics = EngineMetrics(
            config.model,
            self.engine_id,
            {
                "block_size": str(config.block_size),
                "num_gpu_blocks": str(config.num_blocks),
                "enable_prefix_caching": str(config.enable_prefix_caching),
            },
        )
        self.metrics.track_kv_cache_usage(self.pool.usage)
        self._gpu = asyncio.Lock()
        self.pulls = Puller(config, self.metrics)
        self._freed = asyncio.Event()
        self._holds = HeldBlockTable(
            self.engine_id, self._free, self.pool.blocks, self.metrics.kv_reads_unheld.inc, str(uuid.uuid4())
        )
        self._side_channel = SideChannelServer(
            self._holds, config.side_channel_host, config.side_channel_port
        )

    # --- lifecycle --------------------------------------------------------

    async def start(self) -> None:
        """Open the side channel."""
        await self._side_channel.start()
        log.info(
            "engine.started",
            engine_id=self.engine_id,
            side_channel_port=self.side_channel_port,
        )

    async def close(self) -> None:
        """Deliver pending notifies, close the side channel and drop hold timers."""
        await self.pulls.close()
        await self._side_channel.close()
        self._holds.close()

    @property
    def side_channel_port(self) -> int:
        """Port of the side channel, reported as ``remote_port``."""
        return self._side_channel.port

    # --- prefill ----------------------------------------------------------

    async def submit(self, spec: GenerationSpec) -> RunningRequest:
        """Prefill a request; raises EngineError subclasses on bad input or failed loads."""
        prompt = self.validate(spec)
        bs = self.config.block_size
        seq = KVSequence(token_ids=prompt, block_size=bs, session_id=spec.session_id)
        stats = PrefillStats(prompt_tokens=len(prompt))
        try:
            if self.pool.enable_caching:
                hashes = self._hasher.hash_prompt(prompt, spec.cache_salt)
                hits = self.pool.find_cached_prefix(hashes[: (len(prompt) - 1) // bs])
                self.pool.touch(hits)
                seq.blocks, seq.hashes, seq.prompt_hashes = hits, hashes[: len(hits)], hashes
                seq.num_computed = stats.local_cached_tokens = len(hits) * bs
                self.metrics.prefix_cache_queries.inc(len(prompt))
                self.metrics.prefix_cache_hits.inc(seq.num_computed)
            plan = self.pulls.plan(spec, len(prompt), stats.local_cached_tokens)
            seq.blocks += await self._allocate(math.ceil(len(prompt) / bs) - len(seq.blocks))
            await self.pulls.apply(plan, seq, stats)
            await self._compute_prompt(seq, stats)
        except BaseException:
            self.release(seq)
            raise
        self.metrics.prompt_tokens.inc(len(prompt))
        self.metrics.prompt_sources(len(prompt), stats.local_cached_tokens, stats.pulled_tokens)
        log.debug("engine.prefill.done", request_id=spec.request_id, **vars(stats))
        return RunningRequest(self, spec, seq, stats)

    def validate(self, spec: GenerationSpec) -> list[int]:
        """The prompt (a copy) after checking it and the request's limits (InvalidRequest)."""
        if not spec.prompt_token_ids:
            raise InvalidRequest("The prompt must contain at least one token.")
        try:
            prompt = msgspec.convert(spec.prompt_token_ids, _PromptIds)
        except msgspec.ValidationError:
            raise InvalidRequest("The prompt contains token ids outside the vocabulary.") from None
        if spec.max_tokens < 1:
            raise InvalidRequest("max_tokens must be at least 1.")
        if len(prompt) + spec.max_tokens > self.config.max_model_len:
            raise InvalidRequest(
                f"This model's maximum context length is {self.config.max_model_len} "
                f"tokens. However, you requested {len(prompt) + spec.max_tokens} tokens "
                f"({len(prompt)} in the messages, {spec.max_tokens} in the completion)."
            )
        if math.ceil(len(prompt) / self.config.block_size) > self.pool.num_blocks:
            raise InvalidRequest("The prompt needs more KV blocks than the engine has.")
        return prompt

    async def _compute_prompt(self, seq: KVSequence, stats: PrefillStats) -> None:
        prompt_len = len(seq.token_ids)
        start = min(stats.local_cached_tokens + stats.pulled_tokens, prompt_len - 1)
        self.metrics.num_requests_waiting.inc()
        try:
            await self._gpu.acquire()
        finally:
            self.metrics.num_requests_waiting.dec()
        try:
            # Computing the KV and reading the context for the first token is the emulated
            # prefill (its forward pass): that work runs within the step's modeled time.
            async with modeled(self.config.prefill_ms_per_token * (prompt_len - start)):
                seq.write_prompt_kv(start, prompt_len)
                seq.num_computed = prompt_len
                seq.first_state = seq.context_state()
            stats.computed_tokens = prompt_len - start
        finally:
            self._gpu.release()
        self._commit_full_blocks(seq)

    def _commit_full_blocks(self, seq: KVSequence) -> None:
        if not self.pool.enable_caching:
            return
        bs = self.config.block_size
        done, full = len(seq.hashes), seq.num_computed // bs
        if full <= done:
            return
        parent = seq.hashes[-1] if seq.hashes else None
        tokens = seq.token_ids[done * bs : full * bs]
        new = seq.prompt_hashes[done:full]  # hashed at admission: never hash tokens twice
        if len(new) < full - done:
            last = new[-1] if new else parent
            new += self._hasher.hash_blocks(tokens[len(new) * bs :], parent=last)
        self.pool.cache_blocks(
            seq.blocks[done:full],
            new,
            [tokens[i * bs : (i + 1) * bs] for i in range(full - done)],
            parent=parent,
            session_id=seq.session_id,
        )
        seq.hashes.extend(new)

    # --- decode -----------------------------------------------------------

    async def decode_step(self, seq: KVSequence, state: bytes) -> bytes:
        """Feed the last sampled token back: its KV joins the context."""
        await asyncio.sleep(self.config.decode_ms_per_token / 1000)
        position = seq.num_computed
        if position // self.config.block_size >= len(seq.blocks):
            seq.blocks += await self._allocate(1)
        kv = seq.write_kv(position)
        seq.num_computed += 1
        self._commit_full_blocks(seq)
        return kvmodel.advance_state(state, kv)

    async def _allocate(self, count: int) -> list[Block]:
        if count <= 0:
            return []
        if count > self.pool.num_blocks:
            raise InvalidRequest("The request needs more KV blocks than the engine has.")
        try:
            async with asyncio.timeout(self.config.block_wait_timeout):
                while self.pool.num_free < count:
                    self._freed.clear()
                    await self._freed.wait()
        except TimeoutError as exc:
            raise CapacityExceeded("No free KV blocks; try again later.") from exc
        return self.pool.allocate(count)

    # --- finish, holds and the side channel ---------------------------------

    def finish(self, spec: GenerationSpec, seq: KVSequence, reason: str) -> dict[str, Any] | None:
        """End a request normally; hold its blocks and describe them when asked to."""
        self.metrics.request_finished(reason)
        params = spec.kv_transfer_params or {}
        if params.get("do_remote_decode"):  # a prefill node's request, for D to pull
            if reason in ("length", "stop"):
                return self._hold(spec.request_id, seq, self.config.kv_abort_timeout, True)
        elif params and self.config.bidirectional_kv_xfer:
            # vLLM's connector: any request with params and no do_remote_decode is a
            # decode-side one, whose blocks it pins at the finish. It tracks their expiry
            # (and P's notification) only for one that came with a prefill's params: the
            # others' blocks are never freed there. Here they expire, and count as a fault.
            if not params.get("do_remote_prefill"):
                self.metrics.connector_faults.inc()
                log.error("engine.connector_fault", reason="untracked_hold", request_id=spec.request_id)
            return self._hold(spec.request_id, seq, self.config.decoder_kv_blocks_ttl, False)
        self.release(seq)
        return None

    def _hold(self, request_id: str, seq: KVSequence, ttl: float, for_decoder: bool) -> dict[str, Any]:
        blocks, seq.blocks = seq.blocks, []
        expiry = self._holds.hold(request_id, blocks, ttl)
        self.metrics.held_requests.set(len(self._holds))
        held = HeldBlocks(
            engine_id=self.engine_id,
            request_id=request_id,
            host=self.config.side_channel_host,
            port=self.side_channel_port,
            block_ids=[block.block_id for block in blocks],
            num_tokens=seq.num_computed,
            expiry_time=expiry,
            registration_generation=REGISTRATION_GENERATION,
            tp_size=self.config.tp_size,
        )
        return describe_held_blocks(held, for_decoder=for_decoder)

    def release(self, seq: KVSequence) -> None:
        """Drop a sequence's block references (not held ones)."""
        blocks, seq.blocks = seq.blocks, []
        self._free(blocks)

    def _free(self, blocks: list[Block]) -> None:
        self.pool.free(blocks)
        self.metrics.held_requests.set(len(self._holds))
        self._freed.set()

    def reset_prefix_cache(self) -> bool:
        """Forget all cached blocks; refused while blocks are in use."""
        return self.pool.reset_prefix_cache()

    def snapshot(self) -> dict[str, Any]:
        """Emulator-only state for tests and demos."""
        return {
            "engine_id": self.engine_id,
            "role": self.config.role,
            "model": self.config.model,
            "block_size": self.config.block_size,
            "num_blocks": self.pool.num_blocks,
            "free_blocks": self.pool.num_free,
            "cached_blocks": self.pool.num_cached,
            "side_channel_port": self.side_channel_port,
            "held_requests": self._holds.snapshot(),
            "unheld_reads": self._holds.unheld_reads,
        }
