"""Helpers for tests: multi-process workers, CUDA export on a CPU."""
