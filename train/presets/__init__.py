"""The presets: named models with the runs they suggest (`--model=NAME`).

`get_preset(name)` looks one up; `PRESETS` holds them all, `FULL_SIZE` names
the published models among them. The rows live in `catalog.py`; the
published parameter counts in `published.py`, and what a preset costs
(parameters, FLOPs, memory) in `sizing.py`.
"""

from train.presets.catalog import *  # noqa: F401,F403  (the package's face)
