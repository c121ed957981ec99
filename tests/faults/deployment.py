"""A whole kvferry deployment on loopback for the fault suite: the 3-member etcd
cluster, two daemon replicas (processes of their own), P and D engine emulators with
a sidecar each and the router in this process, both failing over between the
replicas; plus a reference engine (an emulator serving alone, no P/D, no reuse) whose
answers are the correct ones."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from bench.demo import sidecar_settings
from emulator import EmulatorConfig, EmulatorServer
from kvferry.structs import struct_to_dict
from kvferry.v1 import leases_pb2, leases_pb2_grpc, nodes_pb2, nodes_pb2_grpc
from router import Router
from router import Settings as RouterSettings
from router.settings import DaemonSettings, ServerSettings
from sidecar import Sidecar
from tests.faults.cluster import DaemonProcess, EtcdCluster
from tests.faults.ledger import Ledger
from tests.faults.load import Turn

DECODER_TTL_S = 120.0
"""How long D holds a finished turn's blocks (and the retention lives): longer than a test."""
TIMING = {"prefill_ms_per_token": 0.02, "transfer_ms_per_block": 0.02, "decode_ms_per_token": 1.0}


def engine_config(role: str, **changes: Any) -> EmulatorConfig:
    return EmulatorConfig(
        host="127.0.0.1",
        port=0,
        role=role,  # type: ignore[arg-type]
        side_channel_host="127.0.0.1",
        side_channel_port=0,
        kv_events_host="127.0.0.1",
        max_model_len=65536,
        stream_kv_transfer_params=True,
        decoder_kv_blocks_ttl=DECODER_TTL_S,
        **changes,
    )


def router_settings(daemons: tuple[str, ...]) -> RouterSettings:
    return RouterSettings(
        server=ServerSettings(listen="127.0.0.1:0", shutdown_grace_s=1.0),
        # (one loop runs engines, sidecars and router here, on a shared 2-core machine: the
        # router tests' lookup deadline, not production's 50 ms)
        daemon=DaemonSettings(
            addresses=daemons, lookup_deadline_s=1.0, score_deadline_s=1.0, nodes_refresh_s=0.5
        ),
    )


@dataclass
class Deployment:
    cluster: EtcdCluster
    daemons: list[DaemonProcess]
    prefill: EmulatorServer
    decode: EmulatorServer
    reference: EmulatorServer
    router: Router
    sidecars: list[Sidecar]
    root: Path

    def keep_record(self, name: str, turns: list[Turn], ledger: Ledger, restored_at: float) -> Path:
        """Every turn, registration, grant and release as JSON beside the processes' logs (to find
        out why a figure is off). -> the file."""
        path = self.root / f"record-{name.split()[1]}.json"
        record = {
            "restored_at": restored_at,
            "turns": [dataclasses.asdict(t) for t in turns],
            "grants": [dataclasses.asdict(g) for g in ledger.grants],
            "registrations": [dataclasses.asdict(r) for r in ledger.registrations],
            "releases": [dataclasses.asdict(r) for r in ledger.releases],
        }
        path.write_text(json.dumps(record))
        return path

    async def unclaimed(self) -> set[str]:
        """D request ids of the retentions the daemons still hold unclaimed (any tenant)."""
        found: set[str] = set()
        async with grpc.aio.insecure_channel(self.daemons[-1].address) as channel:
            stub = leases_pb2_grpc.LeasesStub(channel)
            token = ""
            while True:
                res = await stub.List(
                    leases_pb2.ListLeasesRequest(all_tenants=True, page_size=1000, page_token=token),
                    timeout=10,
                )
                for lease in res.leases:
                    if not lease.claimed:
                        found.add(str(struct_to_dict(lease.kv_transfer_params).get("remote_request_id", "")))
                token = res.next_page_token
                if not token:
                    return found

    async def wait_registrations(self, timeout_s: float = 30.0) -> bool:
        """Until every sidecar has sent (or given up) what it had to register."""
        return all([await s.retentions.wait_idle(timeout_s) for s in self.sidecars if s.retentions])


async def _wait_nodes(address: str, count: int) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = nodes_pb2_grpc.NodesStub(channel)
        while True:
            listed = await stub.List(nodes_pb2.ListNodesRequest(), timeout=5)
            if sum(n.alive for n in listed.nodes) >= count:
                return
            await asyncio.sleep(0.1)


@contextlib.asynccontextmanager
async def deployment(root: Path) -> AsyncIterator[Deployment]:
    """Everything started, every node registered; all stopped (processes killed) at exit."""
    async with contextlib.AsyncExitStack() as stack:
        cluster = EtcdCluster(root)
        stack.push_async_callback(cluster.stop)
        await cluster.start()
        daemons = [DaemonProcess(f"daemon{i}", cluster.endpoints, "/faults", root) for i in range(2)]
        for daemon in daemons:
            stack.push_async_callback(daemon.stop)
            await daemon.start()
        addresses = tuple(d.address for d in daemons)
        p = EmulatorServer(engine_config("prefill", enable_prefix_caching=False, **TIMING))
        d = EmulatorServer(engine_config("decode", num_blocks=32768, **TIMING))
        reference = EmulatorServer(engine_config("both", num_blocks=8192))
        sidecars = []
        for emu, role in ((p, "prefill"), (d, "decode")):
            await stack.enter_async_context(emu)
            sidecars.append(
                await stack.enter_async_context(
                    Sidecar(sidecar_settings(emu, addresses, role, blocks_ttl_s=DECODER_TTL_S))
                )
            )
        await stack.enter_async_context(reference)
        await _wait_nodes(addresses[0], 2)
        router = await stack.enter_async_context(Router(router_settings(addresses)))
        yield Deployment(cluster, daemons, p, d, reference, router, sidecars, root)
