"""The xla backend: a portable grouped GEMM from plain XLA ops."""
