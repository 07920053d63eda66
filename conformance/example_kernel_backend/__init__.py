"""The example kernel backend: a template for a backend of Pallas kernels.

Copied to backends/<name>/, this folder is a backend package: its kernels
(kernels.py), their tile table (tiles.py), the backend class (backend.py)
and conformance_test.py. See conformance/example_backend/ for a backend
whose grouped GEMM is plain JAX.
"""
