"""The training program: a decoder-only MoE language model and its tools."""

import os

# The legs carry JAX's CUDA plugin (to compile for GPUs from any host,
# moe_core.aot); where no GPU is attached, JAX runs on the CPU without the
# plugin's failing start-up check. Set before anything here imports jax.
if not os.path.exists("/dev/nvidiactl"):
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
