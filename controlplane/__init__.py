"""The kvferry control-plane daemon: nodes, retentions and lookups on etcd.

Layers (checked by import-linter), each importing only the ones below it:

- `daemon`: the process (etcd, the gRPC server, metrics, background loops, shutdown);
- `server/`: the gRPC servicers, Leases/Stream, the one error-to-status map;
- `cluster`: answers merged over every daemon replica (Nodes/List, Nodes/Score);
- `messages` (kvferry.v1 <-> plain data) | `peers` (asking the other replicas) |
  `notices` (their promises to tell each other of node demotions first);
- `service/`: the domain operations on plain data (no gRPC);
- `store/`: the etcd adapter, one part per kind of record;
- `policy` / `records` (pure): the lookup decision, what is stored where.
"""
