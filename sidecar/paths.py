"""Which request targets the tap serves, and to whom: one pure table, no I/O.

The tap proxies vLLM's serving routes (what the router and other sidecars send a node:
generation, tokenizing, the model list, health and version) to anyone the tap lets in.
vLLM's administrative routes (cache resets, sleep, profiling, RPCs into the workers,
LoRA loading) change the engine for every tenant: they need the admin role (in
development mode every caller is admin). Metrics (the engine's ``/metrics``, the
sidecar's own ``/kvferry/metrics``) are for observers. Anything else is not proxied at
all: a 404, whatever the engine would have said.

A path matches only as sent, byte for byte (no percent-decoding, no dot segments): the
engine receives exactly the path checked here. The target must be in origin form
(``/path?query``); an absolute-form target (``POST http://evil/v1/completions``), an
authority-form or an asterisk-form one is refused with a 400.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Access(enum.Enum):
    """Who may call a path."""

    SERVE = "serve"
    """Serving routes: any caller the tap lets in (in secure mode, routers, sidecars, admins)."""
    OBSERVE = "observe"
    """Metrics: any caller the tap lets in."""
    ADMIN = "admin"
    """Administrative routes: the admin role only."""


@dataclass(frozen=True)
class Route:
    """One path of the table."""

    access: Access
    methods: frozenset[str]
    """Methods taken (HEAD goes with GET)."""
    local: bool = False
    """Answered by the sidecar itself, not proxied."""


_GET = frozenset({"GET", "HEAD"})
_POST = frozenset({"POST"})

METRICS_PATH = "/kvferry/metrics"
"""The sidecar's own metrics."""

ROUTES: dict[str, Route] = {
    # -- serving (vLLM's OpenAI server: what the router and sidecars send a node) --
    "/v1/chat/completions": Route(Access.SERVE, _POST),
    "/v1/completions": Route(Access.SERVE, _POST),
    "/v1/models": Route(Access.SERVE, _GET),
    "/tokenize": Route(Access.SERVE, _POST),
    "/detokenize": Route(Access.SERVE, _POST),
    "/health": Route(Access.SERVE, _GET),
    "/version": Route(Access.SERVE, _GET),
    # -- observing --
    "/metrics": Route(Access.OBSERVE, _GET),
    METRICS_PATH: Route(Access.OBSERVE, _GET, local=True),
    # -- administrative (vLLM's dev and operator routes) --
    "/reset_prefix_cache": Route(Access.ADMIN, _POST),
    "/reset_mm_cache": Route(Access.ADMIN, _POST),
    "/sleep": Route(Access.ADMIN, _POST),
    "/wake_up": Route(Access.ADMIN, _POST),
    "/is_sleeping": Route(Access.ADMIN, _GET),
    "/collective_rpc": Route(Access.ADMIN, _POST),
    "/start_profile": Route(Access.ADMIN, _POST),
    "/stop_profile": Route(Access.ADMIN, _POST),
    "/v1/load_lora_adapter": Route(Access.ADMIN, _POST),
    "/v1/unload_lora_adapter": Route(Access.ADMIN, _POST),
    "/scale_elastic_ep": Route(Access.ADMIN, _POST),
    "/is_scaling_elastic_ep": Route(Access.ADMIN, _POST),
    "/server_info": Route(Access.ADMIN, _GET),
    "/pause": Route(Access.ADMIN, _POST),
    "/resume": Route(Access.ADMIN, _POST),
    "/is_paused": Route(Access.ADMIN, _GET),
}
"""Every path the tap answers, by the path as sent."""


@dataclass(frozen=True)
class Refusal:
    """A request the tap does not pass on: its status and what to tell the caller."""

    status: int
    message: str
    allow: str = ""
    """For a 405: the methods the path takes (the Allow header)."""


def target_problem(raw_target: str) -> str | None:
    """What is wrong with a request target the tap would pass on, or None.

    Only origin form is taken: a path starting with one "/" (``//host/...`` reads as a
    network path to URL parsers on the way)."""
    if raw_target.startswith("/") and not raw_target.startswith("//"):
        return None
    shown = raw_target if len(raw_target) <= 80 else raw_target[:80] + "..."
    return (
        f"request target {shown!r} is not in origin form (/path?query): absolute-form targets are not served"
    )


def route_of(method: str, raw_target: str) -> Route | Refusal:
    """The route a request goes to, or why it is refused (400, 404 or 405)."""
    problem = target_problem(raw_target)
    if problem is not None:
        return Refusal(400, problem)
    path = raw_target.partition("?")[0]
    route = ROUTES.get(path)
    if route is None:
        shown = path if len(path) <= 80 else path[:80] + "..."
        return Refusal(404, f"path {shown!r} is not served by the sidecar")
    if method not in route.methods:
        allow = ", ".join(sorted(route.methods))
        return Refusal(405, f"method {method} is not allowed on {path} (allowed: {allow})", allow)
    return route
