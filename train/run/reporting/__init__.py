"""What a run reports: MFU (mfu), the per-step records and console lines
(step_log), the end-of-run summary and plot (report), and the --dry_run
cost report (cost_report)."""
