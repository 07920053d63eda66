"""The run itself, one subpackage a concern: inputs (its config, the checks
of its settings, its data), step (the steps and their state), reporting
(the step log, MFU, the summary, the --dry_run cost report), dry_run (the
memory check, --dry_run --target) and training (the trainer and its loop,
resume, stop signals and faults). Each imports only those listed before
it."""
