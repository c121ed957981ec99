"""Fixtures of the emulator tests (start_emulator and the leak check are in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest_asyncio

from tests.conftest import StartEmulator
from tests.emulator.helpers import Client

__all__ = ["StartEmulator"]  # start_emulator itself is in tests/conftest.py


@pytest_asyncio.fixture
async def http() -> AsyncIterator[Client]:
    """One aiohttp session for the test."""
    async with aiohttp.ClientSession() as session:
        yield Client(session)
