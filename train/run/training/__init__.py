"""The training loop: the Trainer (trainer) with its loop (loop), what a
resumed checkpoint must match (resume), stop signals (stop_signals) and the
faults that end a run (training_faults)."""
