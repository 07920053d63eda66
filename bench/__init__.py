"""Benchmarks and the GPU and TPU checks."""
