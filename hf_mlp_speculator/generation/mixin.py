"""How `generate(assistant_model=speculator)` reaches the package's decoding loop, or transformers' own.

transformers' `generate()` has no plug-in point for a speculator, so `MLPSpeculatorGenerationMixin` holds two methods
that replace transformers' own:

- `generate` checks the speculator against the verifier first (transformers' own check of the pair would report a
  vocab mismatch as "different tokenizers" and would quietly ignore the speculator under beam search), then runs the
  call in the package's own loop (`speculative_decoding.generate_speculatively`, through `generate`'s
  `custom_generate` slot), which reads the device once per step on every supported transformers and takes batches,
  trees and sampling keyed by position; only a call that asks for what transformers' assisted decoding alone gives
  (`needs_transformers_loop`) runs there. Then it logs the call's metrics;
- `_get_candidate_generator` returns an `MLPSpeculatorCandidateGenerator`, the way into transformers' loop, when the
  assistant is an MLPSpeculator (transformers picks its candidate generator in a fixed if/elif chain).

Both fall through to transformers unchanged for any other assistant. There are three ways to use them:
`import hf_mlp_speculator` runs `install()` (unless `HF_MLP_SPECULATOR_NO_PATCH=1`), which puts them on
`GenerationMixin` for every model; `enable_mlp_speculator(model)` binds them to one model only; and a model class may
inherit `MLPSpeculatorGenerationMixin` before its transformers base.
"""

import inspect
from functools import partial
from types import MethodType

from transformers import GenerationMixin, StopStringCriteria
from transformers.utils import logging

from ..cpu.grouped_attention import grouped_sdpa
from ..cpu.weight_layouts import adaptive_weights
from ..models.modeling_mlp_speculator import MLPSpeculatorPreTrainedModel
from .cache_policy import cache_for_assisted_decoding
from .candidate_generator import MLPSpeculatorCandidateGenerator
from .checks import check_sampling, check_schedule, check_speculator_fits
from .speculative_decoding import generate_speculatively
from .transformers_hooks import STOCK, cache_kind, check_transformers_hooks, has_sliding_layers

check_transformers_hooks()

logger = logging.get_logger(__name__)

def assistant_setting(name: str, speculator, generation_config, kwargs):
    """
    An assistant setting of the call (`assistant_confidence_threshold`, `num_assistant_tokens_schedule`) as the user
    set it: given to `generate()` (or on the generation config it was given), else on the speculator's own
    `generation_config` (where stock transformers reads an assistant's), else None. The verifier's merged config is not
    read: transformers' global defaults land there (a 0.4 threshold, which would cut chains that pay, and the
    "constant" schedule), and only what the user asked for should override the cost-aware controller.
    """
    candidates = (kwargs.get(name), getattr(generation_config, name, None),
                  getattr(getattr(speculator, "generation_config", None), name, None))  # fmt: skip
    return next((value for value in candidates if value is not None), None)


# What a `generate()` call may pass besides model inputs: its own parameters and a few of the package's.
_CALL_ARGUMENTS = {"inputs", "input_ids", "attention_mask", "position_ids", "use_cache", "tokenizer",
                   "assistant_tokenizer", "kwargs", "past_key_values", "cache"}  # fmt: skip


def needs_transformers_loop(model, generation_config, kwargs, rows: int, tree: dict, sampling: str) -> bool:
    """
    Whether a call runs in transformers' assisted decoding rather than the package's own loop
    (`speculative_decoding`), which reads the device once per step on every transformers release (transformers'
    loop reads it once per cache layer per step before 5.18). transformers' loop takes one sequence and a chain, and
    is what gives `speculative_sampling="rejection"`, per-token scores, logits, attentions or hidden states, a prompt
    given as `inputs_embeds`, a cache other than a dynamic or static one (quantized, offloaded; a sliding-window one
    is swapped in `speculative_decoding._take_cache`), and model inputs besides the tokens.
    """
    if tree or rows > 1:
        return False
    if generation_config.do_sample:
        return sampling == "rejection"
    generate_parameters = set(inspect.signature(STOCK["generate"]).parameters) | _CALL_ARGUMENTS
    model_inputs = [name for name in kwargs
                    if name not in generate_parameters and not hasattr(generation_config, name)]  # fmt: skip
    cache = kwargs.get("past_key_values", kwargs.get("cache"))
    return (
        any(getattr(generation_config, name) for name in _OUTPUTS)
        or kwargs.get("inputs_embeds") is not None
        or generation_config.cache_implementation not in (None, "dynamic", "static")
        or (cache is not None and cache_kind(cache) is None and not has_sliding_layers(cache))
        or bool(model_inputs)
    )


_OUTPUTS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")


class MLPSpeculatorGenerationMixin:
    """
    Lets `generate(assistant_model=speculator)` draft with an MLPSpeculator. See the module docstring for the three
    ways to enable it.
    """

    def generate(self, *args, **kwargs):
        speculator = kwargs.get("assistant_model")
        if not isinstance(speculator, MLPSpeculatorPreTrainedModel):
            return STOCK["generate"](self, *args, **kwargs)
        # The config the call will run with: from kwargs, a positional or keyword `generation_config`, and the model's.
        options = dict(kwargs)
        generation_config = args[1] if len(args) > 1 else options.pop("generation_config", None)
        merged = self._prepare_generation_config(generation_config, **options)[0]
        tree = {name: kwargs.pop(name) for name in ("n_candidates", "top_k_tokens_per_head") if name in kwargs}
        sampling = kwargs.pop("speculative_sampling", "keyed")
        check_speculator_fits(self, speculator, merged, tree)
        setting = partial(assistant_setting, speculator=speculator, generation_config=generation_config, kwargs=kwargs)
        kwargs["assistant_confidence_threshold"] = setting("assistant_confidence_threshold") or 0.0
        # "heuristic" (transformers' name for adapting the depth) means the cost-aware controller here.
        schedule = setting("num_assistant_tokens_schedule") or "heuristic"
        kwargs["num_assistant_tokens_schedule"] = check_schedule(schedule)
        # Never leave a previous call's figures behind.
        speculator.speculation_metrics = speculator.speculation_metrics_per_row = None
        inputs = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))
        embeds = kwargs.get("inputs_embeds")
        if inputs is None and embeds is not None:
            inputs = embeds
        rows = (1 if inputs is None else inputs.shape[0]) * (merged.num_return_sequences or 1)
        check_sampling(sampling, tree, rows)
        if not needs_transformers_loop(self, merged, kwargs, rows, tree, sampling):
            if embeds is not None:
                raise ValueError(
                    f"{'A batch' if rows > 1 else 'A sampled prompt'} given as inputs_embeds: speculative decoding "
                    "takes a prompt as inputs_embeds only in transformers' assisted decoding, one sequence at a time, "
                    "greedy or with speculative_sampling='rejection'. Pass input_ids"
                    + (" (with the batch's attention_mask), or generate one prompt at a time." if rows > 1 else
                       ", or pass speculative_sampling='rejection'.")
                )  # fmt: skip
            del kwargs["assistant_model"]
            # transformers would take prompt lookup for its own assisted decoding (and refuse num_return_sequences
            # with it): the loop takes it instead.
            kwargs["prompt_lookup_num_tokens"] = None
            # `generate` hands a `custom_generate` callable neither the streamer nor the tokenizer, without which it
            # cannot build the stop-string criterion: both travel with the loop.
            stop_strings = None
            if merged.stop_strings is not None and kwargs.get("tokenizer") is not None:
                stop_strings = StopStringCriteria(kwargs["tokenizer"], merged.stop_strings)
                kwargs["stop_strings"] = None  # or generate() would ask for the tokenizer it keeps from the loop
            kwargs["custom_generate"] = partial(
                generate_speculatively, speculator=speculator, streamer=kwargs.pop("streamer", None),
                stop_string_criterion=stop_strings, lookup_tokens=merged.prompt_lookup_num_tokens, **tree,
            )  # fmt: skip
        # On CPU, each forward on the kind of weights that measured fastest (see `weight_layouts`), and grouped heads
        # read in place, not copied, under a padded batch's or a tree's attention mask (see `grouped_attention`).
        with adaptive_weights(self), grouped_sdpa(self):
            output = STOCK["generate"](self, *args, **kwargs)
        metrics = speculator.speculation_metrics
        if metrics is not None:
            logger.info(metrics)
            if metrics.num_nonfinite_steps:
                logger.warning(
                    f"The speculator's logits were not finite (NaN or inf) in {metrics.num_nonfinite_steps} of "
                    f"{metrics.num_steps} steps, which then drafted less (output is unaffected). Its weights may have "
                    "diverged in training, or overflow in float16: check them, or load it in bfloat16 or float32."
                )
        return output

    def _get_candidate_generator(self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs,
                                 assistant_model=None, target_tokenizer=None, assistant_tokenizer=None):  # fmt: skip
        if not isinstance(assistant_model, MLPSpeculatorPreTrainedModel):
            return STOCK["_get_candidate_generator"](
                self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs,
                assistant_model, target_tokenizer, assistant_tokenizer,
            )  # fmt: skip
        if input_ids.shape[0] > 1:  # batches reach here only when given as inputs_embeds
            raise ValueError(
                f"Batched speculative decoding needs the batch as input_ids (with its attention_mask), but a batch of "
                f"{input_ids.shape[0]} came as inputs_embeds, which only transformers' one-sequence loop takes. Pass "
                "input_ids, or generate one prompt at a time."
            )
        cache_for_assisted_decoding(model_kwargs)
        return MLPSpeculatorCandidateGenerator(assistant_model, generation_config, logits_processor, self)


def install() -> None:
    """
    The package's only monkey-patch: puts `MLPSpeculatorGenerationMixin`'s two methods on `GenerationMixin`, so that
    every model's `generate(assistant_model=speculator)` drafts with the MLPSpeculator. They defer to transformers'
    own methods for any other assistant. Run by `import hf_mlp_speculator`; undone by `uninstall()`.
    """
    for name in STOCK:
        setattr(GenerationMixin, name, getattr(MLPSpeculatorGenerationMixin, name))


def uninstall() -> None:
    """Restores transformers' own `GenerationMixin` methods."""
    for name, method in STOCK.items():
        setattr(GenerationMixin, name, method)


def enable_mlp_speculator(model):
    """Lets this one `model` take an MLPSpeculator as `assistant_model`, without patching transformers. Returns it."""
    for name in STOCK:
        setattr(model, name, MethodType(getattr(MLPSpeculatorGenerationMixin, name), model))
    return model
