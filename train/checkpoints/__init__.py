"""What a run leaves on disk: Orbax checkpoints, their meta.json and
checksums, and the output directory with its lock."""
