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

import transformers
from packaging import version
from transformers import DynamicCache, GenerationMixin, StopStringCriteria
from transformers.cache_utils import DynamicSlidingWindowLayer
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.utils import logging

from .candidate_generator import MLPSpeculatorCandidateGenerator
from .kv_cache import cache_kind
from .modeling_mlp_speculator import MLPSpeculatorPreTrainedModel
from .packed_linear import adaptive_packing
from .speculative_decoding import generate_speculatively

logger = logging.get_logger(__name__)

_STOCK = {name: getattr(GenerationMixin, name) for name in ("generate", "_get_candidate_generator")}

# The oldest and the newest transformers releases the test suite ran on (.ci/run runs both; pyproject.toml requires the
# oldest). Later releases are accepted as long as the hooks below are as this package knows them.
OLDEST_TRANSFORMERS, NEWEST_TESTED_TRANSFORMERS = "5.13.0", "5.25.0"


def check_transformers_hooks() -> None:
    """
    Raises an `ImportError` naming the supported range when transformers is older than it, or when one of the private
    hooks this package relies on is not as in the tested releases, so that a changed transformers fails at import
    rather than midway through generate().
    """
    supported = f"transformers>={OLDEST_TRANSFORMERS}"
    if version.parse(transformers.__version__) < version.parse(OLDEST_TRANSFORMERS):
        raise ImportError(
            f"hf_mlp_speculator supports {supported}, but transformers {transformers.__version__} is installed. "
            f"Upgrade it: pip install '{supported}'."
        )

    def parameters(function):
        return list(inspect.signature(function).parameters)

    hooks = {
        "GenerationMixin._get_candidate_generator (overridden with the same positional parameters)": (
            parameters(_STOCK["_get_candidate_generator"]),
            ["self", "generation_config", "input_ids", "inputs_tensor", "logits_processor", "model_kwargs",
             "assistant_model", "target_tokenizer", "assistant_tokenizer"],
        ),  # fmt: skip
        "GenerationMixin.generate's custom_generate argument (batches and trees run there)": (
            "custom_generate" in parameters(_STOCK["generate"]),
            True,
        ),
        # generate() calls a custom_generate callable as it calls its own decoding methods, such as _sample.
        "the decoding-method convention of GenerationMixin._sample": (
            parameters(GenerationMixin._sample)[:5],
            ["self", "input_ids", "logits_processor", "stopping_criteria", "generation_config"],
        ),
        "GenerationMixin._prepare_generation_config (merges a call's generation config)": (
            parameters(GenerationMixin._prepare_generation_config)[:2],
            ["self", "generation_config"],
        ),
        "CandidateGenerator.requires_model_outputs (drafts read the verifier's hidden states)": (
            "requires_model_outputs" in vars(CandidateGenerator),
            True,
        ),
    }
    changed = [name for name, (found, expected) in hooks.items() if found != expected]
    if changed:
        raise ImportError(
            f"hf_mlp_speculator supports {supported} as far as its private hooks stay as they were, but transformers "
            f"{transformers.__version__} changed {'; '.join(changed)}. Install a release it was tested on: "
            f"pip install '{supported},<={NEWEST_TESTED_TRANSFORMERS}'."
        )


check_transformers_hooks()


def check_speculator_fits(model, speculator: MLPSpeculatorPreTrainedModel, generation_config, tree: dict) -> None:
    """
    Raises a `ValueError` naming the problem and its fix when `speculator` cannot draft for `model` under
    `generation_config`, the call's merged generation config, and the `tree` options of the call.
    """
    if model.config.is_encoder_decoder:
        raise ValueError(
            f"{type(model).__name__} is an encoder-decoder model, and an MLPSpeculator drafts from the hidden states "
            "of a decoder-only model (a causal LM). Use a decoder-only base model, or drop assistant_model."
        )
    on_meta = [name for name, param in speculator.named_parameters() if param.is_meta]
    if on_meta:
        raise ValueError(
            f"The speculator's weights are on the meta device (e.g. {on_meta[0]}): they hold no values to draft with. "
            "Load it with real weights (`AutoModel.from_pretrained(...)` without a meta device_map), or materialise "
            "it (`speculator.to_empty(device=...)`, then `load_state_dict`)."
        )
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
    num_beams = generation_config.num_beams or 1
    if num_beams > 1:
        raise ValueError(
            f"Beam search (num_beams={num_beams}) cannot use an MLPSpeculator: speculative decoding verifies a single "
            "sequence. Use greedy decoding or sampling (num_beams=1), or drop assistant_model."
        )
    num_assistant_tokens = generation_config.num_assistant_tokens
    if num_assistant_tokens is not None and (not _is_int(num_assistant_tokens) or num_assistant_tokens < 1):
        raise ValueError(
            f"num_assistant_tokens={num_assistant_tokens!r}: an MLPSpeculator drafts with its first "
            f"num_assistant_tokens heads, so it must be a whole number between 1 and "
            f"n_predict={spec_config.n_predict} "
            "(larger values mean all heads). To decode without speculation, drop assistant_model."
        )
    lookup = generation_config.prompt_lookup_num_tokens
    if lookup is not None and (not _is_int(lookup) or lookup < 1):
        raise ValueError(
            f"prompt_lookup_num_tokens={lookup!r}: prompt lookup drafts that many tokens per step, so it must be a "
            "positive integer (transformers refuses the same). Drop it to draft with the speculator alone."
        )
    n_candidates = tree.get("n_candidates")
    if n_candidates is not None and (not _is_int(n_candidates) or n_candidates < 1):
        raise ValueError(
            f"n_candidates={n_candidates!r}: a tree keeps that many candidate paths, so it must be a positive "
            f"integer (the speculator's own is {spec_config.n_candidates})."
        )
    if tree and _attends_by_alibi(model):
        raise ValueError(
            f"Tree candidates need a model that places each node by its position_ids under a custom 4D attention "
            f"mask, and {type(model).__name__} derives its positions from the attention mask (ALiBi). Drop "
            "n_candidates / top_k_tokens_per_head to draft chains, which it takes."
        )
    top_k = tree.get("top_k_tokens_per_head")
    if top_k is not None and (not isinstance(top_k, (list, tuple)) or not all(_is_int(k) and k > 0 for k in top_k)):
        raise ValueError(
            f"top_k_tokens_per_head={top_k!r}: give a list of positive integers, one branching factor per head "
            f"(the speculator's own is {spec_config.top_k_tokens_per_head})."
        )


def check_schedule(schedule: str) -> str:
    """`num_assistant_tokens_schedule`: "constant" drafts `num_assistant_tokens` heads every step (vLLM's
    `num_speculative_tokens`); "heuristic" and "heuristic_transient" leave each step's depth to the cost-aware
    controller."""
    if schedule not in ("constant", "heuristic", "heuristic_transient"):
        raise ValueError(
            f"num_assistant_tokens_schedule={schedule!r}: choose 'constant' (every step drafts num_assistant_tokens "
            "heads) or leave it unset, 'heuristic' or 'heuristic_transient' (the cost-aware controller chooses)."
        )
    return schedule


def check_sampling(sampling, tree: dict, rows: int) -> None:
    """
    `speculative_sampling`: "keyed" (the default: a seed gives the same tokens, see `position_noise`) or "rejection"
    (transformers' rejection sampling, which keeps more drafts where the speculator's distribution differs from the
    verifier's, but whose tokens change with the drafting), for one sequence and a chain only.
    """
    if sampling not in ("keyed", "rejection"):
        raise ValueError(f"speculative_sampling={sampling!r}: choose 'keyed' (the default) or 'rejection'.")
    if sampling == "rejection" and (tree or rows > 1):
        raise ValueError(
            "speculative_sampling='rejection' runs in transformers' assisted decoding, one sequence and one chain at "
            "a time: generate one prompt at a time without n_candidates, or use the default keyed sampling."
        )


def _attends_by_alibi(model) -> bool:
    """Whether `model` biases attention by ALiBi (Bloom, MPT, Falcon with `alibi`), whose positions come from the
    attention mask rather than `position_ids`."""
    config = model.config.get_text_config()
    return config.model_type in ("bloom", "mpt") or bool(getattr(config, "alibi", False))


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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
    generate_parameters = set(inspect.signature(_STOCK["generate"]).parameters) | _CALL_ARGUMENTS
    model_inputs = [name for name in kwargs
                    if name not in generate_parameters and not hasattr(generation_config, name)]  # fmt: skip
    cache = kwargs.get("past_key_values", kwargs.get("cache"))
    return (
        any(getattr(generation_config, name) for name in _OUTPUTS)
        or kwargs.get("inputs_embeds") is not None
        or generation_config.cache_implementation not in (None, "dynamic", "static")
        or (cache is not None and cache_kind(cache) is None and not any(getattr(cache, "is_sliding", [])))
        or bool(model_inputs)
    )


# Whether this transformers' sliding-window cache layers keep what they drop, so that assisted decoding can crop them.
_REWINDS_SLIDING_LAYERS = hasattr(DynamicSlidingWindowLayer, "activate_past_recording")


def _cache_for_assisted_decoding(model_kwargs: dict) -> None:
    """
    Swaps, in the `model_kwargs` that transformers' assisted decoding runs on, a cache it would get wrong for a new
    `DynamicCache`: one that already holds part of the prompt (its first step computes the whole prompt again on top,
    through transformers 5.25 at least: other tokens, silently), and before 5.17 one with sliding-window layers (they
    refuse `crop` once past their window). Plain layers under the model's own sliding mask see exactly its window.
    """
    name = "cache" if "cache" in model_kwargs else "past_key_values"
    cache = model_kwargs.get(name)
    if cache is None:
        return
    if cache.get_seq_length():
        logger.warning(
            "transformers' assisted decoding, which this call needs, cannot start from a cache that already holds "
            "part of the prompt: it computes the prompt again in a new DynamicCache (return_dict_in_generate=True "
            "returns it). The package's own loop starts from it: drop output_scores / output_logits / "
            "output_attentions / output_hidden_states, speculative_sampling='rejection', inputs_embeds or extra model "
            "inputs, whichever the call has."
        )
        model_kwargs[name] = DynamicCache()
    elif any(getattr(cache, "is_sliding", [])) and not _REWINDS_SLIDING_LAYERS:
        model_kwargs[name] = DynamicCache()


_OUTPUTS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")


class MLPSpeculatorGenerationMixin:
    """
    Lets `generate(assistant_model=speculator)` draft with an MLPSpeculator. See the module docstring for the three
    ways to enable it.
    """

    def generate(self, *args, **kwargs):
        speculator = kwargs.get("assistant_model")
        if not isinstance(speculator, MLPSpeculatorPreTrainedModel):
            return _STOCK["generate"](self, *args, **kwargs)
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
        # On CPU, each forward on packed or plain weights, whichever measured faster (see `packed_linear`).
        with adaptive_packing(self):
            output = _STOCK["generate"](self, *args, **kwargs)
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
            return _STOCK["_get_candidate_generator"](
                self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs,
                assistant_model, target_tokenizer, assistant_tokenizer,
            )  # fmt: skip
        if input_ids.shape[0] > 1:  # batches reach here only when given as inputs_embeds
            raise ValueError(
                f"Batched speculative decoding needs the batch as input_ids (with its attention_mask), but a batch of "
                f"{input_ids.shape[0]} came as inputs_embeds, which only transformers' one-sequence loop takes. Pass "
                "input_ids, or generate one prompt at a time."
            )
        _cache_for_assisted_decoding(model_kwargs)
        generator = MLPSpeculatorCandidateGenerator(assistant_model, generation_config, logits_processor, self)
        # The speculator is what the user holds after generate(), so that is where the call's metrics are left.
        assistant_model.speculation_metrics = generator.metrics
        assistant_model.speculation_metrics_per_row = [generator.metrics]
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
