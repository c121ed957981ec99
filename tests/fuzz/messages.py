"""Hypothesis strategies for every request message of kvferry.v1 Leases and Nodes: random
and boundary values (empty, too long, control characters, unicode, negative and huge
numbers, timestamps out of range, NaN), mixed with plausible ones so that a good share of
examples gets past the first check and into the daemon's deeper paths.

Names the fuzz daemon knows: nodes DECODE_NODE and PREFILL_NODE (registered by the tests),
conversations CONVERSATIONS (registered on DECODE_NODE now and then by the examples).
"""

from __future__ import annotations

from typing import Any

from google.protobuf import timestamp_pb2
from hypothesis import strategies as st

from kvferry.v1 import leases_pb2, nodes_pb2
from tests.factories import BLOCK, d_params

DECODE_NODE = "fz-d"
PREFILL_NODE = "fz-p"
CONVERSATIONS = ("c0", "c1", "c2")

INT64 = (-(2**63), 2**63 - 1)
UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1

hostile_text = st.sampled_from(
    [
        "", " ", "default", "*", "x" * 255, "x" * 256, "x" * 257, "x" * 5000, "a\nb", "\x00", "\x7f",
        "\t", "ÿ", "🚀" * 70, "\u202e", "\ufeff", "../../etc/passwd", "%00", "-1", "NaN", "null",
        "🏳️‍🌈" * 40, DECODE_NODE, PREFILL_NODE, *CONVERSATIONS,
    ]
)  # fmt: skip
text = st.one_of(hostile_text, st.text(max_size=48), st.text(min_size=200, max_size=600))


def _ints(low: int, high: int, edges: list[int]) -> st.SearchStrategy[int]:
    return st.one_of(st.sampled_from([e for e in edges if low <= e <= high]), st.integers(low, high))


_EDGES = [0, 1, -1, 16, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**53 + 1, 2**63 - 1, -(2**63), 2**64 - 1]
int64 = _ints(*INT64, _EDGES)
uint32 = _ints(0, UINT32_MAX, _EDGES)
uint64 = _ints(0, UINT64_MAX, _EDGES)
int32 = _ints(-(2**31), 2**31 - 1, _EDGES)
doubles = st.floats(allow_nan=True, allow_infinity=True)
block_size = st.one_of(st.just(BLOCK), uint32)
digests = st.one_of(
    st.binary(max_size=80),
    st.sampled_from([b"\0" * 16, b"\x01" * 16 * 8, b"\x01" * 17, b"\xff" * 16 * 5000]),
)
json_values = st.recursive(
    st.none() | st.booleans() | doubles | st.text(max_size=16) | st.integers(-(2**53), 2**53),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=16,
)


@st.composite
def kv_params(draw: st.DrawFn) -> dict[str, Any]:
    """D's kv_transfer_params: a real one with a few keys changed, or anything at all."""
    if draw(st.booleans()):
        return draw(st.dictionaries(st.text(max_size=24), json_values, max_size=6))
    params = d_params(DECODE_NODE, 1000)
    for key in draw(st.lists(st.sampled_from(sorted(params)), max_size=3)):
        if draw(st.booleans()):
            params.pop(key, None)
        else:
            params[key] = draw(json_values)
    return params


@st.composite
def timestamps(draw: st.DrawFn) -> timestamp_pb2.Timestamp:
    """Any seconds and nanos protobuf carries, sensible or not."""
    return timestamp_pb2.Timestamp(seconds=draw(int64), nanos=draw(int32))


@st.composite
def lease_registrations(draw: st.DrawFn) -> leases_pb2.RegisterLeaseRequest:
    req = leases_pb2.RegisterLeaseRequest(
        tenant=draw(text),
        conversation_id=draw(st.one_of(st.sampled_from(CONVERSATIONS), text)),
        engine_id=draw(st.one_of(st.sampled_from([DECODE_NODE, PREFILL_NODE]), text)),
        num_tokens=draw(st.one_of(st.just(1000), int64)),
        block_size=draw(block_size),
        block_digests=draw(st.one_of(st.just(b""), digests)),
        generation=draw(st.one_of(st.just(0), uint64)),
        request_id=draw(text),
    )
    req.kv_transfer_params.update(draw(kv_params()))
    if draw(st.booleans()):
        req.expires_at.CopyFrom(draw(timestamps()))
    return req


@st.composite
def lookups(draw: st.DrawFn, prompt_follows: bool | None = False) -> leases_pb2.LookupRequest:
    req = leases_pb2.LookupRequest(
        tenant=draw(text),
        conversation_id=draw(st.one_of(st.sampled_from(CONVERSATIONS), text)),
        prompt_tokens=draw(st.one_of(st.just(1200), int64)),
        peek=draw(st.booleans()),
        prompt_follows=draw(st.booleans()) if prompt_follows is None else prompt_follows,
        request_id=draw(text),
    )
    if draw(st.booleans()):
        req.prompt_digests = draw(digests)
    return req


@st.composite
def prompts(draw: st.DrawFn) -> leases_pb2.LookupPrompt:
    req = leases_pb2.LookupPrompt(prompt_tokens=draw(st.one_of(st.just(1200), int64)))
    if draw(st.booleans()):
        req.prompt_digests = draw(digests)
    return req


_urls = st.one_of(
    st.sampled_from(
        [
            "", "http://127.0.0.1:8100", "http://169.254.169.254/latest/meta-data", "http://[::1]:80",
            "https://x", "http://", "ftp://x", "javascript:alert(1)", "http://" + "x" * 3000,
            "http://a b", "http://\u0000", "http://[zz]/", "http://x:99999", "file:///etc/passwd",
        ]
    ),
    text,
)  # fmt: skip

node_registrations = st.builds(
    nodes_pb2.RegisterNodeRequest,
    engine_id=st.one_of(st.sampled_from([DECODE_NODE, PREFILL_NODE, "fz-other"]), text),
    role=st.one_of(st.sampled_from([1, 2, 3]), int32),
    model=st.one_of(st.just("test-model"), text),
    block_size=block_size,
    http_url=_urls,
    side_channel_host=st.one_of(st.just("10.0.0.7"), text),
    side_channel_port=st.one_of(st.just(5600), uint32),
    generation=st.one_of(st.just(0), uint64),
    liveness_ttl_seconds=st.one_of(st.just(0), uint32),
    engine_url=_urls,
    engine_started_at=st.one_of(st.just(0.0), doubles),
    no_restart_seen=st.booleans(),
)

#: One strategy per unary method (full gRPC method name), with the message class answered.
UNARY: dict[str, tuple[st.SearchStrategy[Any], type[Any]]] = {
    "/kvferry.v1.Leases/Register": (lease_registrations(), leases_pb2.RegisterLeaseResponse),
    "/kvferry.v1.Leases/Lookup": (lookups(prompt_follows=None), leases_pb2.LookupResponse),
    "/kvferry.v1.Leases/Get": (
        st.builds(leases_pb2.GetLeaseRequest, tenant=text, conversation_id=text),
        leases_pb2.Lease,
    ),
    "/kvferry.v1.Leases/List": (
        st.builds(
            leases_pb2.ListLeasesRequest,
            tenant=text,
            all_tenants=st.booleans(),
            engine_id=text,
            include_inactive=st.booleans(),
            page_size=uint32,
            page_token=st.one_of(text, st.binary(max_size=64).map(lambda b: b.hex())),
        ),
        leases_pb2.ListLeasesResponse,
    ),
    "/kvferry.v1.Leases/Revoke": (
        st.builds(leases_pb2.RevokeLeaseRequest, tenant=text, conversation_id=text),
        leases_pb2.RevokeLeaseResponse,
    ),
    "/kvferry.v1.Nodes/Register": (node_registrations, nodes_pb2.RegisterNodeResponse),
    "/kvferry.v1.Nodes/List": (
        st.builds(
            nodes_pb2.ListNodesRequest, role=int32, include_dead=st.booleans(), local_only=st.booleans()
        ),
        nodes_pb2.ListNodesResponse,
    ),
    "/kvferry.v1.Nodes/Deregister": (
        st.builds(nodes_pb2.DeregisterNodeRequest, engine_id=st.one_of(st.just("fz-other"), text)),
        nodes_pb2.DeregisterNodeResponse,
    ),
    "/kvferry.v1.Nodes/Score": (
        st.builds(
            nodes_pb2.ScoreRequest,
            block_hashes=st.lists(uint64, max_size=300),
            role=int32,
            local_only=st.booleans(),
        ),
        nodes_pb2.ScoreResponse,
    ),
}

#: Ops of a Leases/Stream: (kind, op id, message). Few ids, so that they collide.
stream_ops = st.lists(
    st.one_of(
        st.tuples(st.just("register"), st.integers(0, 5), lease_registrations()),
        st.tuples(st.just("lookup"), st.integers(0, 5), lookups(prompt_follows=None)),
        st.tuples(st.just("prompt"), st.integers(0, 5), prompts()),
        st.tuples(st.just("none"), st.sampled_from([0, 1, UINT64_MAX]), st.none()),
    ),
    min_size=1,
    max_size=12,
)

attach_messages = st.lists(
    st.one_of(
        st.builds(
            lambda e, g: nodes_pb2.AttachRequest(hello=nodes_pb2.AttachHello(engine_id=e, generation=g)),
            st.one_of(st.sampled_from([DECODE_NODE, PREFILL_NODE]), text),
            st.one_of(st.just(1), uint64),
        ),
        st.builds(
            lambda s, u, b: nodes_pb2.AttachRequest(
                heartbeat=nodes_pb2.Heartbeat(seq=s, uncaptured_turns=u, unretained_blocks=b)
            ),
            uint64,
            uint64,
            uint64,
        ),
        st.builds(
            lambda s, a, r, c, z: nodes_pb2.AttachRequest(
                kv_events=nodes_pb2.KvEventBatch(seq=s, stored=a, removed=r, cleared=c, reset=z)
            ),
            int64,
            st.lists(uint64, max_size=400),
            st.lists(uint64, max_size=50),
            st.booleans(),
            st.booleans(),
        ),
        st.just(nodes_pb2.AttachRequest()),
    ),
    min_size=1,
    max_size=8,
)


def lease_op(kind: str, op_id: int, msg: Any) -> leases_pb2.LeaseOp:
    if kind == "register":
        return leases_pb2.LeaseOp(id=op_id, register=msg)
    if kind == "lookup":
        return leases_pb2.LeaseOp(id=op_id, lookup=msg)
    if kind == "prompt":
        return leases_pb2.LeaseOp(id=op_id, prompt=msg)
    return leases_pb2.LeaseOp(id=op_id)
