"""What the benchmarks measure: the grouped GEMM shapes and the GPU and TPU
program tables."""
