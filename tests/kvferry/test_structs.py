"""kv_transfer_params arrive as google.protobuf.Struct; struct_to_dict must read them
back as a JSON client would (integral numbers as int), fast path or not, and
dict_to_struct must write exactly the message Struct.update writes."""

from __future__ import annotations

from google.protobuf import json_format, struct_pb2
from hypothesis import given
from hypothesis import strategies as st

from kvferry.structs import dict_to_struct, struct_to_dict

JSON_VALUES = st.one_of(
    st.integers(min_value=-(2**60), max_value=2**60),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=3),
    st.booleans(),
    st.none(),
)


def as_json_client_reads(v: object) -> object:
    if isinstance(v, float) and v.is_integer() and abs(v) < 2**53:
        return int(v)
    return v


@given(st.lists(JSON_VALUES, max_size=40), st.lists(st.integers(0, 2**31), max_size=5000))
def test_lists_read_back_as_json_would(mixed: list[object], block_ids: list[int]) -> None:
    s = struct_pb2.Struct()
    s.update({"mixed": mixed, "remote_block_ids": [block_ids]})
    expected = {k: [as_json_client_reads(x) for x in v] for k, v in json_format.MessageToDict(s).items()}
    expected["remote_block_ids"] = [block_ids]
    got = struct_to_dict(s)
    assert got == expected
    assert all(type(a) is type(b) for a, b in zip(got["mixed"], expected["mixed"], strict=True))
    assert all(type(i) is int for i in got["remote_block_ids"][0])


NUMBERS = st.one_of(st.integers(min_value=-(2**60), max_value=2**60), st.floats(allow_nan=False))
PARAM_VALUES = st.recursive(
    JSON_VALUES | st.lists(NUMBERS, max_size=300),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=30,
)


@given(st.dictionaries(st.text(max_size=5), PARAM_VALUES, max_size=6))
def test_dict_to_struct_writes_what_update_writes(d: dict[str, object]) -> None:
    expected, got = struct_pb2.Struct(), struct_pb2.Struct()
    expected.update(d)
    dict_to_struct(d, got)
    assert got == expected
    assert got.SerializeToString(deterministic=True) == expected.SerializeToString(deterministic=True)


ANY_NUMBERS = st.lists(st.one_of(NUMBERS, st.floats()), min_size=1, max_size=200)  # NaN and inf too


@given(
    st.one_of(ANY_NUMBERS, st.lists(ANY_NUMBERS, min_size=1, max_size=4)),
    st.sampled_from([None, [9], [[9], [8]], "x"]),
)
def test_dict_to_struct_number_lists_replace_like_update(ids: list[object], before: object) -> None:
    """The fast paths (a number list, a list of them), over whatever `out` held under the key."""
    expected, got = struct_pb2.Struct(), struct_pb2.Struct()
    if before is not None:
        expected.update({"ids": before})
        got.update({"ids": before})
    expected.update({"ids": ids})
    dict_to_struct({"ids": ids}, got)
    # (bytes, not ==: NaN != NaN)
    assert got.SerializeToString(deterministic=True) == expected.SerializeToString(deterministic=True)


def test_dict_to_struct_block_id_shapes() -> None:
    """Per-group lists (vLLM >= 0.11), a flat list, an empty group, numbers mixed with a bool."""
    for ids in ([[7, 8, 9], [1]], [7, 8, 9], [[7], []], [True, 2], [[1.5, -2.0]], [[1], "x"]):
        expected, got = struct_pb2.Struct(), struct_pb2.Struct()
        expected.update({"remote_block_ids": ids, "remote_port": 5600})
        dict_to_struct({"remote_block_ids": ids, "remote_port": 5600}, got)
        assert got == expected, ids
        assert struct_to_dict(got)["remote_block_ids"] == ids


def test_number_lists_turn_int_only_where_exact() -> None:
    """A number list's fast read (ints converted and range-checked in one C pass) at the
    edges: the largest exact doubles become ints; 2**53, fractions, NaN and inf, which a
    JSON client would not read as exact ints, stay floats, and the rest of the list ints."""
    edge = 2**53 - 1
    for numbers, expected in (
        ([edge, -edge, 0], [edge, -edge, 0]),
        ([1, float(2**53)], [1, float(2**53)]),
        ([1, 1.5], [1, 1.5]),
        ([1, float("inf"), -float("inf")], [1, float("inf"), -float("inf")]),
    ):
        s = struct_pb2.Struct()
        s.update({"ids": numbers})
        got = struct_to_dict(s)["ids"]
        assert got == expected
        assert [type(x) for x in got] == [type(x) for x in expected]
    s = struct_pb2.Struct()
    s.update({"ids": [1, float("nan")]})
    one, nan = struct_to_dict(s)["ids"]
    assert type(one) is int and nan != nan
