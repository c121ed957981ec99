"""Who may use the tap, and for which tenant: pure decisions over the policy, no I/O.

In development mode (no policy file) every caller is the development admin and the
tenant header is taken as sent, as before issue 21. With a policy:

- The caller is the identity its verified client certificate names; else the one its
  bearer token names (``Authorization: Bearer <token>``, for people with curl). The
  certificate comes first here, unlike the daemon: on the tap, Authorization also
  carries vLLM's --api-key, which a router with a certificate relays to the engine. A
  token that named the caller is not passed on to the engine.
- Anyone, anonymous included, may GET /health (probes without a certificate); serving
  paths need role router, sidecar (releases through a prefill node) or admin; metrics,
  any identity; administrative paths, role admin.
- A request naming a tenant (the router's ``X-Kvferry-Tenant`` or the configured tenant
  header) is refused (403) unless its caller may act for that tenant: a router for its
  tenants, an admin for all. Refused rather than passed on as the default tenant, so that
  a wrong deployment shows at once instead of mixing tenants. A request naming none
  is the default tenant's.

A denial says what was missing; the gate answers it with 401 or 403 and an audit line.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvferry.security.policy import Policy
from kvferry.security.roles import Caller, Denial, Role, admin_denial, anonymous, tenant_denial
from kvferry.turnheaders import tapped_tenant
from sidecar.paths import Access, Route

#: Roles that may send a node serving requests.
SERVING_ROLES = frozenset({Role.ROUTER, Role.SIDECAR, Role.ADMIN})
#: The one path anonymous callers may use: health probes (kubelet's carry no certificate).
OPEN_PATH = "/health"


def caller_of(policy: Policy | None, common_name: str | None, token: str) -> Caller | Denial:
    """Who a request comes from, by its verified certificate's CN, else its bearer token."""
    if policy is None:
        return Caller.DEVELOPMENT
    by_cert = policy.by_certificate(common_name)
    if by_cert is not None:
        return by_cert
    if token:
        by_token = policy.by_token(token)
        return by_token if by_token is not None else anonymous("the bearer token is not one of the policy's")
    if common_name is not None:
        return anonymous(f"certificate CN {common_name!r} is not an identity of the policy")
    return anonymous("present a client certificate or a bearer token of the policy")


def path_denial(caller: Caller | Denial, route: Route, method: str, path: str) -> Denial | None:
    """May `caller` (a Denial: unidentified) call `path`, of `route`?"""
    if isinstance(caller, Denial):
        return None if path == OPEN_PATH else caller
    if route.access is Access.ADMIN:
        return admin_denial(caller, f"call {method} {path}")
    if route.access is Access.SERVE and caller.role not in SERVING_ROLES:
        return Denial(
            "permission_denied",
            f"{caller.describe()} may not call {path}: it needs role router, sidecar or admin",
        )
    return None


def tenant_of(
    policy: Policy | None, caller: Caller, headers: Mapping[str, str], tenant_header: str
) -> str | Denial:
    """The tenant a request names ("" = the default), or why its caller may not name it."""
    tenant = tapped_tenant(headers, tenant_header)
    if policy is None or not tenant:
        return tenant
    if caller.role is not Role.ROUTER and caller.role is not Role.ADMIN:
        return Denial("permission_denied", f"{caller.describe()} may not name a tenant: only a router may")
    denial = tenant_denial(caller, tenant)
    return tenant if denial is None else denial
