"""The operator's policy file: identities, their roles, bearer tokens, and API keys.

A TOML file (see README "Security model")::

    [identities.sidecar-d0]     # the CN of a client certificate, or a token's name
    role = "sidecar"
    node = "d0"
    [identities.router]
    role = "router"
    tenants = ["*"]
    [identities.alice]
    role = "admin"
    token_sha256 = "<sha256 hex of alice's bearer token>"
    [clients.acme-prod]         # the router: a client's API key -> its tenant
    key_sha256 = "<sha256 hex of the key>"
    tenant = "acme"

Only digests of secrets are kept in the file and in memory. Loading checks everything and
names the first bad entry (`PolicyError`); a policy that loads is complete.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from kvferry.security.roles import ALL_TENANTS, Caller, Denial, Role, anonymous

_T = TypeVar("_T")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_IDENTITY_KEYS = {"role", "node", "tenants", "token_sha256"}
_CLIENT_KEYS = {"key_sha256", "tenant"}


class PolicyError(ValueError):
    """The policy file is missing, unreadable or wrong; the message names the entry."""


def digest(secret: str) -> str:
    """The SHA-256 hex digest a policy file lists for a bearer token or an API key."""
    return hashlib.sha256(secret.encode()).hexdigest()


@dataclass(frozen=True)
class Policy:
    """A loaded policy: who is who, by certificate name, by token, and by API key."""

    identities: Mapping[str, Caller]
    """By certificate Common Name (= the identity's name)."""
    tokens: Mapping[str, Caller]
    """By the SHA-256 hex digest of a bearer token."""
    clients: Mapping[str, str]
    """The router's API keys: SHA-256 hex digest of a key -> its tenant."""

    def by_certificate(self, common_name: str | None) -> Caller | None:
        """The caller a verified client certificate names (None: not in the policy)."""
        return None if common_name is None else self.identities.get(common_name)

    def by_token(self, token: str) -> Caller | None:
        """The caller a bearer token names (None: empty or not in the policy)."""
        return _find(self.tokens, token) if token else None

    def tenant_of_key(self, key: str) -> str | None:
        """The tenant an API key belongs to (None: empty or not in the policy)."""
        return _find(self.clients, key) if key else None


def _find(by_digest: Mapping[str, _T], secret: str) -> _T | None:
    wanted = digest(secret)
    for d, value in by_digest.items():  # (compared in constant time, one by one)
        if hmac.compare_digest(d, wanted):
            return value
    return None


def load_policy(path: Path) -> Policy:
    """Read and check the policy file at `path`."""
    try:
        data = tomllib.loads(path.read_text())
    except OSError as e:
        raise PolicyError(f"policy file {path}: {e.strerror or e}") from e
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise PolicyError(f"policy file {path} is not valid TOML: {e}") from e
    return parse_policy(data, str(path))


def parse_policy(data: Mapping[str, Any], where: str = "policy") -> Policy:
    """Check a parsed policy document and build the `Policy`."""
    unknown = set(data) - {"identities", "clients"}
    if unknown:
        raise PolicyError(
            f"{where}: unknown table(s) {sorted(unknown)}: expected [identities.*] and [clients.*]"
        )
    identities: dict[str, Caller] = {}
    tokens: dict[str, Caller] = {}
    for name, entry in _tables(data, "identities", where).items():
        caller, token = _identity(name, entry, where)
        identities[name] = caller
        if token:
            if token in tokens:
                raise PolicyError(f"{where}: identities.{name}: token_sha256 is also {tokens[token].name}'s")
            tokens[token] = caller
    clients: dict[str, str] = {}
    for name, entry in _tables(data, "clients", where).items():
        _only(entry, _CLIENT_KEYS, f"{where}: clients.{name}")
        key = _hex(entry.get("key_sha256"), f"{where}: clients.{name}.key_sha256")
        tenant = entry.get("tenant")
        if not isinstance(tenant, str) or not tenant or tenant == ALL_TENANTS:
            raise PolicyError(f"{where}: clients.{name}.tenant must be a tenant name")
        if key in clients:
            raise PolicyError(f"{where}: clients.{name}: key_sha256 is listed twice")
        clients[key] = tenant
    return Policy(identities, tokens, clients)


def _tables(data: Mapping[str, Any], name: str, where: str) -> dict[str, dict[str, Any]]:
    tables = data.get(name, {})
    if not isinstance(tables, dict) or not all(isinstance(v, dict) for v in tables.values()):
        raise PolicyError(f"{where}: [{name}] must hold tables, as [{name}.NAME]")
    return tables


def _only(entry: Mapping[str, Any], allowed: set[str], where: str) -> None:
    unknown = set(entry) - allowed
    if unknown:
        raise PolicyError(f"{where}: unknown key(s) {sorted(unknown)}: allowed are {sorted(allowed)}")


def _hex(value: object, where: str) -> str:
    if not isinstance(value, str) or not _HEX64.match(value.lower()):
        raise PolicyError(f"{where} must be a SHA-256 hex digest (64 hex digits), e.g. from `sha256sum`")
    return value.lower()


def _identity(name: str, entry: Mapping[str, Any], where: str) -> tuple[Caller, str]:
    at = f"{where}: identities.{name}"
    _only(entry, _IDENTITY_KEYS, at)
    try:
        role = Role(str(entry.get("role")))
    except ValueError:
        raise PolicyError(f"{at}.role must be one of {[r.value for r in Role]}") from None
    node = entry.get("node", "")
    tenants = entry.get("tenants", [])
    if not isinstance(node, str) or (role is Role.SIDECAR) != bool(node):
        raise PolicyError(
            f"{at}: node (the engine id it speaks for) is required for a sidecar, and only for one"
        )
    ok = isinstance(tenants, list) and all(isinstance(t, str) and t for t in tenants)
    if not ok or (role in (Role.ROUTER, Role.READER)) != bool(tenants):
        raise PolicyError(
            f'{at}: tenants (a list; ["*"] = all) is required for a router or reader, and only for one'
        )
    token = _hex(entry["token_sha256"], f"{at}.token_sha256") if "token_sha256" in entry else ""
    return Caller(name, role, node, frozenset(tenants)), token


def identify(policy: Policy | None, token: str, common_name: str | None) -> Caller | Denial:
    """Who a request comes from: development mode (no policy) trusts everyone as an admin;
    else a presented bearer token names the caller (an unknown one is refused, never passed
    over for the certificate), then the verified client certificate's Common Name."""
    if policy is None:
        return Caller.DEVELOPMENT
    if token:
        by_token = policy.by_token(token)
        return by_token if by_token is not None else anonymous("the bearer token is not one of the policy's")
    if common_name is None:
        return anonymous("present a client certificate or a bearer token of the policy")
    caller = policy.by_certificate(common_name)
    if caller is None:
        return anonymous(f"certificate CN {common_name!r} is not an identity of the policy")
    return caller
