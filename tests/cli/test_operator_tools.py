"""What an operator types: grpcurl (the real binary from its package) and the kvferry CLI."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import structlog

from controlplane.daemon import Daemon
from kvferry.v1 import leases_pb2, nodes_pb2
from realvllm.process import free_port
from tests.conftest import Client, fake_completions
from tests.factories import lease_request, node_request

BIN = Path(sys.executable).parent


async def run(*cmd: str, stdin: str | None = None) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        *cmd,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(stdin.encode() if stdin else None), 60)
    return proc.returncode or 0, out.decode(), err.decode()


async def grpcurl(d: Daemon, *args: str) -> tuple[int, str, str]:
    return await run(str(BIN / "grpcurl"), "-plaintext", *args[:-1], d.address, args[-1])


async def test_grpcurl_lists_services_and_sees_leases_as_json(daemon: Daemon, client: Client) -> None:
    code, out, err = await run(str(BIN / "grpcurl"), "-plaintext", daemon.address, "list")
    assert code == 0, err
    assert {"kvferry.v1.Leases", "kvferry.v1.Nodes", "grpc.health.v1.Health"} <= set(out.split())

    await client.nodes.Register(node_request("d-1"))
    await client.leases.Register(lease_request("conv-grpcurl", tenant="acme"))
    code, out, err = await grpcurl(daemon, "-d", '{"tenant": "acme"}', "kvferry.v1.Leases/List")
    assert code == 0, err
    leases = json.loads(out)["leases"]
    assert [x["conversation_id"] for x in leases] == ["conv-grpcurl"]
    assert leases[0]["kv_transfer_params"]["remote_engine_id"] == "d-1", "params are JSON, not bytes"
    assert leases[0]["kv_transfer_params"]["remote_block_ids"][0][:2] == [100, 101]

    lookup = json.dumps({"tenant": "acme", "conversation_id": "conv-grpcurl", "prompt_tokens": 1200})
    code, out, err = await grpcurl(daemon, "-d", lookup, "kvferry.v1.Leases/Lookup")
    first = json.loads(out)
    assert code == 0 and first["decision"] == "PULL" and first["reusable_tokens"] == "1000", out
    code, out, err = await grpcurl(daemon, "-d", lookup, "kvferry.v1.Leases/Lookup")
    second = json.loads(out)
    assert second["decision"] == "RECOMPUTE" and second["reason"] == "already_claimed"

    code, out, _ = await grpcurl(
        daemon, "-d", '{"service": "kvferry.v1.Leases"}', "grpc.health.v1.Health/Check"
    )
    assert json.loads(out)["status"] == "SERVING"


async def test_grpcurl_bad_input_gets_invalid_argument(daemon: Daemon) -> None:
    code, _, err = await grpcurl(
        daemon, "-d", '{"conversation_id": "", "prompt_tokens": 5}', "kvferry.v1.Leases/Lookup"
    )
    assert code != 0 and "InvalidArgument" in err and "conversation_id is required" in err


async def test_cli_tables_and_json(daemon: Daemon, client: Client) -> None:
    await client.nodes.Register(node_request("d-1"))
    await client.leases.Register(lease_request("conv-cli"))
    kvferry = str(BIN / "kvferry")
    code, out, err = await run(kvferry, "nodes", "ls", "--daemon", daemon.address)
    assert code == 0, err
    assert out.splitlines()[0].split()[:2] == ["ENGINE", "ROLE"] and "d-1" in out and "DECODE" in out
    code, out, err = await run(kvferry, "leases", "ls", "--json", "--daemon", daemon.address)
    assert code == 0, err
    assert json.loads(out.splitlines()[0])["conversation_id"] == "conv-cli"
    # An engine's leases are listed whatever their tenant (behind a router with API keys
    # none is the default tenant's); --tenant narrows them.
    await client.leases.Register(lease_request("conv-keyed", tenant="key-1"))
    code, out, err = await run(
        kvferry, "leases", "ls", "--engine", "d-1", "--json", "--daemon", daemon.address
    )
    assert code == 0, err
    assert sorted(json.loads(line)["conversation_id"] for line in out.splitlines()) == [
        "conv-cli",
        "conv-keyed",
    ]
    code, out, _ = await run(
        kvferry, "leases", "ls", "--engine", "d-1", "--tenant", "key-1", "--json", "--daemon", daemon.address
    )
    assert [json.loads(line)["conversation_id"] for line in out.splitlines()] == ["conv-keyed"]
    code, _, err = await run(kvferry, "leases", "ls", "--limit", "-1", "--daemon", daemon.address)
    assert code == 2 and "must be 0 or more" in err
    code, _, err = await run(kvferry, "leases", "ls", "--log-level", "verbose", "--daemon", daemon.address)
    assert code == 2 and "invalid choice: 'verbose'" in err
    code, out, _ = await run(kvferry, "leases", "get", "conv-cli", "--json", "--daemon", daemon.address)
    got = json.loads(out)
    assert got["num_tokens"] == "1000"
    ids = got["kv_transfer_params"]["remote_block_ids"][0]
    assert ids and all(type(i) is int for i in ids)  # as grpcurl shows them, not 1.0, 2.0, ...
    code, out, _ = await run(kvferry, "leases", "revoke", "conv-cli", "--daemon", daemon.address)
    assert code == 0 and "revoked" in out
    code, out, _ = await run(kvferry, "leases", "revoke", "conv-cli", "--json", "--daemon", daemon.address)
    assert code == 2 and json.loads(out)["found"] is False  # every field, false ones too
    code, _, err = await run(kvferry, "leases", "get", "conv-cli", "--daemon", daemon.address)
    assert code == 2 and "NOT_FOUND" in err  # not found: 2, as for revoke and nodes rm
    code, _, err = await run(
        kvferry, "leases", "ls", "--tenant", "t", "--all-tenants", "--daemon", daemon.address
    )
    assert code == 2 and "not allowed with" in err
    code, out, _ = await run(kvferry, "nodes", "rm", "d-1", "--daemon", daemon.address)
    assert code == 0 and "deregistered" in out
    code, out, _ = await run(kvferry, "nodes", "ls", "--daemon", daemon.address)
    assert "d-1" not in out
    code, out, _ = await run(kvferry, "nodes", "rm", "d-1", "--json", "--daemon", daemon.address)
    assert code == 2 and json.loads(out)["found"] is False
    await _bad_ids_and_deadlines_exit_2(kvferry, daemon)


async def _bad_ids_and_deadlines_exit_2(kvferry: str, daemon: Daemon) -> None:
    """Ids no record can have and deadlines gRPC cannot take: exit 2 with an error line."""
    for action in (("leases", "get"), ("leases", "revoke"), ("nodes", "rm")):  # an id not UTF-8
        code, _, err = await run(
            kvferry, *action, b"\xff".decode("utf-8", "surrogateescape"), "--daemon", daemon.address
        )
        assert code == 2 and err.startswith("error: ") and "Traceback" not in err, (action, err)
    # An id the daemon refuses (empty: "$CONV" unset in a script) is bad input, not a daemon
    # failing: 2, not 1 (which a script may retry forever).
    for bad in ("", "x" * 300):
        code, _, err = await run(kvferry, "leases", "get", bad, "--daemon", daemon.address)
        assert code == 2 and "INVALID_ARGUMENT" in err, (bad[:5], err)
    # A deadline past what gRPC takes (every call failed at once) is refused up front.
    code, _, err = await run(kvferry, "leases", "ls", "--timeout", "1e10", "--daemon", daemon.address)
    assert code == 2 and "at most 86400" in err


async def test_cli_names_what_it_did_not_find_and_shows_what_a_claim_kept(
    daemon: Daemon, client: Client
) -> None:
    """A revoke or rm of nothing is an error on stderr naming what was looked for (exit 2,
    nothing on stdout); `get` of a claimed retention shows only what the daemon knows."""
    kvferry = str(BIN / "kvferry")
    code, out, err = await run(kvferry, "leases", "revoke", "conv-none", "--daemon", daemon.address)
    assert (code, out) == (2, "") and err.startswith("error: ")
    assert "'conv-none'" in err and "the default tenant" in err, err
    code, out, err = await run(
        kvferry, "leases", "revoke", "conv-none", "--tenant", "acme", "--daemon", daemon.address
    )
    assert (code, out) == (2, "") and "'conv-none'" in err and "tenant 'acme'" in err, err
    code, out, err = await run(kvferry, "nodes", "rm", "d-none", "--daemon", daemon.address)
    assert (code, out) == (2, "") and err.startswith("error: ") and "'d-none'" in err, err

    await client.nodes.Register(node_request("d-1"))
    await client.leases.Register(lease_request("conv-claimed"))
    lookup = leases_pb2.LookupRequest(conversation_id="conv-claimed", prompt_tokens=1200)
    assert (await client.leases.Lookup(lookup)).decision == leases_pb2.PULL
    code, out, err = await run(kvferry, "leases", "get", "conv-claimed", "--json", "--daemon", daemon.address)
    got = json.loads(out)
    assert code == 0 and got["claimed"] is True and got["conversation_id"] == "conv-claimed", err
    # (no zeros for what the claim marker does not know: tokens, params, block size)
    assert not {"num_tokens", "kv_transfer_params", "block_size", "generation"} & set(got), got


async def test_cli_revoke_sends_the_release_through_a_fitting_prefill_node(
    daemon: Daemon, client: Client
) -> None:
    """Which prefill node a revoke's release goes to, what it is sent, and what the CLI says
    when it cannot be sent (the lease is revoked all the same: exit 0)."""
    kvferry = str(BIN / "kvferry")

    async def revoke(conv: str, *flags: str) -> tuple[int, list[str]]:
        code, out, err = await run(kvferry, "leases", "revoke", conv, *flags, "--daemon", daemon.address)
        assert "Traceback" not in err, err
        return code, out.splitlines()

    async with fake_completions() as fake:
        p_url = fake.url
        await client.nodes.Register(node_request("d-1"))
        await client.nodes.Register(
            node_request("p-other", role=nodes_pb2.PREFILL, model="other", http_url=p_url)
        )
        for conv in ("c-none", "c-sent", "c-refused"):
            await client.leases.Register(lease_request(conv))
        code, lines = await revoke("c-none")
        assert code == 0 and lines[0] == "revoked" and "no alive prefill node serves 'test-model'" in lines[1]
        assert not fake.got

        # The engine's own URL refuses connections: the release goes through its sidecar's.
        await client.nodes.Register(
            node_request(
                "p-1", role=nodes_pb2.PREFILL, http_url=p_url, engine_url=f"http://127.0.0.1:{free_port()}"
            )
        )
        code, lines = await revoke("c-sent", "--engine-api-key", "k1")
        assert (code, lines) == (0, ["revoked", "D's blocks released through prefill node p-1"])
        [(body, auth)] = fake.got
        kv = body["kv_transfer_params"]
        assert auth == "Bearer k1" and body["model"] == "test-model" and body["max_tokens"] == 1
        assert kv["remote_num_tokens"] == 0 and kv["remote_engine_id"] == "d-1"
        # refused before admission (nothing kept on P), and the refusal notifies D
        assert body["stream"] is True and body["use_beam_search"] is True
        assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False
        assert kv["remote_block_ids"] == [list(range(100, 163))]  # D's blocks, every one
        assert all(type(i) is int for i in kv["remote_block_ids"][0])  # as ints, not 100.0

        fake.status = 503
        code, out, _ = await run(
            kvferry, "leases", "revoke", "c-refused", "--json", "--daemon", daemon.address
        )
        release = json.loads(out)["release"]
        assert code == 0 and release["sent"] is False and "HTTP 503" in release["detail"]
        assert not (await client.leases.List(leases_pb2.ListLeasesRequest())).leases


def test_global_log_level_reaches_delegated_commands(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from kvferry_cli import command

    seen: list[list[str]] = []
    monkeypatch.setitem(command.DELEGATED, "sidecar", (lambda argv: seen.append(argv) or 0, ""))
    assert command.main(["--log-level", "debug", "sidecar", "--engine-url", "http://e"]) == 0
    assert command.main(["--log-level=warning", "sidecar"]) == 0
    assert command.main(["sidecar", "--engine-url", "http://e"]) == 0
    assert seen == [
        ["--log-level", "debug", "--engine-url", "http://e"],
        ["--log-level=warning"],
        ["--engine-url", "http://e"],
    ]


def test_an_outage_is_logged_at_its_start_once_a_minute_and_at_its_end() -> None:
    from kvferry.logs import Outage

    o = Outage(every_s=60)
    assert o.ok(1.0) is None  # nothing was failing
    assert [o.failed(t) for t in (10.0, 10.5, 69.0, 70.0, 70.5)] == [True, False, False, True, False]
    assert o.ok(75.0) == 65.0
    assert o.failed(80.0)  # a new outage is news again


def test_an_outage_report_logs_the_news_only() -> None:
    from structlog.testing import capture_logs

    from kvferry.logs import Outage

    o = Outage(every_s=60)
    log = structlog.get_logger("t")
    with capture_logs() as logs:
        o.report(log, True, "x.failed", "x.recovered")  # nothing was failing: no line
        o.report(log, False, "x.failed", "x.recovered", error="boom")
        o.report(log, False, "x.failed", "x.recovered", error="boom")  # same outage: no line
        o.report(log, True, "x.failed", "x.recovered")
    assert [(e["event"], e["log_level"]) for e in logs] == [("x.failed", "warning"), ("x.recovered", "info")]
    assert logs[0]["error"] == "boom" and "failing_s" in logs[0] and "failed_s" in logs[1]
