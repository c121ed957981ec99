"""Run an emulated engine: HTTP server, side channel and KV-event publisher.

``async with EmulatorServer(config) as emu:`` starts everything (ports 0 pick
free ports) and exposes where it listens; leaving the block shuts it all down.
"""

from __future__ import annotations

import asyncio
from types import TracebackType

import structlog
from aiohttp import web

from emulator.config import EmulatorConfig
from emulator.engine import Engine
from emulator.eventpub import KVEventPublisher
from emulator.http_api import build_app

log = structlog.get_logger(__name__)


class EmulatorServer:
    """One emulated vLLM server, started in the running event loop."""

    def __init__(self, config: EmulatorConfig, *, shutdown_timeout: float = 2.0) -> None:
        config.validate()
        self.config = config
        self._shutdown_timeout = shutdown_timeout
        self._publisher: KVEventPublisher | None = None
        self._engine: Engine | None = None
        self._runner: web.AppRunner | None = None
        self._http_port: int | None = None

    async def start(self) -> None:
        """Bind every socket and start serving."""
        config = self.config
        try:
            if config.kv_events_port is not None:
                self._publisher = KVEventPublisher(
                    host=config.kv_events_host,
                    port=config.kv_events_port,
                    replay_port=config.kv_events_replay_port,
                    topic=config.kv_events_topic,
                    buffer_steps=config.kv_events_buffer_steps,
                    data_parallel_rank=config.data_parallel_rank,
                )
                await self._publisher.start()
            self._engine = Engine(config, emit=self._publisher.emit if self._publisher else None)
            await self._engine.start()
            self._runner = web.AppRunner(
                build_app(self._engine),
                handler_cancellation=True,
                shutdown_timeout=self._shutdown_timeout,
                access_log=None,
            )
            await self._runner.setup()
            site = web.TCPSite(self._runner, config.host, config.port)
            await site.start()
            self._http_port = int(self._runner.addresses[0][1])
        except BaseException:
            await self.stop()
            raise
        log.info(
            "emulator.started",
            engine_id=self.engine_id,
            http_url=self.http_url,
            side_channel_port=self.side_channel_port,
            kv_events_endpoint=self.kv_events_endpoint,
            role=config.role,
        )

    async def stop(self) -> None:
        """Stop serving and release every socket and task; idempotent."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._engine is not None:
            await self._engine.close()
        if self._publisher is not None:
            await self._publisher.close()
            self._publisher = None

    async def __aenter__(self) -> EmulatorServer:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    @property
    def engine(self) -> Engine:
        """The running engine."""
        if self._engine is None:
            raise RuntimeError("emulator not started")
        return self._engine

    @property
    def engine_id(self) -> str:
        """Engine id of this generation."""
        return self.engine.engine_id

    @property
    def http_port(self) -> int:
        """Bound HTTP port."""
        if self._http_port is None:
            raise RuntimeError("emulator not started")
        return self._http_port

    @property
    def http_url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:PORT``."""
        host = self.config.host
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.http_port}"

    @property
    def side_channel_host(self) -> str:
        """Host reported as ``remote_host``."""
        return self.config.side_channel_host

    @property
    def side_channel_port(self) -> int:
        """Bound side-channel port, reported as ``remote_port``."""
        return self.engine.side_channel_port

    @property
    def kv_events_endpoint(self) -> str | None:
        """Connectable ZMQ PUB endpoint, or None when events are off."""
        return self._publisher.endpoint if self._publisher else None

    @property
    def kv_events_replay_endpoint(self) -> str | None:
        """Connectable ZMQ ROUTER endpoint, or None when replay is off."""
        return self._publisher.replay_endpoint if self._publisher else None


async def serve_forever(config: EmulatorConfig, stop: asyncio.Event | None = None) -> None:
    """Run an emulator until ``stop`` is set (or the task is cancelled)."""
    stop = stop or asyncio.Event()
    async with EmulatorServer(config):
        await stop.wait()
