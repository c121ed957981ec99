"""The role table and the policy file: who may do what, and what a bad policy says."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvferry.security.policy import PolicyError, digest, identify, load_policy, parse_policy
from kvferry.security.roles import (
    Caller,
    Denial,
    Role,
    admin_denial,
    all_tenants_denial,
    method_denial,
    node_denial,
    revoke_denial,
    stream_op_denial,
    tenant_denial,
)

L, N = "/kvferry.v1.Leases/", "/kvferry.v1.Nodes/"
ROUTER = Caller("router-a", Role.ROUTER, tenants=frozenset({"acme"}))
SIDECAR = Caller("sidecar-d0", Role.SIDECAR, node="d0")
READER = Caller("grafana", Role.READER, tenants=frozenset({"*"}))
PEER = Caller("daemon", Role.DAEMON)
ADMIN = Caller("alice", Role.ADMIN)


@pytest.mark.parametrize(
    ("caller", "allowed", "refused"),
    [
        (
            ROUTER,
            # (Revoke: as a conversation's end, of its own tenants: `revoke_denial`)
            ["Leases/Lookup", "Leases/Stream", "Nodes/Score", "Nodes/List", "Leases/Get", "Leases/Revoke"],
            ["Leases/Register", "Nodes/Register", "Nodes/Deregister", "Nodes/Attach"],
        ),
        (
            SIDECAR,
            [
                "Nodes/Register",
                "Nodes/Attach",
                "Leases/Register",
                "Leases/Stream",
                "Nodes/List",
                "Leases/Held",
            ],
            ["Leases/Lookup", "Leases/Revoke", "Leases/List", "Nodes/Deregister", "Nodes/Score"],
        ),
        (
            READER,
            ["Leases/Get", "Leases/List", "Nodes/List"],
            ["Leases/Lookup", "Leases/Stream", "Leases/Revoke", "Nodes/Register"],
        ),
        (PEER, ["Nodes/Score", "Nodes/List"], ["Leases/Lookup", "Leases/List", "Nodes/Register"]),
        (ADMIN, ["Leases/Revoke", "Nodes/Deregister", "Leases/Lookup", "Nodes/Register"], []),
    ],
)
def test_each_role_calls_only_its_methods(caller: Caller, allowed: list[str], refused: list[str]) -> None:
    for m in allowed:
        assert method_denial(caller, f"/kvferry.v1.{m}") is None, m
    for m in refused:
        d = method_denial(caller, f"/kvferry.v1.{m}")
        assert d is not None and d.code == "permission_denied", m
        assert caller.name in d.message and m in d.message and "admin" in d.message


def test_anonymous_callers_get_only_health() -> None:
    assert method_denial(None, "/grpc.health.v1.Health/Check") is None
    d = method_denial(None, f"{L}List")
    assert (
        d == Denial("unauthenticated", d.message if d else "")
        and "client certificate or a bearer token" in d.message
    )
    refl = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
    assert method_denial(None, refl) is not None and method_denial(READER, refl) is None


def test_stream_ops_are_checked_one_by_one() -> None:
    assert stream_op_denial(ROUTER, "lookup") is None and stream_op_denial(ROUTER, "prompt") is None
    d = stream_op_denial(ROUTER, "register")
    assert d is not None and "may not send register" in d.message
    assert stream_op_denial(SIDECAR, "register") is None
    assert stream_op_denial(SIDECAR, "lookup") is not None


def test_tenants_bind_routers_and_readers() -> None:
    assert tenant_denial(ROUTER, "acme") is None
    d = tenant_denial(ROUTER, "globex")
    assert d is not None and "'globex'" in d.message and d.code == "permission_denied"
    assert tenant_denial(READER, "anything") is None and tenant_denial(ADMIN, "anything") is None
    assert tenant_denial(SIDECAR, "acme") is not None and tenant_denial(PEER, "acme") is not None
    assert all_tenants_denial(ROUTER) is not None and all_tenants_denial(READER) is None
    assert all_tenants_denial(ADMIN) is None


def test_a_sidecar_speaks_only_for_its_node() -> None:
    assert node_denial(SIDECAR, "d0") is None and node_denial(ADMIN, "p9") is None
    d = node_denial(SIDECAR, "p1")
    assert d is not None and "only for node 'd0', not 'p1'" in d.message
    d = node_denial(ROUTER, "d0")
    assert d is not None and "only its sidecar may" in d.message


def test_admin_actions() -> None:
    assert admin_denial(ADMIN, "reset the prefix cache") is None
    d = admin_denial(ROUTER, "reset the prefix cache")
    assert d is not None and d.code == "permission_denied" and "needs role admin" in d.message
    d = admin_denial(None, "reset the prefix cache")
    assert d is not None and d.code == "unauthenticated"


POLICY = f"""
[identities.sidecar-d0]
role = "sidecar"
node = "d0"
[identities.router]
role = "router"
tenants = ["acme"]
[identities.alice]
role = "admin"
token_sha256 = "{digest("alice-secret")}"
[clients.acme-prod]
key_sha256 = "{digest("sk-acme")}"
tenant = "acme"
"""


def test_a_policy_file_names_callers_tokens_and_keys(tmp_path: Path) -> None:
    path = tmp_path / "policy.toml"
    path.write_text(POLICY)
    p = load_policy(path)
    assert p.by_certificate("sidecar-d0") == SIDECAR
    assert p.by_certificate("router") == Caller("router", Role.ROUTER, tenants=frozenset({"acme"}))
    assert p.by_certificate("stranger") is None and p.by_certificate(None) is None
    assert p.by_token("alice-secret") == Caller("alice", Role.ADMIN)
    assert p.by_token("guess") is None and p.by_token("") is None
    assert p.tenant_of_key("sk-acme") == "acme" and p.tenant_of_key("sk-other") is None
    assert "alice-secret" not in repr(p) and "sk-acme" not in repr(p)


def test_identify_prefers_a_token_and_never_falls_back(tmp_path: Path) -> None:
    p = parse_policy(__import__("tomllib").loads(POLICY))
    assert identify(None, "", None) == Caller.DEVELOPMENT
    assert identify(p, "alice-secret", "sidecar-d0") == Caller("alice", Role.ADMIN)
    bad = identify(p, "wrong", "sidecar-d0")
    assert isinstance(bad, Denial) and bad.code == "unauthenticated" and "bearer token" in bad.message
    assert identify(p, "", "sidecar-d0") == SIDECAR
    none = identify(p, "", None)
    assert isinstance(none, Denial) and "client certificate or a bearer token" in none.message
    stranger = identify(p, "", "mallory")
    assert isinstance(stranger, Denial) and "'mallory' is not an identity" in stranger.message


TWIN = '[identities.{}]\nrole = "admin"\ntoken_sha256 = "' + "a" * 64 + '"'


TWIN = '[identities.{}]\nrole = "admin"\ntoken_sha256 = "' + "a" * 64 + '"'


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ('[identities.x]\nrole = "wizard"', "identities.x.role must be one of"),
        ('[identities.x]\nrole = "sidecar"', "node (the engine id it speaks for) is required"),
        ('[identities.x]\nrole = "router"', "tenants"),
        ('[identities.x]\nrole = "admin"\nnode = "d0"', "only for one"),
        ('[identities.x]\nrole = "admin"\ncolour = "red"', "unknown key(s) ['colour']"),
        ('[identities.x]\nrole = "admin"\ntoken_sha256 = "abc"', "must be a SHA-256 hex digest"),
        (
            TWIN.format("x") + "\n" + TWIN.format("y"),
            "also x's",
        ),
        (
            '[clients.c]\nkey_sha256 = "' + "b" * 64 + '"\ntenant = "*"',
            "clients.c.tenant must be a tenant name",
        ),
        ("[users.x]\nrole = 1", "unknown table(s) ['users']"),
        ("identities = 3", "must hold tables"),
        ("[identities.x\n", "not valid TOML"),
    ],
)
def test_a_bad_policy_names_its_entry(tmp_path: Path, text: str, says: str) -> None:
    path = tmp_path / "policy.toml"
    path.write_text(text)
    with pytest.raises(PolicyError) as e:
        load_policy(path)
    assert says in str(e.value) and str(path) in str(e.value)


def test_a_missing_policy_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="No such file"):
        load_policy(tmp_path / "absent.toml")


def test_a_router_revokes_only_its_tenants_conversations_as_their_end() -> None:
    assert revoke_denial(ROUTER, "acme", conversation_end=True) is None
    plain = revoke_denial(ROUTER, "acme", conversation_end=False)
    assert plain == Denial(
        "permission_denied",
        "identity 'router-a' (role router) may revoke a retention only as a conversation's end "
        "(conversation_end)",
    )
    other = revoke_denial(ROUTER, "globex", conversation_end=True)
    assert other == Denial(
        "permission_denied", "identity 'router-a' (role router) may not act for tenant 'globex'"
    )
    assert revoke_denial(ADMIN, "globex", conversation_end=False) is None
