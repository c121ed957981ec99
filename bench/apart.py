"""The router benchmark's front doors in processes of their own, as a deployment runs them:
the kvferry router (``kvferry router``) and the multi-turn proxy stand-in
(``python -m bench.apart P_URL D_URL PORT``).

In the bench's own process a front door shares one event loop with both emulators, their
sidecars and the client: a turn's work in the router (tokenizing, digests, the lookup's
answer) queues behind whatever those have ready (the previous turn's KV events, say),
and theirs behind it. Apart, each front door has its loop to itself, and the comparison
between them measures what each does, not what the bench's loop was busy with.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from types import TracebackType

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from bench.router_paths import STAGES, MultiturnProxyStandIn
from kvferry.tasks import run_main
from realvllm.process import free_port

READY_S = 60.0
"""How long a front door may take to start and see both nodes."""


class Apart:
    """A front door in a child process, `argv` with ``--listen``'s port given: ready once
    its ``/health`` answers 200 (the router: it knows a prefill and a decode node)."""

    def __init__(self, argv: Sequence[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._argv = [a.replace("{port}", str(self.port)) for a in argv]
        self._proc: asyncio.subprocess.Process | None = None

    async def __aenter__(self) -> Apart:
        self._proc = await asyncio.create_subprocess_exec(*self._argv, stdin=asyncio.subprocess.DEVNULL)
        async with aiohttp.ClientSession() as http, asyncio.timeout(READY_S):
            while True:
                if self._proc.returncode is not None:
                    raise RuntimeError(f"{self._argv[:4]} exited at start ({self._proc.returncode})")
                try:
                    async with http.get(self.url + "/health") as r:
                        if r.status == 200:
                            return self
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.1)

    async def __aexit__(
        self, kind: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 15)
        except TimeoutError:
            proc.kill()
            await proc.wait()


def router(daemon: str, *, tokenizer: str = "", reuse: bool = True) -> Apart:
    """``kvferry router`` on `daemon`'s nodes, as `bench.demo.router_settings` sets one up
    (with the model's tokenizer files at `tokenizer`, when given)."""
    return Apart(
        [
            sys.executable, "-m", "kvferry_cli", "--log-level", "warning", "router",
            "--listen", "127.0.0.1:{port}", "--daemon", daemon, "--nodes-refresh", "0.5",
            "--reuse", str(reuse).lower(), *(["--tokenizer", tokenizer] if tokenizer else []),
        ]
    )  # fmt: skip


def stand_in(p_url: str, d_url: str) -> Apart:
    """The multi-turn proxy stand-in (`MultiturnProxyStandIn`) before P at `p_url` and D at `d_url`."""
    return Apart([sys.executable, "-m", "bench.apart", p_url, d_url, "{port}"])


async def stage_seconds(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """Seconds each reuse stage (`STAGES`) took so far in the router at `url`, from its /metrics."""
    async with http.get(url + "/metrics") as r:
        text = await r.text()
    out = dict.fromkeys(STAGES, 0.0)
    for family in text_string_to_metric_families(text):
        if family.name != "kvferry_router_stage_seconds":
            continue
        for sample in family.samples:
            stage = sample.labels.get("stage", "")
            if sample.name.endswith("_sum") and stage in out:
                out[stage] = sample.value
    return out


async def _serve_stand_in(p_url: str, d_url: str, port: int) -> int:
    proxy = MultiturnProxyStandIn(p_url, d_url)
    await proxy.start(port)
    await asyncio.Event().wait()  # until SIGTERM ends the process
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(_serve_stand_in(sys.argv[1], sys.argv[2], int(sys.argv[3]))))
