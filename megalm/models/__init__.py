"""Models built from the tensor-parallel transformer blocks."""

from megalm.models.gpt import GPTModel
from megalm.models.layer_split import layers_for_stage

__all__ = ["GPTModel", "layers_for_stage"]
