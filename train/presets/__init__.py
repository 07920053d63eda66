"""The presets: named models with the runs they suggest (`--model=NAME`).

`get_preset(name)` looks one up; `PRESETS` holds them all and `FULL_SIZE`
names the published models among them (`catalog.py`). A preset is a row
(`rows.Preset`: the model, its suggested run, the published counts) in its
family's table: `deepseek_v3.py`, `mixtral_qwen3_olmoe.py`, `qwen3_next.py`,
`gpt_oss.py`, `llama4.py`, `gemma4.py`, `deepseek_v4.py`. `published.py`
compares the counts with `sizing.py`'s (parameters, FLOPs, memory).
"""

# The package's face: the names its users have always called.
# pylint: disable=g-importing-member
from train.models.model_config import ModelConfig  # noqa: F401
from train.presets.catalog import DEFAULT_PRESET  # noqa: F401
from train.presets.catalog import FULL_SIZE  # noqa: F401
from train.presets.catalog import get_preset  # noqa: F401
from train.presets.catalog import PRESETS  # noqa: F401
from train.presets.deepseek_v3 import DEEPSEEK_V3  # noqa: F401
from train.presets.deepseek_v3 import deepseek_v3_moe  # noqa: F401
from train.presets.deepseek_v3 import TINY_DSV3  # noqa: F401
from train.presets.deepseek_v3 import TPU_V5E_DSV3  # noqa: F401
from train.presets.deepseek_v3 import TPU_V5E_DSV3_REMAT  # noqa: F401
from train.presets.deepseek_v4 import deepseek_v4_moe  # noqa: F401
from train.presets.llama4 import llama4_moe  # noqa: F401
from train.presets.mixtral_qwen3_olmoe import MIXTRAL_8X7B  # noqa: F401
from train.presets.mixtral_qwen3_olmoe import QWEN3_30B_A3B  # noqa: F401
from train.presets.mixtral_qwen3_olmoe import softmax_moe  # noqa: F401
from train.presets.rows import Preset  # noqa: F401
from train.presets.rows import TrainDefaults  # noqa: F401
