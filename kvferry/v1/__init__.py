"""Generated gRPC stubs for kvferry.v1 (do not edit; see scripts/gen_protos.py)."""
