"""Pure decisions of the router about who a turn is: its model's nodes, one sequence or
several, its conversation id and tenant (or none)."""

from __future__ import annotations

import hashlib

from kvferry.ids import MAX_ID_BYTES
from kvferry.turnheaders import conversation_of, safe_id
from router.choice import (
    Node,
    serving,
)
from router.decisions import (
    single_sequence,
)
from router.identity import ApiKeys, Identity, api_key_of, identify


def test_a_turn_uses_the_nodes_of_the_model_it_names() -> None:
    a, b = Node("a", "both", "http://a", model="m-a"), Node("b", "both", "http://b", model="m-b")
    assert serving([a, b], "m-b") == [b]
    unknown = Node("u", "both", "http://u")  # its /v1/models not read yet: still a candidate
    assert serving([a, b, unknown], "m-b") == [b, unknown]
    # An adapter's name, no model, or one no node reports: every node (the engine judges).
    assert serving([a, b], "my-lora") == serving([a, b], None) == serving([a, b], "") == [a, b]


def test_only_one_answer_to_one_prompt_goes_through_p_and_d() -> None:
    assert single_sequence({"messages": [{"role": "user", "content": "hi"}]})
    assert single_sequence({"prompt": "one", "n": 1, "best_of": None})
    assert single_sequence({"prompt": [1, 2, 3]})  # token ids: one prompt
    assert single_sequence({"prompt": ["one"]}) and single_sequence({"prompt": [[1, 2]]})
    assert not single_sequence({"messages": [], "n": 2})
    assert single_sequence({"prompt": "one", "best_of": 3})  # gone from vLLM's API, ignored there
    assert not single_sequence({"prompt": ["one", "two"]})
    assert not single_sequence({"prompt": [[1, 2], [3]]})
    assert not single_sequence({"prompt": [1, "two"]})  # not ids: the engine judges it
    assert not single_sequence({"prompt_embeds": "AAAA"})  # (vLLM's: base64 tensors, one or more)
    assert not single_sequence({"prompt": "text", "prompt_embeds": ["AAAA"]})


def test_conversation_identity_sources_in_order() -> None:
    assert conversation_of({"X-Conversation-Id": "h"}, {"conversation_id": "b"}) == "h"
    assert conversation_of({"X-Session-ID": "s"}, {"conversation_id": "b"}) == "b"
    assert conversation_of({"X-Session-ID": "s"}, {"session_id": "v"}) == "s"
    assert conversation_of({}, {"session_id": "v"}) == "v"
    assert conversation_of({}, {"conversation_id": 42}) == "42"
    assert conversation_of({}, {"conversation_id": True, "session_id": "  "}) == ""
    assert conversation_of({}, {}) == ""


def test_ids_the_daemon_would_refuse_become_stable_digests() -> None:
    long = "x" * (MAX_ID_BYTES + 1)
    assert safe_id(long, "conv") == safe_id(long, "conv") != long
    assert len(safe_id(long, "conv")) < MAX_ID_BYTES
    assert safe_id("a\nb", "conv").startswith("conv-")
    assert safe_id("ok-id", "conv") == "ok-id"


DEV = ApiKeys()
"""No key configured: development, every client gets in."""


def test_non_utf8_header_bytes_make_ids_not_errors() -> None:
    """aiohttp decodes a header's non-UTF-8 bytes to surrogates (surrogateescape): they are
    digested like control characters, and an API key made of them still hashes."""
    raw = b"caf\xe9".decode("utf-8", "surrogateescape")
    who = identify({"X-Conversation-Id": raw}, {}, "")
    assert who.conversation_id.startswith("conv-") and who.conversation_id.encode()
    tenant = DEV.tenant_of(api_key_of({"Authorization": "Bearer k" + raw}))
    assert tenant is not None and tenant.startswith("key-") and tenant.encode()
    keyed = ApiKeys.of(["k" + raw])
    assert keyed.tenant_of("k" + raw) == tenant and keyed.tenant_of("k") is None


def test_tenant_is_a_hash_of_the_api_key_never_the_key() -> None:
    alice = DEV.tenant_of(api_key_of({"Authorization": "Bearer sk-alice"}))
    assert alice is not None and alice.startswith("key-") and "sk-alice" not in alice
    assert alice == DEV.tenant_of(api_key_of({"Authorization": "bearer  sk-alice "}))
    assert alice != DEV.tenant_of("sk-bob")
    assert DEV.tenant_of(api_key_of({"Authorization": "Basic abc"})) == ""  # no key: the default
    # Keys configured: the same tenant for the same key; no key, or another, gets nothing.
    keys = ApiKeys.of(["sk-alice", "sk-bob"])
    assert keys.tenant_of("sk-alice") == alice and keys.tenant_of("sk-bob") == DEV.tenant_of("sk-bob")
    assert keys.tenant_of("") is None and keys.tenant_of("sk-mallory") is None


def test_a_policys_clients_are_the_tenants_the_operator_named() -> None:
    """[clients.*] of the policy file: a key's SHA-256 digest -> its holder's tenant."""
    digest = hashlib.sha256(b"sk-acme-prod").hexdigest()
    keys = ApiKeys.of(["sk-dev"], {digest: "acme"})
    assert keys.checked and keys.tenant_of("sk-acme-prod") == "acme"
    assert keys.tenant_of("sk-dev") == DEV.tenant_of("sk-dev")  # --api-key keys still work
    assert keys.tenant_of("sk-acme-pro") is None and keys.tenant_of("") is None
    only_policy = ApiKeys.of([], {digest: "acme"})
    assert only_policy.tenant_of("sk-acme-prod") == "acme" and only_policy.tenant_of("sk-dev") is None
    # A name the daemon would refuse is made safe, as every id is.
    odd = ApiKeys.of([], {digest: "a\nb"}).tenant_of("sk-acme-prod")
    assert odd is not None and odd.startswith("tenant-")


def test_no_conversation_means_no_identity_at_all() -> None:
    ident = identify({"Authorization": "Bearer k"}, {}, "key-1")
    assert (ident.tenant, ident.conversation_id) == ("", "")
    assert identify({}, {"conversation_id": "c"}, "key-1") == Identity("key-1", "c")
