"""The command line: flags map onto the config, and a real process starts and stops."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from emulator.cli import build_parser, config_from_args, main
from emulator.config import EmulatorConfig
from tests.emulator.helpers import async_test

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_mirror_the_config() -> None:
    config = config_from_args(build_parser().parse_args([]))
    assert config == EmulatorConfig()
    assert config.kv_recompute_threshold == 64
    assert config.decoder_kv_blocks_ttl == 480.0
    assert config.kv_load_failure_policy == "fail"
    assert config.side_channel_port == 5600
    assert config.kv_events_port is None


def test_flags() -> None:
    args = build_parser().parse_args(
        [
            "--role=decode",
            "--block-size=32",
            "--num-blocks=100",
            "--engine-id=e1",
            "--kv-events-port=5557",
            "--kv-events-replay-port=5558",
            "--kv-events-topic=t",
            "--no-bidirectional-kv-xfer",
            "--kv-recompute-threshold=128",
            "--decoder-kv-blocks-ttl=60",
            "--kv-load-failure-policy=recompute",
            "--prefill-ms-per-token=0.1",
            "--decode-ms-per-token=5",
            "--transfer-ms-per-block=0.5",
            "--no-prefix-caching",
            "--no-chat-prompt-token-ids",
            "--max-model-len=8192",
        ]
    )
    config = config_from_args(args)
    assert (config.role, config.block_size, config.num_blocks, config.engine_id) == ("decode", 32, 100, "e1")
    assert (config.kv_events_port, config.kv_events_replay_port, config.kv_events_topic) == (5557, 5558, "t")
    assert not config.bidirectional_kv_xfer and not config.enable_prefix_caching
    assert not config.chat_prompt_token_ids  # (on by default: vLLM 0.32)
    assert config.kv_recompute_threshold == 128 and config.decoder_kv_blocks_ttl == 60
    assert config.kv_load_failure_policy == "recompute" and config.max_model_len == 8192
    assert (config.prefill_ms_per_token, config.decode_ms_per_token, config.transfer_ms_per_block) == (
        0.1,
        5,
        0.5,
    )


def test_bad_values_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--block-size=0"]) == 2
    assert "block_size" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--role=router"])


@async_test(timeout=20)
async def test_process_serves_and_stops_on_sigterm() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "emulator.cli",
        "--host=127.0.0.1",
        "--port=0",
        "--side-channel-host=127.0.0.1",
        "--side-channel-port=0",
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        env=env,
        cwd=ROOT,
    )
    try:
        assert proc.stderr is not None
        while True:
            line = await proc.stderr.readline()
            assert line, "the emulator exited before it started"
            record = json.loads(line)
            if record.get("event") == "emulator.started":
                break
        async with (
            aiohttp.ClientSession() as session,
            session.get(record["http_url"] + "/health") as response,
        ):
            assert response.status == 200
        proc.send_signal(signal.SIGTERM)
        await proc.stderr.read()
        assert await proc.wait() == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


@pytest.mark.parametrize("which", ["http", "kv-events"])
def test_a_port_in_use_is_one_line_and_exit_1(which: str) -> None:
    with socket.socket() as taken:  # (a process of its own: main() runs an event loop to its end)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        ports = (
            [f"--port={port}"]
            if which == "http"
            # (ZMQ's bind error is no OSError: it was a traceback)
            else ["--port=0", "--kv-events-host=127.0.0.1", f"--kv-events-port={port}"]
        )
        proc = subprocess.run(
            [sys.executable, "-m", "emulator.cli", "--host=127.0.0.1", *ports, "--side-channel-port=0"],
            capture_output=True,
            text=True,
            timeout=30,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            cwd=ROOT,
        )
    assert proc.returncode == 1
    assert (
        proc.stderr.splitlines()[-1].startswith("kvferry emulate: ")
        and "address already in use" in proc.stderr.lower()
    )
    assert "Traceback" not in proc.stderr
