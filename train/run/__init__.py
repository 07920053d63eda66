"""The run itself: its config and data, the steps and their state, the
trainer with its log, report, resume and faults, and the dry run."""
