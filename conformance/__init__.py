"""The conformance suite every MoE backend runs (see `suite.py`)."""
