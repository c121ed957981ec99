"""The emulated engine: prefill with prefix caching and remote pulls, decode, holds.

One engine per process start (a generation, with a fresh agent name, and a fresh
``engine_id`` unless one is configured, as vLLM's ``kv_transfer_config.engine_id``). It
owns the block pool and the side channel through which other engines read the
blocks it holds for them. Prefill work is serialized through one lock, the
"GPU", so concurrent requests queue; remote pulls and decode steps are not
(NIXL reads run beside the compute, decode steps are batched on a real engine).

Lifecycle of a request: ``submit`` prefills (local cache hit, remote pull per
``kv_transfer_params``, compute the rest) and returns a ``RunningRequest`` whose
``tokens()`` yields generated tokens. A normal finish (stop or length) may hold
the blocks for a remote reader and produce the ``kv_transfer_params`` that say
so; an abort never does.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec
import structlog

from emulator import kvmodel
from emulator.blocks import Block, BlockPool
from emulator.config import EmulatorConfig
from emulator.errors import CapacityExceeded, InvalidRequest, KVLoadFailed
from emulator.hashing import BlockHasher
from emulator.holds import REGISTRATION_GENERATION, HeldBlockTable
from emulator.kvevents import Event
from emulator.metrics import EngineMetrics
from emulator.sidechannel import (
    Notify,
    ReadBlocks,
    RemoteAgents,
    SideChannelServer,
    TransferError,
    notify_remote,
    read_remote_blocks,
)
from emulator.tokenizer import EOS_TOKEN_ID, VOCAB_SIZE
from emulator.transfer import (
    TOO_FEW_REMOTE_BLOCKS,
    HeldBlocks,
    PullAction,
    PullDirection,
    PullPlan,
    describe_held_blocks,
    parse_remote,
    plan_pull,
    too_close_to_expiry,
)
from kvferry.blockhash import none_hash

log = structlog.get_logger(__name__)


#: Prompt token ids, type and range checked in C (a 64k-token prompt is checked in well
#: under a millisecond; per-token Python checks cost several, counted by no timing model).
_PromptIds = list[Annotated[int, msgspec.Meta(ge=0, lt=VOCAB_SIZE)]]


@contextlib.asynccontextmanager
async def _modeled(ms: float) -> AsyncIterator[None]:
    """A step of the timing model: lasts ``ms`` milliseconds, timed from entry, and at least
    as long as the body (the emulator's own work for the step, which thus costs nothing
    extra while it fits in the modeled time). An exception ends it at once."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    timer = loop.call_later(ms / 1000, done.set_result, None)
    try:
        yield
        await done
    finally:
        timer.cancel()
        done.cancel()


@dataclass(frozen=True)
class GenerationSpec:
    """One request as the engine sees it, after templating and validation."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    ignore_eos: bool = False
    kv_transfer_params: Mapping[str, Any] | None = None
    session_id: str | None = None
    cache_salt: str | None = None
    """The request's own prefix cache (vLLM's cache_salt): it hits only blocks of its salt."""


@dataclass
class PrefillStats:
    """Where the prompt's KV came from."""

    prompt_tokens: int
    local_cached_tokens: int = 0
    pulled_tokens: int = 0
    pulled_blocks: int = 0
    computed_tokens: int = 0
    pull: str = "none"
    """``none``, ``pulled``, ``skipped:<reason>``, ``failed:<reason>`` or ``recomputed:<reason>``."""


@dataclass(eq=False)
class _Sequence:
    token_ids: list[int]
    blocks: list[Block] = field(default_factory=list)
    num_computed: int = 0
    hashes: list[bytes] = field(default_factory=list)
    """Hashes of the blocks entered into the prefix cache (committed)."""
    prompt_hashes: list[bytes] = field(default_factory=list)
    """Hashes of the prompt's full blocks, computed once at admission and reused at commit."""
    session_id: str | None = None
    first_state: bytes | None = None
    """Sampler state for the first token, set by the prefill."""


class RunningRequest:
    """A prefilled request; iterate ``tokens()`` to decode it."""

    def __init__(self, engine: Engine, spec: GenerationSpec, seq: _Sequence, stats: PrefillStats) -> None:
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
        self._notifies: set[asyncio.Task[None]] = set()
        self._freed = asyncio.Event()
        self._holds = HeldBlockTable(
            self.engine_id, self._free, self.pool.blocks, self.metrics.kv_reads_unheld.inc, str(uuid.uuid4())
        )
        self._agents = RemoteAgents()  # the handshakes with the engines it pulls from
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
        if self._notifies:
            await asyncio.gather(*self._notifies, return_exceptions=True)
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
        seq = _Sequence(token_ids=prompt, session_id=spec.session_id)
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
            plan = self._plan(spec, len(prompt), stats.local_cached_tokens)
            seq.blocks += await self._allocate(math.ceil(len(prompt) / bs) - len(seq.blocks))
            await self._apply_plan(plan, seq, stats)
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

    def _plan(self, spec: GenerationSpec, prompt_len: int, cached: int) -> PullPlan:
        params = spec.kv_transfer_params
        try:
            if params and params.get("do_remote_prefill"):
                source = parse_remote(params, PullDirection.FROM_PREFILLER)
                threshold = 0
            elif params and params.get("do_remote_decode"):
                if not self.config.bidirectional_kv_xfer:
                    return PullPlan(PullAction.SKIP, "bidirectional_disabled")
                source = parse_remote(params, PullDirection.FROM_DECODER)
                threshold = self.config.kv_recompute_threshold
            else:
                return PullPlan(PullAction.SKIP, "no_remote_blocks")
        except (ValueError, TypeError) as exc:
            raise InvalidRequest(f"Invalid kv_transfer_params: {exc}") from exc
        return plan_pull(
            source,
            prompt_len=prompt_len,
            cached_tokens=cached,
            block_size=self.config.block_size,
            threshold=threshold,
        )

    async def _apply_plan(self, plan: PullPlan, seq: _Sequence, stats: PrefillStats) -> None:
        failure = plan.reason if plan.action is PullAction.FAIL else None
        source = plan.source
        if failure == TOO_FEW_REMOTE_BLOCKS:  # vLLM: an assert in the worker; the engine dies
            self.metrics.connector_faults.inc()
            log.error("engine.connector_fault", reason=failure, remote=source.request_id if source else None)
        if plan.action is PullAction.PULL and source and too_close_to_expiry(source, time.perf_counter()):
            failure = "expiry_too_close"  # (checked at the read, as vLLM's worker does)
        elif plan.action is PullAction.PULL:
            try:
                await self._pull(plan, seq)
            except TransferError as exc:
                failure = "transfer_error"
                log.warning("engine.kv_pull.failed", error=str(exc))
            else:
                stats.pulled_tokens = plan.num_tokens
                stats.pulled_blocks = len(plan.remote_block_ids)
                stats.pull = "pulled"
                self.metrics.kv_pulled_blocks.inc(stats.pulled_blocks)
                self.metrics.kv_pulled_tokens.inc(stats.pulled_tokens)
        if plan.notify and failure is None:
            # (vLLM's notification rides on the read itself, or goes alone when there is
            # nothing to read: a failed read, or one declined as too close to D's expiry,
            # tells D nothing, and D holds the blocks to its TTL)
            self._notify_later(plan)
        if plan.action is PullAction.SKIP and plan.source is not None:
            stats.pull = f"skipped:{plan.reason}"
        if failure is not None:
            stats.pull = f"failed:{failure}"
            self.metrics.kv_pull(stats.pull)
            if self.config.kv_load_failure_policy == "fail":
                raise KVLoadFailed(f"KV load failed ({failure}) for remote request")
            stats.pull = f"recomputed:{failure}"
        elif stats.pull != "none":
            self.metrics.kv_pull(stats.pull)

    async def _pull(self, plan: PullPlan, seq: _Sequence) -> None:
        source = plan.source
        assert source is not None
        first = plan.first_local_block
        local = seq.blocks[first : first + len(plan.remote_block_ids)]
        # The read and the copy are the emulated transfer: they run within its modeled time.
        async with _modeled(self.config.transfer_ms_per_block * len(local)):
            agent = ""
            try:
                async with asyncio.timeout(self.config.side_channel_timeout):
                    agent = await self._agents.agent(source.host, source.port, source.engine_id)
                    request = ReadBlocks(
                        engine_id=source.engine_id,
                        request_id=source.request_id,
                        block_ids=list(plan.remote_block_ids),
                        registration_generation=source.registration_generation,
                        agent=agent,
                    )
                    data = await read_remote_blocks(source.host, source.port, request)
            except TimeoutError as exc:
                self._agents.failed(source.engine_id, agent)
                raise TransferError(f"read from {source.host}:{source.port} timed out") from exc
            except TransferError:
                self._agents.failed(source.engine_id, agent)
                raise
            size = self.config.block_size * kvmodel.SLOT_BYTES
            if len(data) != size * len(local):
                raise TransferError("remote block size differs from the local one")
            view = memoryview(data)
            for block, start in zip(local, range(0, len(data), size), strict=True):
                block.kv[:] = view[start : start + size]

    def kv_transfer_rejected(self, params: Mapping[str, Any] | None) -> None:
        """A request refused before admission came with these params: if they are a
        prefill's (``do_remote_prefill``), tell their holder it may free the blocks, as
        vLLM's serving layer does (PR 41269: an empty receive, notify only). Nothing was
        allocated here, so nothing is kept."""
        if not params or not params.get("do_remote_prefill"):
            return
        try:
            source = parse_remote(params, PullDirection.FROM_PREFILLER)
        except (ValueError, TypeError):
            source = None
        if source is None:  # vLLM's scheduler reads these keys unchecked: its engine dies
            self.metrics.connector_faults.inc()
            log.error("engine.connector_fault", reason="rejected_request_without_remote_blocks")
            return
        self._notify_later(PullPlan(PullAction.SKIP, "rejected_before_admission", source))

    def _notify_later(self, plan: PullPlan) -> None:
        """Send the notify beside the request, as NIXL does: the holder learns it may free
        the blocks once the pull is over (or was decided against), but the request does
        not wait for it. Always sent; ``close`` waits for those still on their way."""
        task = asyncio.get_running_loop().create_task(self._notify(plan))
        self._notifies.add(task)
        task.add_done_callback(self._notifies.discard)

    async def _notify(self, plan: PullPlan) -> None:
        source = plan.source
        assert source is not None
        agent = ""
        try:
            async with asyncio.timeout(self.config.side_channel_timeout):
                agent = await self._agents.agent(source.host, source.port, source.engine_id)
                notify = Notify(engine_id=source.engine_id, request_id=source.request_id, agent=agent)
                await notify_remote(source.host, source.port, notify)
        except (TransferError, TimeoutError) as exc:
            self._agents.failed(source.engine_id, agent)
            log.info("engine.kv_notify.failed", error=str(exc), reason=plan.reason)

    async def _compute_prompt(self, seq: _Sequence, stats: PrefillStats) -> None:
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
            async with _modeled(self.config.prefill_ms_per_token * (prompt_len - start)):
                self._write_prompt_kv(seq, start, prompt_len)
                seq.num_computed = prompt_len
                seq.first_state = self.prefill_state(seq)
            stats.computed_tokens = prompt_len - start
        finally:
            self._gpu.release()
        self._commit_full_blocks(seq)

    # --- KV slots ---------------------------------------------------------

    def _slot(self, seq: _Sequence, position: int) -> bytes:
        if position < 0:
            return kvmodel.GENESIS_KV
        block, offset = divmod(position, self.config.block_size)
        start = offset * kvmodel.SLOT_BYTES
        return bytes(seq.blocks[block].kv[start : start + kvmodel.SLOT_BYTES])

    def _write_kv(self, seq: _Sequence, position: int) -> bytes:
        kv = kvmodel.token_kv(self._slot(seq, position - 1), position, seq.token_ids[position])
        block, offset = divmod(position, self.config.block_size)
        start = offset * kvmodel.SLOT_BYTES
        seq.blocks[block].kv[start : start + kvmodel.SLOT_BYTES] = kv
        return kv

    def _write_prompt_kv(self, seq: _Sequence, start: int, stop: int) -> None:
        """Compute the KV of positions ``start .. stop - 1`` and write it block by block."""
        kv = kvmodel.chain_kv(self._slot(seq, start - 1), start, seq.token_ids[start:stop])
        view = memoryview(kv)
        bs, slot_bytes = self.config.block_size, kvmodel.SLOT_BYTES
        position = start
        while position < stop:
            block, offset = divmod(position, bs)
            count = min(bs - offset, stop - position)
            done = (position - start) * slot_bytes
            seq.blocks[block].kv[offset * slot_bytes : (offset + count) * slot_bytes] = view[
                done : done + count * slot_bytes
            ]
            position += count

    def prefill_state(self, seq: _Sequence) -> bytes:
        """Sampler state over every KV slot of the prefilled context."""
        full, rest = divmod(seq.num_computed, self.config.block_size)
        slots: list[bytearray | memoryview] = [block.kv for block in seq.blocks[:full]]
        if rest:
            slots.append(memoryview(seq.blocks[full].kv)[: rest * kvmodel.SLOT_BYTES])
        return kvmodel.context_state(slots)

    def _commit_full_blocks(self, seq: _Sequence) -> None:
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

    async def decode_step(self, seq: _Sequence, state: bytes) -> bytes:
        """Feed the last sampled token back: its KV joins the context."""
        await asyncio.sleep(self.config.decode_ms_per_token / 1000)
        position = seq.num_computed
        if position // self.config.block_size >= len(seq.blocks):
            seq.blocks += await self._allocate(1)
        kv = self._write_kv(seq, position)
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

    def finish(self, spec: GenerationSpec, seq: _Sequence, reason: str) -> dict[str, Any] | None:
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

    def _hold(self, request_id: str, seq: _Sequence, ttl: float, for_decoder: bool) -> dict[str, Any]:
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

    def release(self, seq: _Sequence) -> None:
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
