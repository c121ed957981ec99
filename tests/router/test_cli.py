"""``kvferry router`` as a process: flags, serving, SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal
import sys

import aiohttp
import pytest

from kvferry import logs
from realvllm.process import free_port
from router.cli import build_parser, main
from router.settings import from_args


def test_bad_flags_exit_2(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(logs, "configure", lambda *a, **k: None)  # keep the process's logging as it is
    assert main(["--prefill", "http://p:1"]) == 2  # no decode node, no daemon
    assert main(["--prefill", "p:1", "--decode", "http://d:1"]) == 2
    with pytest.raises(SystemExit) as refused:  # (argparse's own refusal: every float flag)
        main(["--daemon", "d:1", "--digest-cache-mb", "inf"])
    assert refused.value.code == 2
    assert main(["--daemon", "d:1", "--digest-cache-mb", "-1"]) == 2


def test_flags_and_environment_become_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVFERRY_ROUTER_API_KEY", " k-1, k/2/ ,")
    monkeypatch.setenv("KVFERRY_ROUTER_SHUTDOWN_GRACE", "60")
    args = build_parser().parse_args(["--prefill", "http://p:1/", "--decode", "http://d:1"])
    s = from_args(args)
    assert s.server.api_keys == ("k-1", "k/2/")  # keys kept as given; URLs lose a trailing /
    assert s.server.shutdown_grace_s == 60.0
    assert s.nodes.prefill_urls == ("http://p:1",)


async def test_serves_until_sigterm(http: aiohttp.ClientSession) -> None:
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvferry_cli", "router", "--listen", f"127.0.0.1:{port}",
        "--prefill", f"http://127.0.0.1:{free_port()}", "--decode", f"http://127.0.0.1:{free_port()}",
        "--model", "m",
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        async with asyncio.timeout(20):
            while True:
                try:
                    async with http.get(f"http://127.0.0.1:{port}/health") as r:
                        assert r.status == 200  # static nodes: routable (the engines are down, though)
                        break
                except aiohttp.ClientConnectionError:
                    await asyncio.sleep(0.1)
            async with http.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={"messages": []}) as r:
                assert r.status == 400
            proc.send_signal(signal.SIGTERM)
            _, err = await proc.communicate()
            assert proc.returncode == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    events = [json.loads(line)["event"] for line in err.decode().splitlines() if line.startswith("{")]
    assert "router.started" in events, events
    assert events[-2:] == ["router.stopping", "router.stopped"], events  # (the daemon's and sidecar's too)
