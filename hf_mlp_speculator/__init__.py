"""MLPSpeculator speculative decoding for Hugging Face transformers.

Importing this package registers `mlp_speculator` with `AutoConfig`/`AutoModel` and, unless the environment sets
`HF_MLP_SPECULATOR_NO_PATCH=1`, lets every model's `generate()` take an MLPSpeculator as `assistant_model`
(see `hf_mlp_speculator.generation.mixin`).
"""

import os

from transformers import AutoConfig, AutoModel

from .cpu.fast_decoding import fast_cpu_decoding
from .drafting.metrics import SpeculationMetrics
from .drafting.state import FixedDepth, SpeculationState, speculation_state
from .generation.candidate_generator import MLPSpeculatorCandidateGenerator
from .generation.mixin import MLPSpeculatorGenerationMixin, enable_mlp_speculator, install, uninstall
from .models.configuration_mlp_speculator import MLPSpeculatorConfig
from .models.modeling_mlp_speculator import MLPSpeculatorOutput, MLPSpeculatorPreTrainedModel
from .tools import default_models  # the offline default pair, for examples and demos
from .tools.export import export_speculator

AutoConfig.register(MLPSpeculatorConfig.model_type, MLPSpeculatorConfig, exist_ok=True)
AutoModel.register(MLPSpeculatorConfig, MLPSpeculatorPreTrainedModel, exist_ok=True)
if os.environ.get("HF_MLP_SPECULATOR_NO_PATCH", "0") != "1":
    install()

__version__ = "0.1.0"
__all__ = [
    "FixedDepth",
    "MLPSpeculatorCandidateGenerator",
    "MLPSpeculatorConfig",
    "MLPSpeculatorGenerationMixin",
    "MLPSpeculatorOutput",
    "MLPSpeculatorPreTrainedModel",
    "SpeculationMetrics",
    "SpeculationState",
    "default_models",
    "enable_mlp_speculator",
    "export_speculator",
    "fast_cpu_decoding",
    "install",
    "speculation_state",
    "uninstall",
]
