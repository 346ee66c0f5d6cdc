"""Helpers for tests and benchmarks: spawn gloo process groups on one CPU machine."""
