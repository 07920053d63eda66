"""Helpers for moe_core's own tests (multi-process workers)."""
