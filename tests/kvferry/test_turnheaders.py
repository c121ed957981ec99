"""The router/sidecar contract (kvferry.turnheaders): both processes read a request's
conversation by one rule, and the tenant the router names reaches D's sidecar whatever
header the sidecar is configured to read for other front doors. Pure."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from kvferry.turnheaders import (
    CONVERSATION_HEADER,
    SESSION_HEADER,
    TENANT_HEADER,
    TURN_ID_HEADER,
    conversation_of,
)
from router.identity import ApiKeys, identify
from sidecar.capture import RequestPlan, plan_request

_ids = st.one_of(st.text(max_size=300), st.integers(), st.booleans(), st.none())


def _plan(
    headers: dict[str, str], body: dict[str, object], tenant_header: str = TENANT_HEADER
) -> RequestPlan:
    raw = json.dumps({"messages": [], **body}).encode()
    plan = plan_request("POST", "/v1/chat/completions", headers, raw, tenant_header)
    assert plan is not None
    return plan


def test_the_sidecar_reads_the_conversation_as_the_router_does() -> None:
    """One rule for both processes (kvferry.turnheaders): an id the daemon would refuse is
    the same digest whichever of them reads it, so a direct client's long id registers."""
    long = "c" * 300
    headers = {"X-Conversation-Id": long}
    assert _plan(headers, {}).conversation_id == conversation_of(headers, {})
    assert _plan(headers, {}).conversation_id.startswith("conv-")
    assert _plan({}, {"session_id": "a\x01b"}).conversation_id == conversation_of(
        {}, {"session_id": "a\x01b"}
    )


@given(
    st.fixed_dictionaries(
        {}, optional={CONVERSATION_HEADER: st.text(max_size=300), SESSION_HEADER: st.text()}
    ),
    st.fixed_dictionaries({}, optional={"conversation_id": _ids, "session_id": _ids}),
    st.text(max_size=300),
)
def test_the_router_hands_d_the_conversation_and_tenant_it_looks_up(
    headers: dict[str, str], body: dict[str, object], key: str
) -> None:
    """What the router identifies, sent to D's sidecar as the router sends it (the
    conversation and tenant headers, the turn id), is what the sidecar registers under,
    even on a sidecar that reads another tenant header for other front doors."""
    tenant = ApiKeys().tenant_of(key)  # (the tenant a client's API key names)
    assert tenant is not None
    who = identify({**headers, TENANT_HEADER: "client-sent"}, body, tenant)
    if not who.conversation_id:
        return
    sent = {CONVERSATION_HEADER: who.conversation_id, TURN_ID_HEADER: "kvf-1", "X-Team": "other"}
    if who.tenant:
        sent[TENANT_HEADER] = who.tenant
    plan = _plan(sent, body, tenant_header="X-Team")
    assert (plan.tenant, plan.conversation_id) == (who.tenant, who.conversation_id)


def _tenant(headers: dict[str, str], tenant_header: str) -> str:
    return _plan(headers, {"conversation_id": "c"}, tenant_header).tenant


def test_a_request_from_the_router_names_its_tenant_in_the_shared_header() -> None:
    """Whatever --tenant-header a sidecar has, a request the router sent (it carries the
    turn id) is taken by the router's header alone: the router looks the retention up under
    the tenant it named, so the sidecar registers it there."""
    routed = {"X-Kvferry-Turn-Id": "kvf-1", TENANT_HEADER: "key-0123", "X-Team": "beta"}
    assert _tenant(routed, "X-Team") == "key-0123"
    # (no tenant header from the router: the default tenant, not a client's other header)
    assert _tenant({"X-Kvferry-Turn-Id": "kvf-2", "X-Team": "beta"}, "X-Team") == ""
    # Another front door: the configured header, by the router's rule for client headers.
    direct = {"X-Team": "beta", TENANT_HEADER: "acme"}
    assert _tenant(direct, "X-Team") == "beta"
    assert _tenant(direct, "") == ""
    assert _tenant({"X-Team": "key-0123"}, "X-Team").startswith("tenant-")
