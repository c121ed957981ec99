"""`kvferry leases ...` and `kvferry nodes ...`: thin gRPC clients that print tables or JSON."""

from __future__ import annotations

import argparse
import contextlib
import errno
import http.client
import json
import os
import socket
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

import grpc
from google.protobuf import json_format

from kvferry import logs
from kvferry.digests import DIGEST_SIZE
from kvferry.flags import non_negative_int, seconds
from kvferry.releases import TICK_DELAYS_S, engine_url, release_body, release_prefill, released, tick_body
from kvferry.structs import json_number, struct_to_dict
from kvferry.v1 import leases_pb2, leases_pb2_grpc, nodes_pb2, nodes_pb2_grpc

EXIT_CODES = "exit status: 0 done, 1 the daemon failed or is unreachable, 2 not found or bad input"
_LIST_JSON = "print JSON, one object per line, instead of a table"
_ANSWER_JSON = "print the daemon's answer as JSON on one line"


def add_arguments(sub: Any) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--daemon", default="127.0.0.1:50051", help="daemon address host:port")
    common.add_argument("--timeout", type=seconds, default=5.0, help="seconds to wait for each daemon call")
    logs.add_level_flag(common, default=argparse.SUPPRESS)

    def command(parent: Any, name: str, help_text: str, json_help: str) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = parent.add_parser(
            name, parents=[common], help=help_text, epilog=EXIT_CODES
        )
        p.add_argument("--json", action="store_true", help=json_help)
        return p

    leases = sub.add_parser("leases", help="inspect and revoke retention leases")
    lsub = leases.add_subparsers(dest="action", required=True)
    ls = command(lsub, "ls", "list leases", _LIST_JSON)
    which = ls.add_mutually_exclusive_group()
    which.add_argument(
        "--tenant",
        default="",
        help="the tenant's leases (default: the default tenant's; with --engine, every tenant's)",
    )
    which.add_argument("--all-tenants", action="store_true", help="every tenant's leases")
    ls.add_argument(
        "--engine", default="", help="only leases held on this engine id, of every tenant unless --tenant"
    )
    ls.add_argument("--inactive", action="store_true", help="include expired leases not yet collected")
    ls.add_argument("--limit", type=non_negative_int, default=0, help="stop after this many (0 = all)")
    get = command(
        lsub, "get", "show one conversation's lease", "print it on one line (default: indented JSON)"
    )
    revoke = command(lsub, "revoke", "revoke one conversation's lease and free D's blocks", _ANSWER_JSON)
    for p in (get, revoke):
        p.add_argument("conversation_id")
        p.add_argument("--tenant", default="")
    _release_flags(revoke)
    leases.set_defaults(func=_leases)

    nodes = sub.add_parser("nodes", help="inspect registered nodes")
    nsub = nodes.add_subparsers(dest="action", required=True)
    nls = command(nsub, "ls", "list nodes", _LIST_JSON)
    nls.add_argument("--all", action="store_true", help="include nodes whose liveness lapsed")
    nrm = command(
        nsub,
        "rm",
        "deregister a node: its liveness ends and its leases die with it (D keeps their blocks to "
        "their TTL; a sidecar still attached registers it again: stop that first)",
        _ANSWER_JSON,
    )
    nrm.add_argument("engine_id")
    nodes.set_defaults(func=_nodes)


def _release_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--no-release",
        action="store_true",
        help="only revoke: D keeps the blocks to its TTL (default: a prefill node tells D to free them)",
    )
    p.add_argument(
        "--engine-api-key",
        default=os.environ.get("VLLM_API_KEY", ""),
        help="bearer key for the prefill node's /v1/completions (vLLM --api-key; default: $VLLM_API_KEY)",
    )
    p.add_argument(
        "--release-timeout",
        type=seconds,
        default=60.0,
        help="seconds to wait for the prefill node to run the release (a busy P queues it)",
    )


def _print_table(rows: Sequence[Sequence[str]], header: Sequence[str]) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=False)]
    for row in (header, *rows):
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=False)).rstrip())


def _as_dict(msg: Any) -> dict[str, Any]:
    """The message as grpcurl shows it, with every field (a dead node's ``alive: false``,
    a revoke's ``found: false``), and integral Struct numbers as integers (block ids, ports)."""
    d = json_format.MessageToDict(
        msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    return _integral(d)  # type: ignore[no-any-return]


def _integral(v: Any) -> Any:
    if isinstance(v, float):  # (only Struct values are doubles in these messages)
        return json_number(v)
    if isinstance(v, dict):
        return {k: _integral(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_integral(x) for x in v]
    return v


def _fail(e: grpc.RpcError) -> int:
    print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
    return 2 if e.code() in _THE_CALLERS else 1


#: Answers about the request itself (exit 2, as "not found"), not the daemon failing (exit 1).
_THE_CALLERS = frozenset(
    {grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE}
)


def _bad_input(e: Exception) -> int:
    """An argument no request can carry (not UTF-8, say), or an answer JSON cannot show
    (a NaN a daemon stored before it refused them): one line, not a traceback."""
    print(f"error: {e}", file=sys.stderr)
    return 2


def _leases(a: argparse.Namespace) -> int:
    with grpc.insecure_channel(a.daemon) as ch:
        stub = leases_pb2_grpc.LeasesStub(ch)
        try:
            if a.action == "ls":
                return _leases_ls(stub, a)
            if a.action == "get":
                lease = stub.Get(
                    leases_pb2.GetLeaseRequest(tenant=a.tenant, conversation_id=a.conversation_id),
                    timeout=a.timeout,
                )
                print(json.dumps(_as_dict(lease), indent=None if a.json else 2))
                return 0
            return _revoke(stub, nodes_pb2_grpc.NodesStub(ch), a)
        except grpc.RpcError as e:
            return _fail(e)
        except (ValueError, json_format.Error) as e:
            return _bad_input(e)


def _revoke(stub: leases_pb2_grpc.LeasesStub, nodes: nodes_pb2_grpc.NodesStub, a: argparse.Namespace) -> int:
    """Revoke the lease, then (unless --no-release) free D's blocks now rather than at
    D's TTL: a prefill node of D's model and block size is handed the release params
    with nothing to pull, and its connector only notifies D (as the router and the
    sidecars release blocks). The release is best effort: the lease is revoked either
    way, and the exit status is 0 (`release.sent` in --json says whether it went)."""
    resp = stub.Revoke(
        leases_pb2.RevokeLeaseRequest(tenant=a.tenant, conversation_id=a.conversation_id),
        timeout=a.timeout,
    )
    if not resp.found:
        return _removed(resp, a.json, "revoked", "no such lease")
    sent, how = (False, "--no-release") if a.no_release else _release(nodes, resp, a)
    if a.json:
        print(json.dumps({**_as_dict(resp), "release": {"sent": sent, "detail": how}}))
    else:
        print("revoked")
        if not a.no_release:
            print(f"D's blocks released {how}" if sent else f"D's blocks not released: {how}")
    return 0


def _release(
    nodes: nodes_pb2_grpc.NodesStub, resp: leases_pb2.RevokeLeaseResponse, a: argparse.Namespace
) -> tuple[bool, str]:
    """Send the revoked lease's release through a prefill node. -> (sent, how or why not)."""
    lease = resp.lease
    if not resp.release_params.fields:
        return False, (
            "nothing to release (the lease had expired, or its node is not alive at the "
            "generation it was registered under: an engine that lost its sidecar still holds "
            "them, to its TTL)"
        )
    try:
        listed = nodes.List(nodes_pb2.ListNodesRequest(), timeout=a.timeout).nodes
    except grpc.RpcError as e:
        return False, f"could not list the nodes ({e.code().name}: {e.details()}); D frees them at its TTL"
    d = next((n for n in listed if n.engine_id == lease.engine_id), None)
    if d is None or d.generation != lease.generation:
        return False, f"its node {lease.engine_id} is gone or restarted since: nothing to release it through"
    p = release_prefill(listed, d.model, lease.block_size)
    if p is None:
        return False, (
            f"no alive prefill node serves {d.model!r} with block size {lease.block_size}; "
            "D frees them at its TTL"
        )
    params = struct_to_dict(resp.release_params)
    headers = {"Content-Type": "application/json"}
    if a.engine_api_key:
        headers["Authorization"] = f"Bearer {a.engine_api_key}"
    # The engine's own URL first, then its sidecar's (which relays to it) when the engine
    # could not be connected to from here (as the router falls back): only then did it
    # surely not get the release.
    urls = list(dict.fromkeys(u.rstrip("/") for u in (engine_url(p), p.http_url) if u))
    for i, url in enumerate(urls):
        try:
            status, text = _post(url, release_body(p.model or None, params), headers, a.release_timeout)
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
                _post(url, tick_body(p.model or None), headers, a.release_timeout)
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


def _removed(resp: Any, as_json: bool, done: str, missing: str) -> int:
    """Report a removal (a response with `found`): exit 0, or 2 when there was nothing to remove."""
    print(json.dumps(_as_dict(resp)) if as_json else done if resp.found else missing)
    return 0 if resp.found else 2


def _leases_ls(stub: leases_pb2_grpc.LeasesStub, a: argparse.Namespace) -> int:
    rows: list[list[str]] = []
    token = ""
    count = 0
    while True:
        resp = stub.List(
            leases_pb2.ListLeasesRequest(
                tenant=a.tenant,
                # (an engine's leases are whosever they are: behind a router with API keys
                # no tenant is the default one)
                all_tenants=a.all_tenants or bool(a.engine and not a.tenant),
                engine_id=a.engine,
                include_inactive=a.inactive,
                page_size=500,
                page_token=token,
            ),
            timeout=a.timeout,
        )
        for lease in resp.leases:
            count += 1
            if a.json:
                print(json.dumps(_as_dict(lease)))
            else:
                rows.append(
                    [
                        lease.tenant,
                        lease.conversation_id,
                        lease.engine_id,
                        str(lease.generation),
                        str(lease.num_tokens),
                        str(len(lease.block_digests) // DIGEST_SIZE),
                        lease.expires_at.ToDatetime().strftime("%Y-%m-%d %H:%M:%S"),
                    ]
                )
            if a.limit and count >= a.limit:
                break
        token = resp.next_page_token
        if not token or (a.limit and count >= a.limit):
            break
    if not a.json:
        _print_table(rows, ["TENANT", "CONVERSATION", "ENGINE", "GEN", "TOKENS", "DIGESTS", "EXPIRES (UTC)"])
    return 0


def _nodes(a: argparse.Namespace) -> int:
    with grpc.insecure_channel(a.daemon) as ch:
        stub = nodes_pb2_grpc.NodesStub(ch)
        try:
            if a.action == "rm":
                gone = stub.Deregister(
                    nodes_pb2.DeregisterNodeRequest(engine_id=a.engine_id), timeout=a.timeout
                )
                return _removed(gone, a.json, "deregistered", "no such node")
            resp = stub.List(nodes_pb2.ListNodesRequest(include_dead=a.all), timeout=a.timeout)
        except grpc.RpcError as e:
            return _fail(e)
        except ValueError as e:
            return _bad_input(e)
    if a.json:
        for n in resp.nodes:
            print(json.dumps(_as_dict(n)))
        return 0
    rows = [
        [
            n.engine_id,
            nodes_pb2.Role.Name(n.role),
            n.model,
            str(n.generation),
            "yes" if n.alive else "suspended" if n.suspended else "no",
            f"{n.side_channel_host}:{n.side_channel_port}",
            n.http_url,
            str(n.live_leases),
            str(n.held_tokens),
            str(n.uncaptured_turns),
            str(n.unretained_blocks),
        ]
        for n in resp.nodes
    ]
    # (UNCAPTURED: turns the engine pinned blocks for without saying which, e.g. streamed
    # answers without kv_transfer_params; UNRETAINED: the blocks they pin now)
    header = ["ENGINE", "ROLE", "MODEL", "GEN", "ALIVE", "SIDE CHANNEL", "HTTP", "LEASES", "TOKENS"]
    _print_table(rows, [*header, "UNCAPTURED", "UNRETAINED"])
    return 0
