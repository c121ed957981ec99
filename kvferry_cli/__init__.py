"""The `kvferry` command line: the one package above every process.

It starts the processes (`kvferry daemon`, `sidecar`, `router`, `emulate`) and holds the
operator's gRPC client commands (`kvferry leases ...`, `kvferry nodes ...`). It may import
every other package; none may import it.
"""
