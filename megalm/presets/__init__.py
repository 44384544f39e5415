"""Model presets as data: GPT-3 125M..175B, Llama-2/3, Mixtral 8x7B and the tiny CPU models.

* :mod:`.spec`: the frozen dataclasses a preset is made of (shape, layout, schedule);
* :mod:`.table`: the presets, ``PRESETS[name]``;
* :mod:`.flags`: a preset plus the launcher's overrides -> ``pretrain_gpt.py`` flags;
* ``python3 tools/presets.py``: list them, print one's flags, or the bash that
  ``scripts/common.sh`` evaluates.  ``tools/estimate.py --preset NAME`` plans one's memory.
"""

from megalm.presets.flags import Launch, Overrides, get_preset, preset_flags, recipe_flags, resolve
from megalm.presets.spec import Layout, MoE, Preset, PresetError, RunDefaults, Schedule, Shape
from megalm.presets.table import PRESETS

__all__ = [
    "PRESETS",
    "Launch",
    "Layout",
    "MoE",
    "Overrides",
    "Preset",
    "PresetError",
    "RunDefaults",
    "Schedule",
    "Shape",
    "get_preset",
    "preset_flags",
    "recipe_flags",
    "resolve",
]
