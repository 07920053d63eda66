"""Helpers for train/'s tests: small runs and the worker processes that
tests start as scripts."""
