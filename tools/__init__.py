"""Tooling for tests, benchmarks and set-up: not part of the serving path."""
