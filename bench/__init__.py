"""Benchmarks and the GPU and TPU checks, a subpackage a purpose (bench/BUILD
lists them): harness, workloads, micro, ep, compile, on_device."""
