"""Input checks of the daemon's operations, each naming the field that is wrong.

Pure: no I/O. The domain operations run them before they touch etcd, and raise what
they raise (InvalidArgument, FailedPrecondition) to the caller.
"""

from __future__ import annotations

import base64
import binascii
import math
from typing import Any

from controlplane.errors import FailedPrecondition, InvalidArgument
from controlplane.policy import Policy, digest_problem, param_problems
from controlplane.records import NodeRecord, Role
from controlplane.settings import Limits
from kvferry.ids import id_problem
from kvferry.limits import MAX_BLOCK_SIZE, MAX_LIVENESS_TTL_S, MIN_LIVENESS_TTL_S
from kvferry.shards import DEFAULT_TENANT
from kvferry.urls import is_http_url

MAX_PAGE = 1000
MAX_URL_BYTES = 2048
#: Generations stay below this: increments of a registered one must fit a uint64 (and an int64).
MAX_GENERATION = 2**62


def check_id(name: str, value: str, max_bytes: int, required: bool = True) -> None:
    """An id (engine, conversation, tenant, request...): present unless optional, of at most
    `max_bytes`, with no control characters."""
    if not value:
        if required:
            raise InvalidArgument(f"{name} is required")
        return
    problem = id_problem(name, value, max_bytes)
    if problem:
        raise InvalidArgument(problem)


def tenant_of(tenant: str, max_bytes: int) -> str:
    """The tenant a request names ("" = the default one)."""
    check_id("tenant", tenant, max_bytes, required=False)
    return tenant or DEFAULT_TENANT


def role_of(value: int) -> Role:
    """A node's role as the API numbers it."""
    if value == Role.UNSPECIFIED:
        raise InvalidArgument("role is missing: give PREFILL, DECODE or BOTH")
    if value not in (Role.PREFILL, Role.DECODE, Role.BOTH):
        raise InvalidArgument(f"role {value} is not PREFILL, DECODE or BOTH")
    return Role(value)


def check_node(rec: NodeRecord, limits: Limits, default_ttl_s: int) -> int:
    """A node registration's record as asked. -> its liveness TTL (0 asks for `default_ttl_s`)."""
    check_id("engine_id", rec.engine_id, limits.max_id_bytes)
    if not 0 < rec.block_size <= MAX_BLOCK_SIZE:
        raise InvalidArgument(f"block_size {rec.block_size} must be in 1..{MAX_BLOCK_SIZE}")
    if not 0 < rec.side_channel_port < 65536:
        raise InvalidArgument(f"side_channel_port {rec.side_channel_port} is not a port number")
    check_id("side_channel_host", rec.side_channel_host, limits.max_id_bytes)
    check_id("model", rec.model, limits.max_id_bytes, required=False)
    for name, url in (("http_url", rec.http_url), ("engine_url", rec.engine_url)):
        if len(url.encode()) > MAX_URL_BYTES:
            raise InvalidArgument(f"{name} is longer than {MAX_URL_BYTES} bytes")
        if url and not is_http_url(url):
            raise InvalidArgument(f"{name} {url!r} must be an http:// or https:// URL with a host")
    ttl = rec.liveness_ttl or default_ttl_s
    if not MIN_LIVENESS_TTL_S <= ttl <= MAX_LIVENESS_TTL_S:
        raise InvalidArgument(
            f"liveness_ttl_seconds {ttl} must be in {MIN_LIVENESS_TTL_S}..{MAX_LIVENESS_TTL_S}"
        )
    if not (math.isfinite(rec.engine_started_at) and rec.engine_started_at >= 0):
        raise InvalidArgument(f"engine_started_at {rec.engine_started_at} must be a time (or 0)")
    if rec.generation >= MAX_GENERATION:
        # (the next one, previous + 1, must still fit the API's uint64)
        raise InvalidArgument(f"generation {rec.generation} must be below {MAX_GENERATION}")
    return ttl


def check_prompt(tokens: int, digests: bytes | None, max_tokens: int, required: bool = False) -> None:
    """A lookup's prompt: its length in tokens (`required`: one must be given) and its
    blocks' digests (None: not given)."""
    if not 0 <= tokens <= max_tokens:
        raise InvalidArgument(f"prompt_tokens {tokens} must be in 0..{max_tokens}")
    problem = digest_problem("prompt_digests", digests or b"")
    if problem:
        raise InvalidArgument(problem)
    if required and not tokens:
        raise InvalidArgument(
            "prompt_tokens is required: the length of the prompt P is about to compute "
            "(only a peek may leave it out)"
        )


def check_retention_size(num_tokens: int, params_bytes: int, limits: Limits) -> None:
    """A retention's size: its tokens, and its params' serialized bytes."""
    if not 0 < num_tokens <= limits.max_tokens:
        raise InvalidArgument(f"num_tokens {num_tokens} must be in 1..{limits.max_tokens}")
    if params_bytes > limits.max_params_bytes:
        raise InvalidArgument(f"kv_transfer_params are larger than {limits.max_params_bytes} bytes")


def check_record_size(params_bytes: int, digests_bytes: int, limits: Limits) -> None:
    """A retention's record as stored: etcd takes no larger one (`Limits.max_record_bytes`)."""
    stored = 4 * ((params_bytes + digests_bytes + 2) // 3) + 512  # (base64 in JSON, and the rest)
    if stored > limits.max_record_bytes:
        raise InvalidArgument(
            f"the retention's record would be about {stored} bytes, more than the store takes "
            f"({limits.max_record_bytes}): {digests_bytes} bytes of block digests and "
            f"{params_bytes} of kv_transfer_params"
        )


def deadline_of(expires_at: float | None, policy: Policy, now: float) -> float:
    """A retention's deadline as registered (None: the default lifetime from `now`)."""
    deadline = expires_at if expires_at is not None else now + policy.default_lifetime_s
    if deadline <= now:
        raise InvalidArgument(f"expires_at is {now - deadline:.1f}s in the past")
    if deadline > now + policy.max_lifetime_s:
        raise InvalidArgument(f"expires_at is more than {policy.max_lifetime_s:g}s ahead")
    return deadline


def check_on_node(
    node: NodeRecord,
    block_size: int,
    generation: int,
    num_tokens: int,
    digests: bytes,
    params: dict[str, Any],
) -> tuple[int, int]:
    """A retention registered on `node`: a decode node's, of its block size and current
    generation, with digests and params that fit its tokens. -> (block size, generation),
    a 0 in either meaning the node's."""
    if node.role == Role.PREFILL:
        raise FailedPrecondition(
            f"engine {node.engine_id} is a prefill node; retentions live on decode nodes"
        )
    block_size = block_size or node.block_size
    if block_size != node.block_size:
        raise InvalidArgument(f"block_size {block_size} differs from node's {node.block_size}")
    problem = digest_problem("block_digests", digests, num_tokens // block_size)
    if problem:
        raise InvalidArgument(problem)
    problems = param_problems(params, num_tokens, block_size)
    if problems:
        raise InvalidArgument("; ".join(problems))
    generation = generation or node.generation
    if generation != node.generation:
        raise FailedPrecondition(
            f"blocks are from generation {generation} of {node.engine_id}, which is now at {node.generation}"
        )
    return block_size, generation


def page_start(page_token: str, prefix: bytes) -> bytes:
    """Where a listing goes on from: the key a page token names (b"" = the start)."""
    if not page_token:
        return b""
    try:
        start = base64.urlsafe_b64decode(page_token.encode())
    except (binascii.Error, ValueError) as e:
        raise InvalidArgument("page_token is not a token this daemon issued") from e
    if not start.startswith(prefix):
        raise InvalidArgument("page_token belongs to another listing")
    return start


def page_token(start: bytes) -> str:
    """The token of the page that starts at key `start` ("" = there is none)."""
    return base64.urlsafe_b64encode(start).decode() if start else ""
