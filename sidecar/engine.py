"""The engine process the sidecar fronts: its identity across restarts, its health, its facts.

An *epoch* is one engine process as far as the sidecar can tell. A new epoch
starts when a probe finds another process identity (or, for an engine showing
none, answers again after failing), when the KV-event seq goes backwards, or
when D's params name a ``remote_engine_id`` not seen in this epoch. The node then
registers with generation 0 (the daemon assigns the next generation, so the old
process's retentions are dead), the KV mirror is dropped and the daemon told to
drop its index, and queued registrations of the old epoch are discarded. Signals
of one restart that arrive one after another cost at most an extra generation.

Between "the process is in doubt" and "its identity is confirmed" the engine is
*suspended* (`up` clear): no Attach stream, so the daemon suspends the node and
hands none of its retentions out, without voiding them (see identity.py for the
states and the fencing argument).

`IdentityTracker` decides on probe results; `EngineInstance` holds the state and
tells listeners; `watch_health` and `learn_facts` do the HTTP.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
import structlog

from sidecar.identity import Answer, Identity, IdentityTracker, Step, identity_of
from sidecar.metrics import SidecarMetrics
from sidecar.settings import EngineSettings

log = structlog.get_logger(__name__)

DEFAULT_BLOCK_SIZE = 16
_DP_SUFFIX = re.compile(r"_dp\d+$")
_CACHE_INFO_BLOCK_SIZE = re.compile(r'^vllm:cache_config_info\{[^}]*\bblock_size="(\d+)"', re.MULTILINE)
_CACHE_INFO_BLOCKS = re.compile(r'^vllm:cache_config_info\{[^}]*\bnum_gpu_blocks="(\d+)"', re.MULTILINE)
_KV_USAGE = re.compile(r"^vllm:kv_cache_usage_perc(?:\{[^}]*\})? ([0-9.eE+-]+|NaN)$", re.MULTILINE)


@dataclass(frozen=True)
class PoolFacts:
    """The engine's KV pool as its /metrics shows it."""

    blocks: int
    """Blocks in all (vllm:cache_config_info's num_gpu_blocks)."""
    usage: float
    """The share in use, 0..1 (vllm:kv_cache_usage_perc; with several engines, the largest)."""


def pool_of(metrics_text: str) -> PoolFacts | None:
    """The pool facts in an engine's /metrics text (None: it shows no pool size)."""
    blocks = _CACHE_INFO_BLOCKS.search(metrics_text)
    if blocks is None or not int(blocks.group(1)):
        return None
    usages = [float(u) for u in _KV_USAGE.findall(metrics_text)]
    usage = max((u for u in usages if 0.0 <= u <= 1.0), default=0.0)
    return PoolFacts(int(blocks.group(1)), usage)


def normalize_engine_id(engine_id: str) -> str:
    """vLLM's engine id without the per-DP-rank suffix (one sidecar may see several ranks)."""
    return _DP_SUFFIX.sub("", engine_id)


@dataclass(frozen=True)
class EngineFacts:
    """What the node registers with: the base model and the KV block size."""

    model: str
    block_size: int
    identity: Identity | None = None
    """The process the facts were read from (None = it shows none)."""

    @property
    def started_at(self) -> float:
        """When the engine process started, as far as it shows (0 = unknown): the daemon
        keeps the generation of a process it knows (a sidecar restart)."""
        return self.identity.value if self.identity else 0.0


class EngineInstance:
    """Which engine process is current, whether it is vouched for, and its generation."""

    def __init__(self, metrics: SidecarMetrics, failures_to_down: int = 1) -> None:
        self._metrics = metrics
        self.tracker = IdentityTracker(failures_to_down)
        self.epoch = 0
        self.generation: int | None = None
        """The daemon's generation for the current epoch (None until registered)."""
        self.facts: EngineFacts | None = None
        self.pool: PoolFacts | None = None
        """The engine's KV pool as the last probe read it (None: unknown)."""
        self.up = asyncio.Event()
        """Set while the engine answers and its process identity is confirmed."""
        self.registered = asyncio.Event()
        """Set while `generation` is known for the current epoch."""
        self.probe_now = asyncio.Event()
        """Set to have the engine probed at once (a signal put its process in doubt)."""
        self._engine_ids: set[str] = set()
        self._listeners: list[Callable[[], None]] = []
        self._watchers: list[Callable[[], None]] = []

    def on_restart(self, listener: Callable[[], None]) -> None:
        """Call `listener` (synchronously) whenever a new epoch starts."""
        self._listeners.append(listener)

    def watch(self, watcher: Callable[[], None]) -> None:
        """Call `watcher` (synchronously) on every restart and every up/down change."""
        self._watchers.append(watcher)

    def set_up(self, up: bool) -> None:
        """The engine is vouched for (or no longer)."""
        if up:
            self.up.set()
        else:
            self.up.clear()
        self._metrics.engine_up.set(1 if up else 0)
        self._notify()

    def observe(self, answer: Answer, identity: Identity | None) -> Step:
        """Apply one probe's result."""
        step = self.tracker.observe(answer, identity)
        if step is Step.RESTART:
            self._new_epoch("identity" if identity is not None else "health")
        if step in (Step.UP, Step.RESUME, Step.RESTART):
            self.set_up(True)
            log.info("engine.up", step=step.value, epoch=self.epoch, identity=identity)
        elif step is Step.SUSPEND:
            self._suspended(answer.value)
        return step

    def suspend(self, signal: str) -> None:
        """A signal puts the engine process in doubt: suspended until a probe confirms it."""
        self.probe_now.set()
        if self.tracker.suspend():
            self._suspended(signal)

    def _suspended(self, signal: str) -> None:
        self._metrics.engine_suspensions.labels(signal).inc()
        log.warning("engine.suspended", signal=signal, epoch=self.epoch, failures=self.tracker.failures)
        self.set_up(False)

    def restart(self, signal: str) -> None:
        """A new engine process (a signal other than a probe said so): new epoch, suspended
        until a probe reads the new process's identity."""
        self.tracker.forget()
        self._new_epoch(signal)
        self.probe_now.set()
        self.set_up(False)

    def _new_epoch(self, signal: str) -> None:
        self.epoch += 1
        self.generation = None
        self.facts = None
        self.registered.clear()
        self._engine_ids.clear()
        self._metrics.engine_restarts.labels(signal).inc()
        log.warning("engine.restart.detected", signal=signal, epoch=self.epoch)
        for listener in self._listeners:
            listener()
        self._notify()

    def observe_engine_id(self, engine_id: object) -> int:
        """Note the engine id in D's params; -> the epoch the params belong to."""
        if isinstance(engine_id, str) and engine_id:
            normalized = normalize_engine_id(engine_id)
            if self._engine_ids and normalized not in self._engine_ids:
                self.restart("engine_id")
            self._engine_ids.add(normalized)
        return self.epoch

    def set_generation(self, epoch: int, generation: int) -> None:
        """The node is registered at `generation` for `epoch` (ignored if the epoch moved on)."""
        if epoch == self.epoch:
            self.generation = generation
            self.registered.set()
            self._notify()

    def _notify(self) -> None:
        for watcher in self._watchers:
            watcher()

    def read_pool(self, metrics_text: str) -> None:
        """Keep the pool facts of a probe's /metrics (heartbeats carry them to the daemon)."""
        self.pool = pool_of(metrics_text)

    def unregistered(self) -> None:
        """The daemon no longer knows the current generation (refused): wait for re-registration."""
        self.registered.clear()
        self._notify()


async def probe(
    session: aiohttp.ClientSession,
    url: str,
    timeout_s: float,
    on_metrics: Callable[[str], None] | None = None,
) -> tuple[Answer, Identity | None]:
    """Whether the engine's /health answers 200, and (then) the identity on its /metrics
    (whose text `on_metrics` is also given)."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with session.get(url + "/health", timeout=timeout) as r:
            if r.status != 200:
                return Answer.FAILED, None
        async with session.get(url + "/metrics", timeout=timeout) as r:
            if r.status != 200:
                return Answer.OK, None
            text = await r.text()
            if on_metrics is not None:
                on_metrics(text)
            return Answer.OK, identity_of(text)
    except aiohttp.ClientConnectorError as e:
        refused = isinstance(e.os_error, ConnectionRefusedError)
        return (Answer.REFUSED if refused else Answer.FAILED), None
    except (aiohttp.ClientError, TimeoutError, OSError):
        return Answer.FAILED, None


async def watch_health(
    session: aiohttp.ClientSession, settings: EngineSettings, instance: EngineInstance
) -> None:
    """Probe the engine forever (every `health_interval_s`, at once when asked) and apply
    what each probe found to `instance`."""
    while True:
        instance.probe_now.clear()
        answer, identity = await probe(session, settings.url, settings.health_timeout_s, instance.read_pool)
        instance.observe(answer, identity)
        try:
            async with asyncio.timeout(settings.health_interval_s):
                await instance.probe_now.wait()
        except TimeoutError:
            pass


def block_size_of(metrics_text: str) -> int | None:
    """Block size from vLLM's ``vllm:cache_config_info`` gauge, if exposed."""
    m = _CACHE_INFO_BLOCK_SIZE.search(metrics_text)
    return int(m.group(1)) if m else None


async def learn_facts(session: aiohttp.ClientSession, settings: EngineSettings) -> EngineFacts:
    """Model and block size (configured, else asked of the engine) and the engine process's
    identity; raises aiohttp errors."""
    timeout = aiohttp.ClientTimeout(total=settings.health_timeout_s)
    model = settings.model
    if not model:
        headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else None
        async with session.get(settings.url + "/v1/models", timeout=timeout, headers=headers) as r:
            r.raise_for_status()
            body = await r.json(content_type=None)
        data = body.get("data") if isinstance(body, dict) else None
        if not data or not isinstance(data[0], dict) or not isinstance(data[0].get("id"), str):
            raise aiohttp.ClientPayloadError("/v1/models lists no model")
        model = data[0]["id"]
    block_size = settings.block_size
    try:
        async with session.get(settings.url + "/metrics", timeout=timeout) as r:
            text = await r.text() if r.status == 200 else ""
            if r.status != 200 and not block_size:
                raise aiohttp.ClientPayloadError(f"/metrics answered {r.status}: the block size is unknown")
    except (aiohttp.ClientError, TimeoutError):
        # Without its block size the node would register with a guess: every retention
        # refused by the daemon (too few block ids), or P handed too few. Learned again.
        if not block_size:
            raise
        text = ""
    if not block_size:
        learned = block_size_of(text)
        if learned is None:
            log.warning("engine.block_size.unknown", assumed=DEFAULT_BLOCK_SIZE)
        block_size = learned or DEFAULT_BLOCK_SIZE
    return EngineFacts(model, block_size, identity_of(text))
