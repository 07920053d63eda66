"""Expert parallelism: the collectives' traffic and the scaling model."""
