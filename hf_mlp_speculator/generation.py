"""How `generate(assistant_model=speculator)` reaches the MLPSpeculator candidate generator.

transformers picks its candidate generator in `GenerationMixin._get_candidate_generator`, a fixed if/elif chain with no
registry, so an MLPSpeculator needs a hook there. `MLPSpeculatorGenerationMixin` holds the two methods that make it
work; everything else is transformers' own assisted decoding loop:

- `generate` checks the speculator against the verifier first (transformers' own check of the pair would report a
  vocab mismatch as "different tokenizers" and would quietly ignore the speculator under beam search), then logs the
  call's metrics;
- `_get_candidate_generator` returns an `MLPSpeculatorCandidateGenerator` when the assistant is an MLPSpeculator.

Both fall through to transformers unchanged for any other assistant. There are three ways to use them:
`import hf_mlp_speculator` runs `install()` (unless `HF_MLP_SPECULATOR_NO_PATCH=1`), which puts them on
`GenerationMixin` for every model; `enable_mlp_speculator(model)` binds them to one model only; and a model class may
inherit `MLPSpeculatorGenerationMixin` before its transformers base.
"""

from types import MethodType

from transformers import GenerationMixin
from transformers.utils import logging

from .candidate_generator import MLPSpeculatorCandidateGenerator
from .modeling_mlp_speculator import MLPSpeculatorPreTrainedModel

logger = logging.get_logger(__name__)

_STOCK = {name: getattr(GenerationMixin, name) for name in ("generate", "_get_candidate_generator")}


def check_speculator_fits(model, speculator: MLPSpeculatorPreTrainedModel, generation_config=None, **kwargs) -> None:
    """Raises a `ValueError` naming the problem and its fix when `speculator` cannot draft for `model`."""
    text_config = model.config.get_text_config()
    spec_config = speculator.config
    trained_for = f" (it was trained for {spec_config.base_model_name_or_path})" * bool(
        spec_config.base_model_name_or_path
    )
    if spec_config.emb_dim != text_config.hidden_size:
        raise ValueError(
            f"The speculator's emb_dim is {spec_config.emb_dim} but the model's hidden_size is "
            f"{text_config.hidden_size}: this speculator was trained for another base model{trained_for}. Use a "
            "speculator trained for this model, or train one with `hf-mlp-speculator train`."
        )
    if spec_config.vocab_size != text_config.vocab_size:
        hint = (
            f" If the model's vocabulary is only padded (its tokenizer has at most {spec_config.vocab_size} tokens), "
            f"pad the speculator to match: `speculator.resize_vocab({text_config.vocab_size})`."
            if spec_config.vocab_size < text_config.vocab_size
            else ""
        )
        raise ValueError(
            f"The speculator's vocab_size is {spec_config.vocab_size} but the model's vocab_size is "
            f"{text_config.vocab_size}{trained_for}.{hint}"
        )
    generation_config = generation_config or model.generation_config
    num_beams = kwargs.get("num_beams", generation_config.num_beams) or 1
    if num_beams > 1:
        raise ValueError(
            f"Beam search (num_beams={num_beams}) cannot use an MLPSpeculator: speculative decoding verifies a single "
            "sequence. Use greedy decoding or sampling (num_beams=1), or drop assistant_model."
        )


class MLPSpeculatorGenerationMixin:
    """
    Lets `generate(assistant_model=speculator)` draft with an MLPSpeculator. See the module docstring for the three
    ways to enable it.
    """

    def generate(self, *args, **kwargs):
        speculator = kwargs.get("assistant_model")
        if not isinstance(speculator, MLPSpeculatorPreTrainedModel):
            return _STOCK["generate"](self, *args, **kwargs)
        check_speculator_fits(self, speculator, **kwargs)
        speculator.speculation_metrics = None  # never leave a previous call's figures behind
        output = _STOCK["generate"](self, *args, **kwargs)
        if speculator.speculation_metrics is not None:
            logger.info(speculator.speculation_metrics)
        return output

    def _get_candidate_generator(self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs,
                                 assistant_model=None, target_tokenizer=None, assistant_tokenizer=None):  # fmt: skip
        if not isinstance(assistant_model, MLPSpeculatorPreTrainedModel):
            return _STOCK["_get_candidate_generator"](
                self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs,
                assistant_model, target_tokenizer, assistant_tokenizer,
            )  # fmt: skip
        if input_ids.shape[0] > 1:
            raise ValueError(
                f"Speculative decoding through transformers' assisted generation runs one sequence at a time, but the "
                f"batch has {input_ids.shape[0]}. Call generate() once per prompt."
            )
        generator = MLPSpeculatorCandidateGenerator(assistant_model, generation_config, logits_processor)
        # The speculator is what the user holds after generate(), so that is where the call's metrics are left.
        assistant_model.speculation_metrics = generator.metrics
        return generator


def install() -> None:
    """
    The package's only monkey-patch: puts `MLPSpeculatorGenerationMixin`'s two methods on `GenerationMixin`, so that
    every model's `generate(assistant_model=speculator)` drafts with the MLPSpeculator. They defer to transformers'
    own methods for any other assistant. Run by `import hf_mlp_speculator`; undone by `uninstall()`.
    """
    for name in _STOCK:
        setattr(GenerationMixin, name, getattr(MLPSpeculatorGenerationMixin, name))


def uninstall() -> None:
    """Restores transformers' own `GenerationMixin` methods."""
    for name, method in _STOCK.items():
        setattr(GenerationMixin, name, method)


def enable_mlp_speculator(model):
    """Lets this one `model` take an MLPSpeculator as `assistant_model`, without patching transformers. Returns it."""
    for name in _STOCK:
        setattr(model, name, MethodType(getattr(MLPSpeculatorGenerationMixin, name), model))
    return model
