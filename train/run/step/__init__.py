"""The training step: the optimiser, the loss and the jitted steps (steps),
gradient accumulation (microbatch), the state and its sharded
initialisation (state), and the step built for any mesh (step_builder)."""
