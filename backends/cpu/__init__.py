"""The cpu backend: a grouped GEMM as XLA FFI custom calls (C++, AVX-512)."""
