"""kv_transfer_params as the daemon stores them (a serialized google.protobuf.Struct, byte
for byte as D sent them) and as it hands them out: the one place that reads or trims them."""

from __future__ import annotations

from google.protobuf import struct_pb2

from controlplane.policy import Handout


def remote_request_of(blob: bytes) -> str:
    """D's request id (remote_request_id) in stored params ("" when absent)."""
    s = struct_pb2.Struct()
    s.ParseFromString(blob)
    field = s.fields.get("remote_request_id")
    return field.string_value if field is not None else ""


def apply_handout(blob: bytes, h: Handout, out: struct_pb2.Struct) -> None:
    """Fill `out` with the stored params `blob` as P must receive them (see Handout):
    ``do_remote_decode: true, do_remote_prefill: false``, ``remote_num_tokens`` set to
    `h.num_tokens`, and, when `h.keep_blocks` is given, every ``remote_block_ids[g]`` cut
    to its first `keep_blocks` entries (one flat list, as releases had before per-group
    lists, is cut as it is). Every other key is kept as D sent it.

    Works on the parsed message in place (upb, C speed) instead of going through dicts:
    this is the lookup hot path.
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
