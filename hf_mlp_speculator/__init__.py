"""MLPSpeculator speculative decoding for Hugging Face transformers.

Importing this package registers `mlp_speculator` with `AutoConfig`/`AutoModel` and, unless the environment sets
`HF_MLP_SPECULATOR_NO_PATCH=1`, lets every model's `generate()` take an MLPSpeculator as `assistant_model`
(see `hf_mlp_speculator.generation`).
"""

import os

from transformers import AutoConfig, AutoModel

from .candidate_generator import MLPSpeculatorCandidateGenerator
from .configuration_mlp_speculator import MLPSpeculatorConfig
from .generation import MLPSpeculatorGenerationMixin, enable_mlp_speculator, install, uninstall
from .metrics import SpeculationMetrics
from .modeling_mlp_speculator import MLPSpeculatorOutput, MLPSpeculatorPreTrainedModel
from .packed_linear import fast_cpu_decoding

AutoConfig.register(MLPSpeculatorConfig.model_type, MLPSpeculatorConfig, exist_ok=True)
AutoModel.register(MLPSpeculatorConfig, MLPSpeculatorPreTrainedModel, exist_ok=True)
if os.environ.get("HF_MLP_SPECULATOR_NO_PATCH", "0") != "1":
    install()

__version__ = "0.1.0"
__all__ = [
    "MLPSpeculatorCandidateGenerator",
    "MLPSpeculatorConfig",
    "MLPSpeculatorGenerationMixin",
    "MLPSpeculatorOutput",
    "MLPSpeculatorPreTrainedModel",
    "SpeculationMetrics",
    "enable_mlp_speculator",
    "fast_cpu_decoding",
    "install",
    "uninstall",
]
