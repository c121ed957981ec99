"""kv_transfer_params between the wire (google.protobuf.Struct) and the domain."""

from __future__ import annotations

from google.protobuf import struct_pb2

from controlplane.policy import Handout
from kvferry.structs import struct_to_dict

__all__ = ["apply_handout", "remote_request_of", "struct_to_dict"]


def remote_request_of(blob: bytes) -> str:
    """D's request id (remote_request_id) in stored params ("" when absent)."""
    s = struct_pb2.Struct()
    s.ParseFromString(blob)
    field = s.fields.get("remote_request_id")
    return field.string_value if field is not None else ""


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
