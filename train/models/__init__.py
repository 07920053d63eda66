"""The decoder: its config, the transformer, attention kinds, each family's
blocks and layouts, and the scanned stack (`families.py` says how a family
plugs in)."""
