"""Benchmarks: each starts its own servers on loopback, is bounded in time, and exits 0 unless
something errored (a benchmark reports against its target; it is not a test)."""
