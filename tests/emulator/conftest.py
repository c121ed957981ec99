"""Fixtures of the emulator tests (start_emulator and the leak check are in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest_asyncio

from tests.conftest import StartEmulator
from tests.emulator.helpers import Client
from tests.emulator.pd import FirstTurn, run_first_turn

__all__ = ["StartEmulator"]  # start_emulator itself is in tests/conftest.py


@pytest_asyncio.fixture
async def http() -> AsyncIterator[Client]:
    """One aiohttp session for the test."""
    async with aiohttp.ClientSession() as session:
        yield Client(session)


@pytest_asyncio.fixture
async def first_turn(start_emulator: StartEmulator, http: Client) -> FirstTurn:
    """P (no prefix cache) and D started, and a first turn run through them: D holds its blocks."""
    return await run_first_turn(start_emulator, http)
