"""The example backend: a template to copy when adding a backend.

See the checklist in `moe_core.Backend`'s docstring. Copied to
backends/<name>/, this folder is a backend package like backends/xla.
"""
