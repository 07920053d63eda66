"""The dry run and memory: whether a compiled step fits a device's memory
(memory_check), and --dry_run --target's compile for a topology
(dry_run_target)."""
