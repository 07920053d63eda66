"""What every benchmark shares: timing, text tables, flag checks, the JSON
report and the trace summary."""
