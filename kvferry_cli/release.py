"""`kvferry leases revoke`'s release: free D's blocks now through a prefill node.

A revoked retention's blocks stay on D until its TTL unless an engine tells D to free
them. As the router and the sidecars do (`kvferry.releases`), the command hands the
revoke's release params to an alive prefill node of D's model and block size, over
that engine's own HTTP URL (or its sidecar's, which relays, when the engine cannot be
connected to from here), then sends the ticks that make an idle engine deliver the
notification. Best effort: every way it can fail is an answer, never an exception.
"""

from __future__ import annotations

import contextlib
import errno
import http.client
import json
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

import grpc

from kvferry.releases import TICK_DELAYS_S, engine_url, release_body, release_prefill, released, tick_body
from kvferry.structs import struct_to_dict
from kvferry.v1 import leases_pb2, nodes_pb2, nodes_pb2_grpc


@dataclass(frozen=True)
class ReleaseOptions:
    """How the release reaches the prefill node."""

    daemon_timeout: float
    """Seconds to wait for the daemon's node listing."""
    engine_api_key: str
    """Bearer key of the prefill node's /v1/completions ("" = none)."""
    engine_timeout: float
    """Seconds to wait for the prefill node to run the release (a busy P queues it)."""


def release_revoked(
    nodes: nodes_pb2_grpc.NodesStub, resp: leases_pb2.RevokeLeaseResponse, options: ReleaseOptions
) -> tuple[bool, str]:
    """Send the revoked retention's release through a prefill node. -> (sent, how or why not)."""
    retention = resp.lease
    if not resp.release_params.fields:
        return False, (
            "nothing to release (the retention had expired, or its node is not alive at the "
            "generation it was registered under: an engine that lost its sidecar still holds "
            "them, to its TTL)"
        )
    try:
        listed = nodes.List(nodes_pb2.ListNodesRequest(), timeout=options.daemon_timeout).nodes
    except grpc.RpcError as e:
        return False, f"could not list the nodes ({e.code().name}: {e.details()}); D frees them at its TTL"
    d = next((n for n in listed if n.engine_id == retention.engine_id), None)
    if d is None or d.generation != retention.generation:
        return False, (
            f"its node {retention.engine_id} is gone or restarted since: nothing to release it through"
        )
    p = release_prefill(listed, d.model, retention.block_size)
    if p is None:
        return False, (
            f"no alive prefill node serves {d.model!r} with block size {retention.block_size}; "
            "D frees them at its TTL"
        )
    return _send(p, struct_to_dict(resp.release_params), options)


def _send(p: nodes_pb2.Node, params: dict[str, Any], options: ReleaseOptions) -> tuple[bool, str]:
    headers = {"Content-Type": "application/json"}
    if options.engine_api_key:
        headers["Authorization"] = f"Bearer {options.engine_api_key}"
    # The engine's own URL first, then its sidecar's (which relays to it) when the engine
    # could not be connected to from here (as the router falls back): only then did it
    # surely not get the release.
    urls = list(dict.fromkeys(u.rstrip("/") for u in (engine_url(p), p.http_url) if u))
    for i, url in enumerate(urls):
        try:
            status, text = _post(url, release_body(p.model or None, params), headers, options.engine_timeout)
        except (OSError, ValueError, http.client.HTTPException) as e:  # unreachable, timed out, garbled
            if i + 1 < len(urls) and _not_connected(e):
                continue
            return False, f"prefill node {p.engine_id} ({url}) did not take it: {e}; D frees them at its TTL"
        if not released(status):
            return False, f"prefill node {p.engine_id} refused the release: HTTP {status} {text}"
        waited = 0.0
        for delay in TICK_DELAYS_S:  # (a step for an idle P to send the notification in)
            time.sleep(delay - waited)
            waited = delay
            with contextlib.suppress(OSError, ValueError, http.client.HTTPException):
                _post(url, tick_body(p.model or None), headers, options.engine_timeout)
        return True, f"through prefill node {p.engine_id}"
    raise AssertionError("unreachable: a node to release through has a URL")


def _post(url: str, body: dict[str, Any], headers: dict[str, str], timeout: float) -> tuple[int, str]:
    """POST `body` to the engine's /v1/completions: -> (HTTP status, error text or "")."""
    request = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), headers, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            r.read()
            return int(r.status), ""
    except urllib.error.HTTPError as e:  # (before URLError: it is one) the engine answered
        return e.code, _error_text(e)


def _not_connected(e: Exception) -> bool:
    """Whether a request failed before any of it reached the server (no connection)."""
    reason = e.reason if isinstance(e, urllib.error.URLError) else e
    return isinstance(reason, ConnectionRefusedError | socket.gaierror) or (
        isinstance(reason, OSError) and reason.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH)
    )


def _error_text(e: urllib.error.HTTPError) -> str:
    try:
        return e.read()[:300].decode("utf-8", "replace")
    except (OSError, http.client.HTTPException):
        return ""
