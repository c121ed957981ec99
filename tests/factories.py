"""Requests as a sidecar would send them, for tests and benchmarks."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from google.protobuf import timestamp_pb2

from kvferry.digests import block_digests, seed
from kvferry.v1 import leases_pb2, nodes_pb2

BLOCK = 16
#: KV-event payloads encoded by vLLM 0.33.0's own classes (see its README; do not edit).
VECTORS = Path(__file__).parent / "vectors"
SEED = seed("test-model")


def d_params(
    engine_id: str, num_tokens: int, request_id: str = "req-1", block_size: int = BLOCK
) -> dict[str, Any]:
    """kv_transfer_params as a vLLM decode node returns them when a request finishes."""
    n_blocks = -(-num_tokens // block_size)
    return {
        "do_remote_prefill": False,
        "do_remote_decode": True,
        "remote_block_ids": [list(range(100, 100 + n_blocks))],
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_host": "10.0.0.7",
        "remote_port": 5600,
        "tp_size": 1,
        "remote_num_tokens": num_tokens,
        "remote_blocks_expiry_time": 12345.5,
        "transfer_mode": "pull",
        "some_future_key": {"kept": True},
    }


def node_request(
    engine_id: str = "d-1", role: int = nodes_pb2.DECODE, **kw: Any
) -> nodes_pb2.RegisterNodeRequest:
    fields: dict[str, Any] = {
        "engine_id": engine_id,
        "role": role,
        "model": "test-model",
        "block_size": BLOCK,
        "http_url": "http://127.0.0.1:8100",
        "side_channel_host": "10.0.0.7",
        "side_channel_port": 5600,
    }
    fields.update(kw)
    return nodes_pb2.RegisterNodeRequest(**fields)


def tokens(n: int, start: int = 0) -> list[int]:
    return [(start + i) % 50_000 for i in range(n)]


def lease_request(
    conversation_id: str,
    engine_id: str = "d-1",
    num_tokens: int = 1000,
    tenant: str = "",
    seq: list[int] | None = None,
    expires_in: float | None = None,
    params: dict[str, Any] | None = None,
) -> leases_pb2.RegisterLeaseRequest:
    req = leases_pb2.RegisterLeaseRequest(
        tenant=tenant,
        conversation_id=conversation_id,
        engine_id=engine_id,
        num_tokens=num_tokens,
        block_size=BLOCK,
    )
    req.kv_transfer_params.update(params if params is not None else d_params(engine_id, num_tokens))
    if seq is not None:
        req.block_digests = block_digests(seq, BLOCK, SEED)
    if expires_in is not None:
        ts = timestamp_pb2.Timestamp()
        ts.FromNanoseconds(int((time.time() + expires_in) * 1e9))
        req.expires_at.CopyFrom(ts)
    return req


def lookup_request(
    conversation_id: str,
    prompt_tokens: int = 1200,
    tenant: str = "",
    seq: list[int] | None = None,
    peek: bool = False,
) -> leases_pb2.LookupRequest:
    req = leases_pb2.LookupRequest(
        tenant=tenant, conversation_id=conversation_id, prompt_tokens=prompt_tokens, peek=peek
    )
    if seq is not None:
        req.prompt_digests = block_digests(seq, BLOCK, SEED)
    return req


def beside_other_replicas(monkeypatch: Any, daemon: Any) -> None:
    """Have `daemon` decide as a replica that does not write every node record itself
    (controlplane.solewriter): each pull is confirmed by a read of its decode node."""
    monkeypatch.setattr(daemon.control_plane.store.writer, "trusted", lambda: False)


def node_reads() -> float:
    """etcd reads of one node this process's daemons have made so far (kvferry_etcd_seconds,
    op get_node: the confirming reads, among others)."""
    from controlplane import metrics

    return sum(b.get() for b in metrics.ETCD_LATENCY.labels("get_node")._buckets)
