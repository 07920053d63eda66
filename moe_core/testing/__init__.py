"""Helpers for tests: multi-process workers, CUDA export on a CPU, routing
cases, expert-parallel layers on 8 devices."""
