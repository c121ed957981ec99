"""The two engine backends of the scenario suite, as processes with one interface.

``KVFERRY_ENGINES=emulator`` (the default, in ``make test``) runs kvferry's emulator;
``KVFERRY_ENGINES=vllm`` (``make test-vllm``) runs real vLLM (the CPU build with NIXL)
from the venv named by ``KVFERRY_VLLM_PYTHON``, serving a random-weight model made at
test time. Either way the suite gets one prefill and one decode engine, started once
for the session, reached only over their own HTTP, NIXL side-channel and KV-event
ports: what a scenario asserts holds for both, so every CI run checks the emulator
against the real engine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

from realvllm.engine import EngineSpec, VllmEngine
from realvllm.model import ModelSpec
from realvllm.process import EngineProcess, free_port

REPO = Path(__file__).resolve().parents[2]
MODEL = "kvferry/tiny"
BLOCK_SIZE = 32
MAX_MODEL_LEN = 16384
#: D keeps finished requests' blocks this long: longer than the suite, so that nothing
#: expires on its own while a scenario counts blocks.
DECODER_TTL_S = 3600
#: The decode engine's fixed NIXL engine id: a restart keeps it (the harder case to fence).
FIXED_D_ENGINE_ID = "kvferry-scenario-d"


class Engine(Protocol):
    """What a scenario knows of an engine."""

    role: str
    http_url: str
    side_channel_host: str
    side_channel_port: int
    kv_events_endpoint: str
    kv_events_replay_endpoint: str
    log_path: Path

    def ready(self, timeout_s: float = ...) -> float: ...
    def respawn(self, engine_id: str | None) -> float: ...
    def kill(self) -> None: ...
    def stop(self, grace_s: float = ...) -> None: ...
    def pause(self) -> None: ...
    def resume(self) -> None: ...
    def start(self) -> None: ...


class EmulatedEngine(EngineProcess):
    """kvferry's emulator as a process, on the command line an operator would use."""

    def __init__(self, role: str, log_dir: Path, engine_id: str | None = None) -> None:
        self.role = role
        self.http_port = free_port()
        self.side_channel_host = "127.0.0.1"
        self.side_channel_port = free_port()
        events = role == "decode"
        self._events = (free_port(), free_port()) if events else None
        self.engine_id = engine_id
        name = f"emulator-{role}-{self.http_port}"
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        super().__init__(
            name, self._command(), env, f"http://127.0.0.1:{self.http_port}", log_dir / f"{name}.log"
        )

    @property
    def kv_events_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self._events[0]}" if self._events else ""

    @property
    def kv_events_replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self._events[1]}" if self._events else ""

    def _command(self) -> list[str]:
        cmd = [
            sys.executable,
            "-m",
            "emulator",
            "--host=127.0.0.1",
            f"--port={self.http_port}",
            f"--role={self.role}",
            f"--model={MODEL}",
            f"--block-size={BLOCK_SIZE}",
            "--num-blocks=16384",
            f"--max-model-len={MAX_MODEL_LEN}",
            "--side-channel-host=127.0.0.1",
            f"--side-channel-port={self.side_channel_port}",
            f"--decoder-kv-blocks-ttl={DECODER_TTL_S}",
            "--log-level=warning",
        ]
        if self.engine_id:
            cmd.append(f"--engine-id={self.engine_id}")
        if self._events:
            cmd += [
                "--kv-events-host=127.0.0.1",
                f"--kv-events-port={self._events[0]}",
                f"--kv-events-replay-port={self._events[1]}",
                "--kv-events-topic=kvferry",
            ]
        if self.role == "prefill":
            cmd.append("--no-prefix-caching")
        return cmd

    def ready(self, timeout_s: float = 60.0) -> float:
        return self.wait_ready(timeout_s)

    def respawn(self, engine_id: str | None) -> float:
        """Stop, start again on the same ports with this engine id; -> seconds to ready."""
        self.stop()
        self.engine_id = engine_id
        self.command = self._command()
        self.start()
        return self.ready()


class RealEngine(VllmEngine):
    """A real vLLM engine of the suite."""

    def __init__(self, spec: EngineSpec, python: Path, log_dir: Path) -> None:
        super().__init__(spec, python, log_dir)
        self.role = spec.role

    def respawn(self, engine_id: str | None) -> float:
        self.stop()
        self.spec = replace(self.spec, engine_id=engine_id)
        self.command = self._command(self.python)
        self.start()
        return self.ready()


@dataclass
class Engines:
    """The suite's engines: one prefill, one decode."""

    kind: str
    prefill: Engine
    decode: Engine
    model: str = MODEL
    block_size: int = BLOCK_SIZE

    def stop(self) -> None:
        for engine in (self.decode, self.prefill):
            engine.stop()


def backend() -> str:
    kind = os.environ.get("KVFERRY_ENGINES", "emulator")
    if kind not in ("emulator", "vllm"):
        raise ValueError(f"KVFERRY_ENGINES must be emulator or vllm, not {kind!r}")
    return kind


def make_model(python: Path, out: Path, spec: ModelSpec | None = None) -> Path:
    """The test model, made by the vLLM venv's python (it has torch and transformers)."""
    subprocess.run(
        [str(python), "-m", "realvllm.model", str(out), *(spec or ModelSpec()).flags()],
        check=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=600,
    )
    return out


def start_engines(kind: str, work: Path) -> Engines:
    """Start P and D of `kind` side by side and wait until both serve."""
    logs = work / "logs"
    prefill: Engine
    decode: Engine
    if kind == "vllm":
        python = Path(os.environ["KVFERRY_VLLM_PYTHON"])
        model_dir = make_model(python, work / "model")
        common = {"model_dir": model_dir, "served_name": MODEL, "block_size": BLOCK_SIZE}
        prefill = RealEngine(
            EngineSpec(role="prefill", kv_events=False, max_model_len=MAX_MODEL_LEN, **common), python, logs
        )
        decode = RealEngine(
            EngineSpec(
                role="decode",
                engine_id=FIXED_D_ENGINE_ID,
                decoder_kv_blocks_ttl=DECODER_TTL_S,
                max_model_len=MAX_MODEL_LEN,
                **common,
            ),
            python,
            logs,
        )
    else:
        prefill = EmulatedEngine("prefill", logs)
        decode = EmulatedEngine("decode", logs, engine_id=FIXED_D_ENGINE_ID)
    engines = Engines(kind, prefill, decode)
    try:
        prefill.start()
        decode.start()
        prefill.ready()
        decode.ready()
    except BaseException:
        engines.stop()
        raise
    return engines
