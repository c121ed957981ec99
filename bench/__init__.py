"""Benchmarks: scripts that print their figures (run with `make bench`)."""
