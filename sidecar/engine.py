"""The engine process the sidecar fronts: its identity across restarts, its health, its facts.

An *epoch* is one engine process as far as the sidecar can tell. Three signals
say a new process is running: ``/health`` came back after failing, the KV-event
seq went backwards, or D's params name a ``remote_engine_id`` not seen in this
epoch. Each starts a new epoch: the node re-registers with generation 0 (the
daemon assigns the next generation, so the old process's retentions are dead),
the KV mirror is dropped and the daemon told to drop its index, and queued
registrations of the old epoch are discarded. Signals of one restart that
arrive one after another cost at most an extra generation (fail safe).

`HealthTracker` decides on probe results; `EngineInstance` holds the state and
tells listeners; `watch_health` and `learn_facts` do the HTTP.
"""

from __future__ import annotations

import asyncio
import enum
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
import structlog

from sidecar.metrics import SidecarMetrics
from sidecar.settings import EngineSettings

log = structlog.get_logger(__name__)

DEFAULT_BLOCK_SIZE = 16
_DP_SUFFIX = re.compile(r"_dp\d+$")
_CACHE_INFO_BLOCK_SIZE = re.compile(r'^vllm:cache_config_info\{[^}]*\bblock_size="(\d+)"', re.MULTILINE)
_PROCESS_START = re.compile(r"^process_start_time_seconds(?:\{[^}]*\})?\s+(\S+)", re.MULTILINE)


class Health(enum.Enum):
    STARTING = "starting"
    UP = "up"
    DOWN = "down"


class Transition(enum.Enum):
    UP = "up"
    """First answer since the sidecar started."""
    DOWN = "down"
    """Failed the configured number of probes in a row."""
    RESTARTED = "restarted"
    """Answers again after being down: a new process, as far as anyone can tell."""


@dataclass
class HealthTracker:
    """Probe results -> transitions. Pure."""

    failures_to_down: int
    state: Health = Health.STARTING
    failures: int = 0

    def observe(self, ok: bool) -> Transition | None:
        if ok:
            self.failures = 0
            if self.state is Health.STARTING:
                self.state = Health.UP
                return Transition.UP
            if self.state is Health.DOWN:
                self.state = Health.UP
                return Transition.RESTARTED
            return None
        self.failures += 1
        if self.state is Health.UP and self.failures >= self.failures_to_down:
            self.state = Health.DOWN
            return Transition.DOWN
        return None


def normalize_engine_id(engine_id: str) -> str:
    """vLLM's engine id without the per-DP-rank suffix (one sidecar may see several ranks)."""
    return _DP_SUFFIX.sub("", engine_id)


@dataclass(frozen=True)
class EngineFacts:
    """What the node registers with: the base model and the KV block size."""

    model: str
    block_size: int
    started_at: float = 0.0
    """When the engine process started (its /metrics process_start_time_seconds; 0 =
    unknown): the daemon keeps the generation of a process it knows (a sidecar restart)."""


class EngineInstance:
    """Which engine process is current, whether it answers, and its generation at the daemon."""

    def __init__(self, metrics: SidecarMetrics) -> None:
        self._metrics = metrics
        self.epoch = 0
        self.generation: int | None = None
        """The daemon's generation for the current epoch (None until registered)."""
        self.facts: EngineFacts | None = None
        self.up = asyncio.Event()
        """Set while the engine answers /health."""
        self.registered = asyncio.Event()
        """Set while `generation` is known for the current epoch."""
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
        """The engine answers /health (or stopped answering)."""
        if up:
            self.up.set()
        else:
            self.up.clear()
        self._notify()

    def restart(self, signal: str) -> None:
        """A new engine process: new epoch, generation unknown, listeners told."""
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

    def unregistered(self) -> None:
        """The daemon no longer knows the current generation (refused): wait for re-registration."""
        self.registered.clear()
        self._notify()


async def probe(session: aiohttp.ClientSession, url: str, timeout_s: float) -> bool:
    """Whether the engine's /health answers 200."""
    try:
        async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            return r.status == 200
    except (aiohttp.ClientError, TimeoutError, OSError):
        return False


async def watch_health(
    session: aiohttp.ClientSession,
    settings: EngineSettings,
    instance: EngineInstance,
    metrics: SidecarMetrics,
) -> None:
    """Probe /health forever and apply the transitions to `instance`."""
    tracker = HealthTracker(settings.health_failures)
    while True:
        ok = await probe(session, settings.url, settings.health_timeout_s)
        transition = tracker.observe(ok)
        if transition is Transition.RESTARTED:
            instance.restart("health")
        if transition in (Transition.UP, Transition.RESTARTED):
            instance.set_up(True)
            metrics.engine_up.set(1)
            log.info("engine.up", url=settings.url, epoch=instance.epoch)
        elif transition is Transition.DOWN:
            instance.set_up(False)
            metrics.engine_up.set(0)
            log.warning("engine.down", url=settings.url, failures=tracker.failures)
        await asyncio.sleep(settings.health_interval_s)


def started_at_of(metrics_text: str) -> float:
    """The engine process's start (Unix seconds) from ``process_start_time_seconds``, 0.0
    when not exposed (vLLM with several API servers serves multiprocess metrics without it)."""
    m = _PROCESS_START.search(metrics_text)
    try:
        value = float(m.group(1)) if m else 0.0
    except ValueError:  # (not a number: an engine's bug; the generation is then not kept)
        return 0.0
    return value if math.isfinite(value) and value > 0 else 0.0


def block_size_of(metrics_text: str) -> int | None:
    """Block size from vLLM's ``vllm:cache_config_info`` gauge, if exposed."""
    m = _CACHE_INFO_BLOCK_SIZE.search(metrics_text)
    return int(m.group(1)) if m else None


async def learn_facts(session: aiohttp.ClientSession, settings: EngineSettings) -> EngineFacts:
    """Model and block size (configured, else asked of the engine) and when the engine
    process started; raises aiohttp errors."""
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
    return EngineFacts(model, block_size, started_at_of(text))
