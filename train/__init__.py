"""The training program: a decoder-only MoE language model and its tools."""
