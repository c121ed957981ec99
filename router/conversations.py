"""``DELETE /v1/conversations/{id}``: a client ends a conversation, and D frees the blocks
kept for its next turn now rather than at their deadline.

The conversation is the caller's, in the tenant its API key names: the router asks the
daemon to revoke its retention as a conversation's end (Leases/Revoke with
conversation_end, which a router may send for its own tenants only), and the daemon has
D's sidecar free the blocks. When that sidecar is attached to another daemon replica, the
daemon answers the release params instead and the router sends the release through a
prefill node itself (`router.releases`).

Answers, as OpenAI's conversation deletion: 200 ``{"id", "object":
"conversation.deleted", "deleted": true}``; 404 when nothing is retained of it (never,
no more, or a turn took it); 403 when the daemon refuses the tenant; 503 when there is no
daemon to ask or it does not answer.
"""

from __future__ import annotations

from typing import Any

import grpc
import structlog
from aiohttp import web

from kvferry.turnheaders import safe_id
from router.choice import choose_prefill
from router.daemon_client import Ended
from router.errors import error_response
from router.turn import Shared
from router.upstream import encode

log = structlog.get_logger(__name__)

PATH = "/v1/conversations/{conversation_id}"

_STATUS = {
    grpc.StatusCode.PERMISSION_DENIED: (403, "PermissionDeniedError"),
    grpc.StatusCode.UNAUTHENTICATED: (403, "PermissionDeniedError"),
    grpc.StatusCode.INVALID_ARGUMENT: (400, "BadRequestError"),
}


async def end_conversation(request: web.Request, shared: Shared, tenant: str) -> web.Response:
    """Revoke the conversation's retention and have D free its blocks."""
    named = request.match_info["conversation_id"].strip()
    if not named:
        return error_response(400, "name the conversation: DELETE /v1/conversations/{id}", "BadRequestError")
    if shared.daemon is None:
        return error_response(503, "this router has no daemon: it retains nothing", "ServiceUnavailableError")
    conversation = safe_id(named, "conv")
    try:
        ended = await shared.daemon.end_conversation(tenant, conversation)
    except grpc.aio.AioRpcError as e:
        status, kind = _STATUS.get(e.code(), (503, "ServiceUnavailableError"))
        log.warning("router.conversation_end.failed", conversation_id=conversation, code=e.code().name)
        return error_response(status, f"the daemon answered {e.code().name}: {e.details()}", kind)
    log.info(
        "router.conversation_end",
        conversation_id=conversation,
        found=ended.found,
        released_by_node=ended.released_by_node,
    )
    if not ended.found:
        return error_response(404, f"no turn of conversation {named!r} is retained", "NotFoundError")
    if ended.release_params:
        _release(shared, ended)
    return web.json_response({"id": named, "object": "conversation.deleted", "deleted": True})


def _release(shared: Shared, ended: Ended) -> None:
    """D's sidecar is not attached to the daemon replica that answered: the release goes
    through a prefill node of D's model and block size (best effort: D's TTL otherwise)."""
    nodes = shared.directory.nodes
    decode = next((n for n in nodes if n.engine_id == ended.engine_id), None)
    like = [n for n in nodes if n.prefills and (decode is None or n.model == decode.model)]
    node = choose_prefill(like, shared.load.view)
    if node is None:
        log.warning("router.conversation_end.no_prefill", engine_id=ended.engine_id)
        return
    headers = shared.engines.headers({}, f"kvf-end-{ended.engine_id}")

    async def post(body: dict[str, Any]) -> int:
        return (await shared.engines.post(node.url + "/v1/completions", encode(body), headers)).status

    params = ended.release_params or {}
    shared.releases.send(node, "end", node.model, params, post, shared.metrics.claim_releases, log)
