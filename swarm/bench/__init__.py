"""Benchmarks: programs that print figures, and JSON with --json."""
