"""google.protobuf.Struct -> plain dict, for kv_transfer_params on every side of the API.

Struct keeps every number as a double; block ids, ports and token counts are
integers in vLLM, so integral values come back as int. (json_format would do
the same job several times slower.)
"""

from __future__ import annotations

from typing import Any

from google.protobuf import struct_pb2

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
