"""Experiments: programs that train or measure, write CSV/PNG/JSON under --out, and print a table."""
