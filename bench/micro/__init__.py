"""One-machine benchmarks of a grouped GEMM or a layer, and the demo."""
