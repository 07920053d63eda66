"""The te backend: Transformer Engine's router, grouped GEMMs, permutation."""
