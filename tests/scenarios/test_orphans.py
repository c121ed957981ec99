"""No orphan pins, on both backends: D's blocks of a turn whose registration the daemon
refused (stored nowhere, so no retention will ever name them) are freed through a prefill
node at once, not held to D's decoder_kv_blocks_ttl; D's own metrics show it."""

from __future__ import annotations

import math
import time

from sidecar.drafts import RetentionDraft, rewrite_remote_host
from tests.polling import eventually
from tests.scenarios.conftest import Deployment
from tests.scenarios.helpers import post_json, scrape
from tests.scenarios.test_releases import p_holds_nothing

CHAT = "/v1/chat/completions"


async def test_a_refused_registration_frees_ds_blocks(deployment: Deployment) -> None:
    dep = deployment
    engines = dep.engines
    topic = dep.conversation("refused")
    messages = [{"role": "user", "content": f"{topic}: tell me about breakwaters. " * 12}]
    body = {"model": engines.model, "messages": messages, "max_tokens": 12, "temperature": 0}
    # the turn as the router runs it, D's engine asked directly: the sidecar drafts nothing
    kv = {"do_remote_decode": True, "do_remote_prefill": False}
    p = await post_json(
        dep.http, engines.prefill.http_url + CHAT, {**body, "max_tokens": 1, "kv_transfer_params": kv}
    )
    before = (await scrape(dep.http, engines.decode.http_url)).used_blocks
    d = await post_json(
        dep.http, engines.decode.http_url + CHAT, {**body, "kv_transfer_params": p["kv_transfer_params"]}
    )
    params = d["kv_transfer_params"]
    assert params and params.get("do_remote_decode"), d
    blocks = math.ceil(params["remote_num_tokens"] / (await _block_size(dep)))

    async def pinned() -> bool:
        return (await scrape(dep.http, engines.decode.http_url)).used_blocks >= before + blocks

    await eventually(pinned, within=30, interval=0.2)
    sc = dep.sidecars["decode"]
    assert sc.retentions is not None
    draft = RetentionDraft(
        "",
        "x" * 300,  # (past the daemon's id limit: INVALID_ARGUMENT, stored nowhere)
        rewrite_remote_host(params, sc.settings.side_channel_host),
        params["remote_num_tokens"],
        time.time() + 300,
        None,
        "",
        sc.instance.epoch,
    )
    sc.retentions.submit(draft)
    await dep.registrations_idle()

    async def freed() -> bool:
        return (await scrape(dep.http, engines.decode.http_url)).used_blocks <= before

    await eventually(freed, within=60, interval=0.2)
    assert sc.metrics.value("kvferry_sidecar_orphans_total", reason="failed", action="released") == 1
    await p_holds_nothing(dep)


async def _block_size(dep: Deployment) -> int:
    sc = dep.sidecars["decode"]
    assert sc.instance.facts is not None
    return sc.instance.facts.block_size
