"""Every preset by name: the configs the training program and `--dry_run`
take.

Small training presets (`tiny_dsv3`, the default, `tiny_mixtral`,
`tiny_qwen3`, and one per family of issue 33: `tiny_qwen3_next`,
`tiny_gpt_oss`, `tiny_llama4`, `tiny_gemma4`, `tiny_deepseek_v4`) train on
a laptop CPU in minutes; `tpu_v5e_dsv3` (0.66B) fills one TPU v5e chip;
full-size configs of published MoE models (`FULL_SIZE`), from their
released configs, are used for `--dry_run` counts (`sizing.py`) and checked
against the published parameter counts their rows carry (`published.py`).
Qwen3-Next's hybrid stack, Llama 4's interleaved layers and DeepSeek-V4's
decoder train unrolled only (--noscan_layers).

Each family's presets are a table of rows in a module of their own
(`rows.Preset`); adding a preset is adding a row there, adding a family is
adding its module to `_FAMILIES`.
"""

from __future__ import annotations

from train.presets import deepseek_v3
from train.presets import deepseek_v4
from train.presets import gemma4
from train.presets import gpt_oss
from train.presets import llama4
from train.presets import mixtral_qwen3_olmoe
from train.presets import qwen3_next
from train.presets import rows

# In the order `--model`'s list gives them.
_FAMILIES = (
    deepseek_v3,
    mixtral_qwen3_olmoe,
    qwen3_next,
    gpt_oss,
    llama4,
    gemma4,
    deepseek_v4,
)

PRESETS: dict[str, rows.Preset] = {
    p.model.name: p for family in _FAMILIES for p in family.PRESETS
}
DEFAULT_PRESET = "tiny_dsv3"
# The published models: the presets whose rows carry published counts.
FULL_SIZE = tuple(
    name for name, p in PRESETS.items() if p.published is not None
)


def get_preset(name: str) -> rows.Preset:
  if name not in PRESETS:
    raise ValueError(
        f"unknown model preset {name!r}; valid names: {sorted(PRESETS)}."
    )
  return PRESETS[name]
