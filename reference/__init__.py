"""The reference backend: slow, obviously correct pure JAX; the oracle."""
