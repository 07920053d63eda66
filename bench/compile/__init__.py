"""The benchmark programs through XLA's GPU and TPU compilers, no device."""
