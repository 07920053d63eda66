"""Helpers for the backends' tests: TE's skip-or-fail, Triton's AOT compile."""
