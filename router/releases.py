"""The router's releases: blocks an engine keeps for a turn that no request will carry,
freed now rather than at the holder's timeout.

Two kinds, both sent as `kvferry.releases` describes (a request refused before
admission, whose connector notifies the holder):

- `release_prefill`: D refused the turn, so nothing will pull what P kept for it; the
  release goes through D, with P's params.
- `release_claim`: the daemon claimed the conversation's blocks on D for the turn, and
  no P request will carry them (the lookup answered late, the client left, P failed the
  request that carried them); the release goes through a P, with D's params.

Each is sent in the background, best effort, at most `max_releases_in_flight` at once
(`Releases`); a stop waits for those on their way as long as its grace allows.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import structlog
from prometheus_client import Counter
from structlog.typing import FilteringBoundLogger

from kvferry.releases import Post, released, send_release
from kvferry.tasks import cancel_and_wait
from router.choice import Node, alike, choose_prefill
from router.upstream import UpstreamError, encode

if TYPE_CHECKING:
    from router.turn import Turn

log = structlog.get_logger(__name__)


class Releases:
    """The releases one router has on their way (`len()`: how many)."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        """The most on their way at once; past it, a release is skipped (counted, logged)."""
        self._tasks: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def send(
        self,
        node: Node,
        what: str,
        model: Any,
        params: Mapping[str, Any],
        post: Post,
        outcomes: Counter,
        turn_log: FilteringBoundLogger,
    ) -> None:
        """Send a release (`what`: a prefill's blocks, a claim's) of `params` through `node`,
        in the background; not when the most allowed are already on their way (then the
        holder's timeout frees the blocks). `outcomes` counts what became of it, `turn_log` logs it."""
        in_flight = len(self._tasks)
        if in_flight >= self._limit:
            outcomes.labels("skipped").inc()
            turn_log.warning(f"router.{what}.release_skipped", node=node.engine_id, in_flight=in_flight)
            return

        async def send() -> None:
            """Best effort: the holder's timeout frees the blocks otherwise. `post` takes as
            long as a prefill may (the engines' default timeout): a release waits its turn on
            a busy engine."""
            detail = ""
            try:
                status = await send_release(post, model, params)
            except UpstreamError as e:
                outcome, detail = "failed", str(e)
            except Exception as e:  # a background task: nothing else would see it
                turn_log.exception(f"router.{what}.release_error", node=node.engine_id)
                outcome, detail = "error", repr(e)
            else:
                outcome = "released" if released(status) else "refused"
                detail = "" if released(status) else f"the engine answered {status}"
            outcomes.labels(outcome).inc()
            turn_log.info(
                f"router.{what}.release", node=node.engine_id, outcome=outcome, detail=detail or None
            )

        task = asyncio.get_running_loop().create_task(send(), name=f"router-{what}-release")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def settle(self, until: float) -> None:
        """Wait for the releases on their way until `until` (time.monotonic()), then cancel
        those left (logged: their holders' timeouts free the blocks)."""
        tasks = self._tasks
        while tasks and (left_s := until - time.monotonic()) > 0:
            await asyncio.wait(set(tasks), timeout=left_s)
        if tasks:
            log.warning("router.releases.abandoned", count=len(tasks))
        await cancel_and_wait(list(tasks))


def release_prefill(turn: Turn, decode: Node, params: Mapping[str, Any]) -> None:
    """D refused the turn, so nothing will pull what P kept for it: have it freed now,
    beside the client's error answer, not before it. D, handed P's `params` in a release
    (`kvferry.releases`), has its connector notify P, and keeps nothing itself."""
    s = turn.s
    model = decode.model or turn.body.get("model")  # D's own name: the client's may be what D refused
    headers = turn.engine_headers(f"{turn.request_id}-release")

    async def post(body: dict[str, Any]) -> int:
        return (await s.engines.post(decode.url + "/v1/completions", encode(body), headers)).status

    s.releases.send(decode, "prefill", model, params, post, s.metrics.prefill_releases, turn.log)


def release_claim(turn: Turn, near: Node, remote: Mapping[str, Any] | None) -> None:
    """The daemon claimed the conversation's blocks on D for this turn (`remote`: a
    pull's or a release's params; None = none were held), and no P request will carry
    them: the lookup answered after its deadline, its client left, or P failed the
    request that carried them. Have D free them now rather than at its TTL: P, handed
    D's params in a release (`kvferry.releases`), has its connector notify D.
    The release goes to the least loaded other P of `near`'s kind (D's params are for
    its block size) this turn could connect to, else to `near`: `near` may refuse
    anything now (a 429), or be slow to (a timeout)."""
    if not remote:
        return
    s = turn.s
    like = alike(turn.nodes, near)
    node = choose_prefill(like, s.load.view, exclude=turn.unreachable | {near.engine_id}) or near
    request_id = f"{turn.request_id}-claim-release"

    async def post(body: dict[str, Any]) -> int:
        reply = await turn.post_to_prefill(node, "/v1/completions", encode(body), request_id=request_id)
        return reply.status

    model = node.model or turn.body.get("model")
    s.releases.send(node, "claim", model, remote, post, s.metrics.claim_releases, turn.log)
