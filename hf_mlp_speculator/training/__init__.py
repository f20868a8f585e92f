"""The trainer: `train(SpeculatorTrainingArguments(...))`, or `hf-mlp-speculator train ...` on the command line.

- `arguments`: the settings, one flag each;
- `documents`: training documents (read by `utils.data_sources`), held out by hash and packed;
- `prompts`: prompts the base model writes itself (Magpie);
- `targets`: what the base model computes once (hidden states, top-k distributions), and its cache;
- `training_data`: which targets a run uses, under a time budget;
- `initialization`: heads that start from the base model's embeddings;
- `losses`: distillation and acceptance;
- `checkpoints`: atomic checkpoints and the guard against mixing runs;
- `loop`: `train()`, the loop itself.
"""

from .arguments import SpeculatorTrainingArguments, add_arguments, from_namespace
from .checkpoints import TrainerState, latest_checkpoint
from .loop import lr_multiplier, train


def run(namespace) -> int:
    output_dir = train(from_namespace(namespace))
    print(f"Speculator saved to {output_dir}")
    return 0


__all__ = ["SpeculatorTrainingArguments", "TrainerState", "add_arguments", "latest_checkpoint", "lr_multiplier",
           "run", "train"]  # fmt: skip
