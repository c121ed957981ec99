"""Benchmarks: scripts that print their figures (run with `make bench`)."""

import os

# The benches start servers (the daemon, the router's front doors) as child processes
# while their own gRPC clients run. A child execs at once and never uses the parent's
# gRPC, so gRPC's fork handlers have nothing to do; with them on, each start printed
# "Other threads are currently calling into gRPC, skipping fork() handlers" amid the
# figures. (Read when grpc is first imported: hence here, before any bench imports it.)
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
