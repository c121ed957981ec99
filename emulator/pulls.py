"""The pulling side of the emulated NIXL connector: a request's remote KV.

A request's ``kv_transfer_params`` name blocks another engine holds (a prefiller's for a
decoder, or a decoder's previous turn for a prefiller, bidirectional). ``Puller`` plans
the pull (``transfer.plan_pull`` decides), reads the blocks over the holder's side
channel into the request's own blocks within the modeled transfer time, and notifies the
holder that it may free them, beside the request as NIXL does. A request refused before
admission with a prefill's params only notifies (vLLM PR 41269).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

import structlog

from emulator import kvmodel
from emulator.config import EmulatorConfig
from emulator.errors import InvalidRequest, KVLoadFailed
from emulator.metrics import EngineMetrics
from emulator.sequence import GenerationSpec, KVSequence, PrefillStats
from emulator.sidechannel import (
    Notify,
    ReadBlocks,
    RemoteAgents,
    TransferError,
    notify_remote,
    read_remote_blocks,
)
from emulator.timing import modeled
from emulator.transfer import (
    TOO_FEW_REMOTE_BLOCKS,
    PullAction,
    PullDirection,
    PullPlan,
    parse_remote,
    plan_pull,
    too_close_to_expiry,
)

log = structlog.get_logger(__name__)


class Puller:
    """One engine's pulls of remote KV and its notifies to the holders."""

    def __init__(self, config: EmulatorConfig, metrics: EngineMetrics) -> None:
        self._config = config
        self._metrics = metrics
        self._agents = RemoteAgents()  # the handshakes with the engines it pulls from
        self._notifies: set[asyncio.Task[None]] = set()

    async def close(self) -> None:
        """Wait for the notifies still on their way."""
        if self._notifies:
            await asyncio.gather(*self._notifies, return_exceptions=True)

    def plan(self, spec: GenerationSpec, prompt_len: int, cached: int) -> PullPlan:
        """What to pull for a request whose first ``cached`` tokens hit the prefix cache."""
        params = spec.kv_transfer_params
        try:
            if params and params.get("do_remote_prefill"):
                source = parse_remote(params, PullDirection.FROM_PREFILLER)
                threshold = 0
            elif params and params.get("do_remote_decode"):
                if not self._config.bidirectional_kv_xfer:
                    return PullPlan(PullAction.SKIP, "bidirectional_disabled")
                source = parse_remote(params, PullDirection.FROM_DECODER)
                threshold = self._config.kv_recompute_threshold
            else:
                return PullPlan(PullAction.SKIP, "no_remote_blocks")
        except (ValueError, TypeError) as exc:
            raise InvalidRequest(f"Invalid kv_transfer_params: {exc}") from exc
        return plan_pull(
            source,
            prompt_len=prompt_len,
            cached_tokens=cached,
            block_size=self._config.block_size,
            threshold=threshold,
        )

    async def apply(self, plan: PullPlan, seq: KVSequence, stats: PrefillStats) -> None:
        """Carry out ``plan`` into ``seq``'s blocks and count it in ``stats``; a failed pull
        raises KVLoadFailed under the "fail" policy, else leaves the tokens to compute."""
        failure = plan.reason if plan.action is PullAction.FAIL else None
        source = plan.source
        if failure == TOO_FEW_REMOTE_BLOCKS:  # vLLM: an assert in the worker; the engine dies
            self._metrics.connector_faults.inc()
            log.error("engine.connector_fault", reason=failure, remote=source.request_id if source else None)
        if plan.action is PullAction.PULL and source and too_close_to_expiry(source, time.perf_counter()):
            failure = "expiry_too_close"  # (checked at the read, as vLLM's worker does)
        elif plan.action is PullAction.PULL:
            try:
                await self._read(plan, seq)
            except TransferError as exc:
                failure = "transfer_error"
                log.warning("engine.kv_pull.failed", error=str(exc))
            else:
                stats.pulled_tokens = plan.num_tokens
                stats.pulled_blocks = len(plan.remote_block_ids)
                stats.pull = "pulled"
                self._metrics.kv_pulled_blocks.inc(stats.pulled_blocks)
                self._metrics.kv_pulled_tokens.inc(stats.pulled_tokens)
        if plan.notify and failure is None:
            # (vLLM's notification rides on the read itself, or goes alone when there is
            # nothing to read: a failed read, or one declined as too close to D's expiry,
            # tells D nothing, and D holds the blocks to its TTL)
            self._notify_later(plan)
        if plan.action is PullAction.SKIP and plan.source is not None:
            stats.pull = f"skipped:{plan.reason}"
        if failure is not None:
            stats.pull = f"failed:{failure}"
            self._metrics.kv_pull(stats.pull)
            if self._config.kv_load_failure_policy == "fail":
                raise KVLoadFailed(f"KV load failed ({failure}) for remote request")
            stats.pull = f"recomputed:{failure}"
        elif stats.pull != "none":
            self._metrics.kv_pull(stats.pull)

    async def _read(self, plan: PullPlan, seq: KVSequence) -> None:
        source = plan.source
        assert source is not None
        first = plan.first_local_block
        local = seq.blocks[first : first + len(plan.remote_block_ids)]
        # The read and the copy are the emulated transfer: they run within its modeled time.
        async with modeled(self._config.transfer_ms_per_block * len(local)):
            agent = ""
            try:
                async with asyncio.timeout(self._config.side_channel_timeout):
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
            size = self._config.block_size * kvmodel.SLOT_BYTES
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
            self._metrics.connector_faults.inc()
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
            async with asyncio.timeout(self._config.side_channel_timeout):
                agent = await self._agents.agent(source.host, source.port, source.engine_id)
                notify = Notify(engine_id=source.engine_id, request_id=source.request_id, agent=agent)
                await notify_remote(source.host, source.port, notify)
        except (TransferError, TimeoutError) as exc:
            self._agents.failed(source.engine_id, agent)
            log.info("engine.kv_notify.failed", error=str(exc), reason=plan.reason)
