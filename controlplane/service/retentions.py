"""Retentions as the API manages them: register (replacing the conversation's previous
one), get, list and revoke. Handing one out is a lookup's (lookups.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

from controlplane import metrics
from controlplane.convert import remote_request_of
from controlplane.errors import FailedPrecondition, InvalidArgument, NotFound, StoreUnavailable, not_applied
from controlplane.owners import OwnedRetentions
from controlplane.policy import Prompt, holds_null_blocks
from controlplane.records import Claim, NodeState, Retention
from controlplane.service.budgets import Budgets
from controlplane.service.nodecache import NodeCache
from controlplane.service.validation import (
    MAX_PAGE,
    check_id,
    check_on_node,
    check_record_size,
    check_retention_size,
    deadline_of,
    page_start,
    page_token,
    tenant_of,
)
from controlplane.settings import Settings
from controlplane.store import EtcdStore
from kvferry.framing import MESSAGE_BUDGET

log = structlog.get_logger(__name__)

#: A listed retention's encoded bytes beyond its params and digests (ids, times, numbers).
_RETENTION_OVERHEAD = 256
#: Most retentions one List call reads: with a filter few match (an engine's among 100k),
#: the page ends short, even empty, with a token to go on from, not after the whole store.
LIST_EXAMINED = 2000
#: Retentions a List page holds when the caller does not say.
DEFAULT_PAGE = 100


@dataclass(frozen=True)
class RetentionRegistration:
    """A retention as D's sidecar registers it."""

    tenant: str
    conversation_id: str
    engine_id: str
    params: dict[str, Any]
    """D's params, parsed (for validation)."""
    params_blob: bytes
    """D's params as received on the wire: what is stored, and handed out."""
    num_tokens: int
    expires_at: float | None
    block_size: int
    digests: bytes
    generation: int
    request_id: str = ""


@dataclass(frozen=True)
class RetentionView:
    """A retention as Get/List/Register/Revoke report it: the record, or the marker of the
    claim that took it."""

    tenant: str
    conversation_id: str
    retention: Retention | None
    revision: int = 0
    claim: Claim | None = None


class Retentions:
    """The registration, reading and revoking of retentions."""

    def __init__(
        self,
        store: EtcdStore,
        nodes: NodeCache,
        settings: Settings,
        clock: Callable[[], float],
        budgets: Budgets,
        owned: OwnedRetentions,
    ) -> None:
        self._store = store
        self._owned = owned
        self._budgets = budgets
        self._nodes = nodes
        self._policy = settings.policy
        self._limits = settings.limits
        self._clock = clock

    async def register(self, reg: RetentionRegistration) -> tuple[RetentionView, bool, bytes | None]:
        """-> (the stored retention, whether it replaced one, the params of the replaced one
        when its blocks are still held: no turn claimed it, so nothing else will free them)."""
        lim = self._limits
        tenant = tenant_of(reg.tenant, lim.max_id_bytes)
        check_id("conversation_id", reg.conversation_id, lim.max_id_bytes)
        check_id("engine_id", reg.engine_id, lim.max_id_bytes)
        check_id("request_id", reg.request_id, lim.max_id_bytes, required=False)
        check_retention_size(reg.num_tokens, len(reg.params_blob), lim)
        check_record_size(len(reg.params_blob), len(reg.digests), lim)
        now = self._clock()
        expires_at = deadline_of(reg.expires_at, self._policy, now)
        try:
            node = await self._node_of(reg)
        except StoreUnavailable as e:  # (nothing written yet: sending it again is safe)
            raise not_applied(e) from e
        block_size, generation = check_on_node(
            node.record, reg.block_size, reg.generation, reg.num_tokens, reg.digests, reg.params
        )
        retention = Retention(
            engine_id=reg.engine_id,
            generation=generation,
            params=reg.params_blob,
            num_tokens=reg.num_tokens,
            block_size=block_size,
            created_at=now,
            expires_at=expires_at,
            digests=reg.digests,
            request_id=reg.request_id,
            whole_only=holds_null_blocks(reg.params),
        )
        revision, replaced = await self._owned.put(tenant, reg.conversation_id, retention, now)
        metrics.REGISTRATIONS.labels("replaced" if replaced else "new").inc()
        self._budgets.registered(tenant, reg.conversation_id, retention, revision)
        release = None
        if replaced is not None:
            try:
                release = await self.still_held(replaced, retention, now)
            except StoreUnavailable as e:  # (the registration is stored: answer it all the same)
                log.info("retention.replaced.unchecked", conversation_id=reg.conversation_id, error=str(e))
        log.debug(
            "retention.registered", tenant=tenant, conversation_id=reg.conversation_id, tokens=reg.num_tokens
        )
        view = RetentionView(tenant, reg.conversation_id, retention, revision)
        return view, replaced is not None, release

    async def _node_of(self, reg: RetentionRegistration) -> NodeState:
        """The registered node a retention is registered on."""
        node = await self._nodes.get(reg.engine_id)  # (a node it lacks, it has just read)
        if node is not None and (node.record.removed_at or reg.generation not in (0, node.record.generation)):
            # The cache may be a moment behind another replica's registration: look again.
            node = await self._nodes.get(reg.engine_id, fresh=True)
        if node is None or node.record.removed_at:
            raise FailedPrecondition(f"engine {reg.engine_id} is not a registered node")
        return node

    async def still_held(self, held: Retention, now_stored: Retention | None, now: float) -> bytes | None:
        """The params of a retention out of etcd (replaced by `now_stored`, or gone: None)
        whose blocks D still holds with nothing else to free them (None: expired, its engine
        restarted or gone, or `now_stored` names the same D request). One rule for a
        registration's replaced retention and a put-back a registration or revoke overtook."""
        if held.expires_at <= now or (now_stored is not None and held.params == now_stored.params):
            return None
        vouched = False
        if now_stored is not None and now_stored.engine_id == held.engine_id:
            # (a registration from the node itself, at that generation, vouches for it: its
            # liveness may only have lapsed, as every node's does while etcd has no quorum)
            vouched = now_stored.generation == held.generation
            if remote_request_of(held.params) == remote_request_of(now_stored.params):
                return None
        node = await self._nodes.get(held.engine_id)
        if node is None or not (node.alive or vouched) or node.record.generation != held.generation:
            return None
        return held.params

    async def get(self, tenant: str, conversation_id: str) -> RetentionView:
        """The conversation's retention, or the marker of the claim that took it."""
        tenant = tenant_of(tenant, self._limits.max_id_bytes)
        check_id("conversation_id", conversation_id, self._limits.max_id_bytes)
        stored, claim = await self._owned.read(tenant, conversation_id)
        if stored is None and claim is None:
            raise NotFound(f"no retention for conversation {conversation_id!r} of tenant {tenant!r}")
        if stored is not None:
            return RetentionView(tenant, conversation_id, stored.retention, stored.revision)
        return RetentionView(tenant, conversation_id, None, claim=claim)

    async def list(
        self,
        tenant: str,
        all_tenants: bool,
        engine_id: str,
        include_inactive: bool,
        page_size: int,
        token: str,
    ) -> tuple[list[RetentionView], str]:
        """A page of retentions (of one tenant, or all; of one engine, or all; live only
        unless `include_inactive`). -> (the page, the token of the next one or "")."""
        if page_size < 0 or page_size > MAX_PAGE:
            raise InvalidArgument(f"page_size {page_size} must be in 0..{MAX_PAGE}")
        check_id("engine_id", engine_id, self._limits.max_id_bytes, required=False)
        page_size = page_size or DEFAULT_PAGE
        keys = self._store.keys
        prefix = (
            keys.retentions
            if all_tenants
            else keys.tenant_retentions(tenant_of(tenant, self._limits.max_id_bytes))
        )
        start = page_start(token, prefix)
        now = self._clock()
        out: list[RetentionView] = []
        size = 0  # about the page's encoded bytes: it must fit a client's message limit
        full = False
        examined = 0
        while len(out) < page_size and not full and examined < LIST_EXAMINED:
            want = min(page_size - len(out), LIST_EXAMINED - examined)
            batch, start = await self._store.scans.page(prefix, start, want)
            examined += len(batch)
            for s in batch:
                r = s.retention
                if (engine_id and r.engine_id != engine_id) or not (include_inactive or r.expires_at > now):
                    continue
                size += len(r.params) + len(r.digests) + _RETENTION_OVERHEAD
                if out and size > MESSAGE_BUDGET:  # this retention and the rest: the next page
                    start, full = keys.retention(s.tenant, s.conversation_id), True
                    break
                out.append(RetentionView(s.tenant, s.conversation_id, r, s.revision))
            if not start:
                break
        return out, page_token(start)

    async def end(self, tenant: str, conversation_id: str) -> tuple[RetentionView | None, bool, bool]:
        """The conversation ended: revoke its retention and have D's sidecar free the blocks
        when it is attached here. -> (what was revoked, whether the blocks are still D's to
        free, whether D's sidecar was told to: else the caller frees them)."""
        view, releasable = await self.revoke(tenant, conversation_id)
        told = False
        if view is not None and view.retention is not None and releasable:
            told = self._budgets.ended(view.tenant, conversation_id, view.retention)
        return view, releasable, told

    async def revoke(self, tenant: str, conversation_id: str) -> tuple[RetentionView | None, bool]:
        """Delete the conversation's retention. -> (what was revoked, None if nothing was;
        whether its blocks are still D's to free: what a lookup that reuses nothing would
        release, i.e. not expired, its node alive at the retention's generation)."""
        tenant = tenant_of(tenant, self._limits.max_id_bytes)
        check_id("conversation_id", conversation_id, self._limits.max_id_bytes)
        stored = await self._owned.revoke(tenant, conversation_id)
        log.info(
            "retention.revoked", tenant=tenant, conversation_id=conversation_id, found=stored is not None
        )
        if stored is None:
            return None, False
        self._budgets.revoked(tenant, conversation_id)
        retention, now = stored.retention, self._clock()
        view = RetentionView(tenant, conversation_id, retention, stored.revision)
        try:
            decision = await self._nodes.decision(retention, Prompt(0), self._policy, now)
        except StoreUnavailable as e:
            # As a lookup's claim when etcd fails after it: hand out the release while the
            # deadline holds; a D that restarted meanwhile ignores the notification.
            log.warning("retention.revoked.node_unknown", conversation_id=conversation_id, error=str(e))
            return view, now < retention.expires_at
        return view, decision.release is not None
