"""The triton backend: raw Triton grouped-GEMM and permute kernels."""
