"""The training program: a decoder-only MoE language model and its tools."""

from train import platforms

# Before anything here imports jax: the CPU without an accelerator, the TPU
# on a TPU host (`platforms`).
platforms.set_default_platforms()
