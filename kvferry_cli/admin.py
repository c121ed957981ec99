"""`kvferry leases ...` and `kvferry nodes ...`: thin gRPC clients that print tables or JSON.

`leases` is the command word (as the daemon's Leases service): what it lists, shows and
revokes are retentions, D's blocks kept for a conversation. A revoke also frees those
blocks through a prefill node (`kvferry_cli.release`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import grpc
from google.protobuf import json_format

from kvferry import logs
from kvferry.digests import DIGEST_SIZE
from kvferry.flags import non_negative_int, seconds
from kvferry.structs import json_number
from kvferry.v1 import leases_pb2, leases_pb2_grpc, nodes_pb2, nodes_pb2_grpc
from kvferry_cli import access
from kvferry_cli.release import ReleaseOptions, release_revoked

EXIT_CODES = "exit status: 0 done, 1 the daemon failed or is unreachable, 2 not found, refused or bad input"
_LIST_JSON = "print JSON, one object per line, instead of a table"
_ANSWER_JSON = "print the daemon's answer as JSON on one line"


def add_arguments(sub: Any) -> None:
    """Add the `leases` and `nodes` commands to the `kvferry` command's subparsers."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--daemon", default="127.0.0.1:50051", help="daemon address host:port")
    common.add_argument("--timeout", type=seconds, default=5.0, help="seconds to wait for each daemon call")
    access.add_flags(common)
    logs.add_level_flag(common, default=argparse.SUPPRESS)

    def command(parent: Any, name: str, help_text: str, json_help: str) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = parent.add_parser(
            name, parents=[common], help=help_text, epilog=EXIT_CODES
        )
        p.add_argument("--json", action="store_true", help=json_help)
        return p

    retentions = sub.add_parser(
        "leases", help="inspect and revoke retentions (D's blocks kept for a conversation)"
    )
    rsub = retentions.add_subparsers(dest="action", required=True)
    ls = command(rsub, "ls", "list retentions", _LIST_JSON)
    which = ls.add_mutually_exclusive_group()
    which.add_argument(
        "--tenant",
        default="",
        help="the tenant's retentions (default: the default tenant's; with --engine, every tenant's)",
    )
    which.add_argument("--all-tenants", action="store_true", help="every tenant's retentions")
    ls.add_argument(
        "--engine", default="", help="only retentions held on this engine id, of every tenant unless --tenant"
    )
    ls.add_argument("--inactive", action="store_true", help="include expired retentions not yet collected")
    ls.add_argument("--limit", type=non_negative_int, default=0, help="stop after this many (0 = all)")
    get = command(
        rsub, "get", "show one conversation's retention", "print it on one line (default: indented JSON)"
    )
    revoke = command(rsub, "revoke", "revoke one conversation's retention and free D's blocks", _ANSWER_JSON)
    for p in (get, revoke):
        p.add_argument("conversation_id")
        p.add_argument("--tenant", default="")
    _release_flags(revoke)
    retentions.set_defaults(func=_retentions)

    nodes = sub.add_parser("nodes", help="inspect registered nodes")
    nsub = nodes.add_subparsers(dest="action", required=True)
    nls = command(nsub, "ls", "list nodes", _LIST_JSON)
    nls.add_argument("--all", action="store_true", help="include nodes whose liveness lapsed")
    nrm = command(
        nsub,
        "rm",
        "deregister a node: its liveness ends and its retentions die with it (D keeps their blocks to "
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


def _retention_dict(retention: leases_pb2.Lease) -> dict[str, Any]:
    """A retention as `_as_dict` shows it; a claimed one (its record gone, only the claim
    marker left) with only the fields the daemon filled in (when it was claimed, and what
    the marker kept: the engine, the request), not zeros that would read as facts."""
    if not retention.claimed:
        return _as_dict(retention)
    known = json_format.MessageToDict(retention, preserving_proto_field_name=True)
    return _integral(known)  # type: ignore[no-any-return]


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
    {
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
    }
)


def _bad_input(e: Exception) -> int:
    """An argument no request can carry (not UTF-8, say), or an answer JSON cannot show
    (a NaN a daemon stored before it refused them): one line, not a traceback."""
    print(f"error: {e}", file=sys.stderr)
    return 2


def _channel(a: argparse.Namespace) -> grpc.Channel | None:
    """The channel the flags ask for (None: they are wrong, and that was said)."""
    try:
        return access.daemon_channel(a)
    except ValueError as e:
        _bad_input(e)
        return None


def _retentions(a: argparse.Namespace) -> int:
    channel = _channel(a)
    if channel is None:
        return 2
    with channel as ch:
        stub = leases_pb2_grpc.LeasesStub(ch)
        try:
            if a.action == "ls":
                return _list_retentions(stub, a)
            if a.action == "get":
                retention = stub.Get(
                    leases_pb2.GetLeaseRequest(tenant=a.tenant, conversation_id=a.conversation_id),
                    timeout=a.timeout,
                )
                print(json.dumps(_retention_dict(retention), indent=None if a.json else 2))
                return 0
            return _revoke(stub, nodes_pb2_grpc.NodesStub(ch), a)
        except grpc.RpcError as e:
            return _fail(e)
        except (ValueError, json_format.Error) as e:
            return _bad_input(e)


def _revoke(stub: leases_pb2_grpc.LeasesStub, nodes: nodes_pb2_grpc.NodesStub, a: argparse.Namespace) -> int:
    """Revoke the retention, then (unless --no-release) free D's blocks now rather than at
    D's TTL: a prefill node of D's model and block size is handed the release params
    with nothing to pull, and its connector only notifies D (as the router and the
    sidecars release blocks). The release is best effort: the retention is revoked either
    way, and the exit status is 0 (`release.sent` in --json says whether it went)."""
    resp = stub.Revoke(
        leases_pb2.RevokeLeaseRequest(tenant=a.tenant, conversation_id=a.conversation_id),
        timeout=a.timeout,
    )
    if not resp.found:
        whose = f"tenant {a.tenant!r}" if a.tenant else "the default tenant"
        return _removed(
            resp, a.json, "revoked", f"no retention of conversation {a.conversation_id!r} of {whose}"
        )
    if a.no_release:
        sent, how = False, "--no-release"
    else:
        options = ReleaseOptions(a.timeout, a.engine_api_key, a.release_timeout)
        sent, how = release_revoked(nodes, resp, options)
    if a.json:
        print(json.dumps({**_as_dict(resp), "release": {"sent": sent, "detail": how}}))
    else:
        print("revoked")
        if not a.no_release:
            print(f"D's blocks released {how}" if sent else f"D's blocks not released: {how}")
    return 0


def _removed(resp: Any, as_json: bool, done: str, missing: str) -> int:
    """Report a removal (a response with `found`): exit 0, or 2 when there was nothing to
    remove. --json prints the answer on stdout either way; else `done` goes to stdout,
    `missing` (what was not found) to stderr as an error."""
    if as_json:
        print(json.dumps(_as_dict(resp)))
    elif resp.found:
        print(done)
    else:
        print(f"error: {missing}", file=sys.stderr)
    return 0 if resp.found else 2


def _list_retentions(stub: leases_pb2_grpc.LeasesStub, a: argparse.Namespace) -> int:
    rows: list[list[str]] = []
    token = ""
    count = 0
    while True:
        resp = stub.List(
            leases_pb2.ListLeasesRequest(
                tenant=a.tenant,
                # (an engine's retentions are whosever they are: behind a router with API keys
                # no tenant is the default one)
                all_tenants=a.all_tenants or bool(a.engine and not a.tenant),
                engine_id=a.engine,
                include_inactive=a.inactive,
                page_size=500,
                page_token=token,
            ),
            timeout=a.timeout,
        )
        for retention in resp.leases:
            count += 1
            if a.json:
                print(json.dumps(_as_dict(retention)))
            else:
                rows.append(
                    [
                        retention.tenant,
                        retention.conversation_id,
                        retention.engine_id,
                        str(retention.generation),
                        str(retention.num_tokens),
                        str(len(retention.block_digests) // DIGEST_SIZE),
                        retention.expires_at.ToDatetime().strftime("%Y-%m-%d %H:%M:%S"),
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
    channel = _channel(a)
    if channel is None:
        return 2
    with channel as ch:
        stub = nodes_pb2_grpc.NodesStub(ch)
        try:
            if a.action == "rm":
                gone = stub.Deregister(
                    nodes_pb2.DeregisterNodeRequest(engine_id=a.engine_id), timeout=a.timeout
                )
                return _removed(gone, a.json, "deregistered", f"no node {a.engine_id!r} is registered")
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
    # answers without kv_transfer_params; UNRETAINED: the blocks they and the registrations
    # the sidecar gave up on pin now, with no retention naming them)
    header = ["ENGINE", "ROLE", "MODEL", "GEN", "ALIVE", "SIDE CHANNEL", "HTTP", "LEASES", "TOKENS"]
    _print_table(rows, [*header, "UNCAPTURED", "UNRETAINED"])
    return 0
