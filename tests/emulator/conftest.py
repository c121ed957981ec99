"""Fixtures of the emulator tests: emulators on port 0, one HTTP session, hygiene."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from emulator import EmulatorServer
from tests.emulator.helpers import Client, config

StartEmulator = Callable[..., Awaitable[EmulatorServer]]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Warnings are errors in this suite, whatever the root configuration says."""
    for item in items:
        if "tests/emulator/" in str(item.path).replace("\\", "/"):
            item.add_marker(pytest.mark.filterwarnings("error"))


@pytest_asyncio.fixture
async def start_emulator() -> AsyncIterator[StartEmulator]:
    """Start emulators (config fields as keywords); all are stopped at teardown."""
    started: list[EmulatorServer] = []

    async def start(**changes: Any) -> EmulatorServer:
        emu = EmulatorServer(config(**changes), shutdown_timeout=0.5)
        await emu.start()
        started.append(emu)
        return emu

    yield start
    for emu in reversed(started):
        await asyncio.wait_for(emu.stop(), timeout=10)


@pytest_asyncio.fixture
async def http() -> AsyncIterator[Client]:
    """One aiohttp session for the test."""
    async with aiohttp.ClientSession() as session:
        yield Client(session)


@pytest_asyncio.fixture(autouse=True)
async def _no_leaked_tasks() -> AsyncIterator[None]:
    """Fail a test that leaves tasks running on its loop."""
    before = asyncio.all_tasks()
    yield
    await asyncio.sleep(0)
    current = asyncio.current_task()
    leaked = [t for t in asyncio.all_tasks() - before if not t.done() and t is not current]
    assert not leaked, f"leaked tasks: {leaked}"
