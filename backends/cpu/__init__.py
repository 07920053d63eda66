"""The cpu backend: a grouped GEMM as XLA FFI custom calls (AVX-512)."""
