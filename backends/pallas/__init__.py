"""The pallas backend: grouped-GEMM kernels; Triton on GPU, interpret on CPU."""
