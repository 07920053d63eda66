"""Benchmarks and the GPU and TPU checks."""

from train import platforms

# Before anything here imports jax: the CPU without an accelerator, the TPU
# on a TPU host (`platforms`).
platforms.set_default_platforms()
