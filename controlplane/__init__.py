"""The kvferry control-plane daemon: nodes, retention leases and lookups on etcd.

Layers (checked by import-linter): `server` (gRPC servicers) -> `service`
(domain operations) -> `store` (etcd adapter) -> `policy` / `records` (pure).
"""
