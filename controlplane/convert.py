"""google.protobuf.Struct <-> plain dicts, fast and lossless for kv_transfer_params.

Struct keeps every number as a double; block ids, ports and token counts are
integers in vLLM, so integral values come back as int. (json_format would do
the same job several times slower on the lookup path.)
"""

from __future__ import annotations

from typing import Any

from google.protobuf import struct_pb2

from controlplane.policy import Handout

_MAX_EXACT = 2**53


def struct_to_dict(s: struct_pb2.Struct) -> dict[str, Any]:
    return {k: _value(v) for k, v in s.fields.items()}


def _value(v: struct_pb2.Value) -> Any:
    kind = v.WhichOneof("kind")
    if kind == "number_value":
        n = v.number_value
        return int(n) if n.is_integer() and abs(n) < _MAX_EXACT else n
    if kind == "string_value":
        return v.string_value
    if kind == "bool_value":
        return v.bool_value
    if kind == "struct_value":
        return struct_to_dict(v.struct_value)
    if kind == "list_value":
        return [_value(x) for x in v.list_value.values]
    return None


def dict_to_struct(d: dict[str, Any], out: struct_pb2.Struct) -> None:
    """Fill `out` (e.g. a message's Struct field) from a JSON-like dict."""
    out.update(d)


def apply_handout(blob: bytes, h: Handout, out: struct_pb2.Struct) -> None:
    """Fill `out` with the stored params `blob` (a serialized Struct) as P must get them.

    Works on the parsed message in place (upb, C speed) instead of going through
    dicts: this is the lookup hot path. Same result as policy.apply_handout.
    """
    out.ParseFromString(blob)
    f = out.fields
    f["do_remote_decode"].bool_value = True
    f["do_remote_prefill"].bool_value = False
    f["remote_num_tokens"].number_value = h.num_tokens
    if h.keep_blocks is None:
        return
    groups = f["remote_block_ids"].list_value.values
    if len(groups) and groups[0].HasField("list_value"):
        for g in groups:
            del g.list_value.values[h.keep_blocks :]
    else:  # one flat list (releases before per-group lists)
        del groups[h.keep_blocks :]
