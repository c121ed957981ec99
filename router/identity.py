"""Who is talking and about which conversation, from a request's key, headers and body. Pure.

The conversation is the one `kvferry.turnheaders.conversation_of` reads (D's
sidecar reads it the same way). No conversation: plain P/D serving.

The tenant comes from the client's API key (``Authorization: Bearer ...``)
alone, never from a header the client chose (the front door drops every
``X-Kvferry-*`` header a client sends: `kvferry.turnheaders.internal_header`).
`ApiKeys` says which keys get in and the tenant of each:

- keys given with ``--api-key``: the tenant is a digest of the key (`key_tenant`),
  never the key itself;
- keys of the policy file's ``[clients.*]`` table (their SHA-256 digests): the
  tenant the operator named there;
- any other key, or none: 401.

With no key configured at all and no policy file (development), every client gets
in: one that presents a key still gets that key's digest as its tenant (a client
cannot name a tenant without its key: the engines may check the key, as vLLM's
--api-key does), one without is the daemon's default tenant. With a policy file, a
client needs a key even when the policy lists none.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvferry.turnheaders import conversation_of, key_tenant, safe_id


@dataclass(frozen=True)
class Identity:
    """A request's tenant ("" = default) and conversation ("" = none)."""

    tenant: str
    conversation_id: str


def api_key_of(headers: Mapping[str, str]) -> str:
    """The bearer key of a request ("" = none)."""
    auth = headers.get("Authorization", "")
    scheme, _, key = auth.strip().partition(" ")
    return key.strip() if scheme.lower() == "bearer" else ""


def key_digest(key: str) -> bytes:
    """The SHA-256 digest of an API key (what a policy file lists, in hex)."""
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


@dataclass(frozen=True)
class ApiKeys:
    """The API keys the router takes, and the tenant each one's holder is."""

    plain: tuple[bytes, ...] = ()
    """Digests of the ``--api-key`` keys: their holders' tenant is named after the key."""
    clients: tuple[tuple[bytes, str], ...] = ()
    """(digest, tenant) of the policy's clients: their holders' tenant is the one named."""
    required: bool = False
    """A client needs a key even when none is listed (a policy file was given)."""

    @classmethod
    def of(cls, keys: Iterable[str], clients: Mapping[str, str] | None = None) -> ApiKeys:
        """From plain keys, and a policy's clients (hex SHA-256 digest -> tenant; given,
        even empty, every client needs a key)."""
        named = tuple((bytes.fromhex(digest), tenant) for digest, tenant in (clients or {}).items())
        return cls(tuple(key_digest(k) for k in keys), named, clients is not None)

    @property
    def checked(self) -> bool:
        """Whether a client needs one of these keys (none configured: development, open)."""
        return bool(self.plain or self.clients or self.required)

    def tenant_of(self, key: str) -> str | None:
        """The tenant of a client presenting `key` ("" = none given): its tenant ("" = the
        daemon's default), or None when it may not get in."""
        if not self.checked:
            return key_tenant(key) if key else ""
        if not key:
            return None
        digest = key_digest(key)
        # Every digest compared, in constant time: the timing tells neither a key nor which.
        plain = sum(hmac.compare_digest(digest, k) for k in self.plain)
        named = ""
        for k, tenant in self.clients:
            if hmac.compare_digest(digest, k):
                named = tenant
        if named:
            return safe_id(named, "tenant")
        return key_tenant(key) if plain else None


def identify(headers: Mapping[str, str], body: Mapping[str, Any], tenant: str) -> Identity:
    """Tenant and conversation of one request whose client's tenant is `tenant`."""
    conversation = conversation_of(headers, body)
    return Identity(tenant if conversation else "", conversation)
