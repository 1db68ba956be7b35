"""Benchmarks: each returns a dict of measured numbers; the CLI and docs/benchmarks.md report them."""
