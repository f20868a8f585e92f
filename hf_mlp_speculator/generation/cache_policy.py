"""Which KV cache a speculative call decodes on, in either loop.

Speculative decoding appends drafts' slots to the cache and rewinds past the rejected ones. The package's loop can
rewind a `DynamicCache` (any call) and a plain `StaticCache` (one sequence drafting chains); transformers' assisted
decoding crops the caches it takes. What cannot be rewound is replaced or refused here, with a warning or an error
that says why and what to change. Sliding-window layers drop the slots that leave their window (a rejected draft's
slot would push a real token out) and cannot be rewound past what they dropped: one chain keeps no masked slot, so a
cache that keeps every slot, under the model's own sliding mask, sees exactly the window; a batch or a tree is refused
when it could fill more slots than the window holds.
"""

from transformers import DynamicCache
from transformers.utils import logging

from .transformers_hooks import (
    REWINDS_SLIDING_LAYERS,
    cache_kind,
    every_slot_copy,
    has_sliding_layers,
    holds_every_token,
    pop_prepared_cache,
)

logger = logging.get_logger(__name__)

# What generate() prepares for a model's forward that the package's loop computes itself.
_LOOP_INPUTS = ("attention_mask", "position_ids", "use_cache", "logits_to_keep", "cache_position")


def take_cache(model, model_kwargs: dict, generation_config, input_ids, num_nodes: int, tree: bool) -> tuple:
    """
    The cache the package's loop decodes on, from the one `generate()` prepared in `model_kwargs` (the user's, or one
    of `cache_implementation`), and how many of the prompt's tokens it already holds (a prefix cache: a system prompt,
    a chat's earlier turns). A step verifies up to `num_nodes` drafts per row, of a chain or a `tree`.
    """
    cache = pop_prepared_cache(model_kwargs)
    for name in _LOOP_INPUTS:
        model_kwargs.pop(name, None)
    if model_kwargs:
        raise ValueError(
            f"Batched, tree or sampled speculative decoding cannot pass {sorted(model_kwargs)} to the model. Drop "
            "them, or generate one prompt at a time, greedily and without n_candidates."
        )
    rows, prompt_length = input_ids.shape
    if not prompt_length:
        raise ValueError(
            "The prompt is empty (input_ids of shape (batch, 0)): speculative decoding drafts from the hidden state "
            "of the prompt's last token. Pass at least one token, e.g. the tokenizer's BOS token."
        )
    if cache is None:
        cache = DynamicCache(config=model.config)
    cached = int(cache.get_seq_length())  # read once: a static cache counts on the device
    if cached >= prompt_length:
        raise ValueError(
            f"The cache passed to generate() already holds {cached} tokens, and the prompt has {prompt_length}: a "
            "cache must hold a prefix of the prompt and leave at least its last token to compute. Pass a copy of the "
            "cache made before the prompt's last token (copy.deepcopy(prompt_cache)), or no cache."
        )
    if has_sliding_layers(cache) and rows == 1 and not tree:
        return _sliding_chain_cache(cache, cached)
    _check_rewindable(model, cache, generation_config, rows, tree, prompt_length, num_nodes)
    return cache, cached


def _sliding_chain_cache(cache, cached: int) -> tuple:
    """One chain on a sliding-window cache: plain layers holding the same tokens, or a new cache (warned)."""
    kind = cache_kind(cache)
    if kind == "dynamic" and holds_every_token(cache):
        return (every_slot_copy(cache) if cached else DynamicCache()), cached
    if cached:
        logger.warning(
            f"This {type(cache).__name__}'s sliding-window layers already dropped tokens, which speculative decoding "
            "cannot rewind past rejected drafts: it computes the prompt again in a new DynamicCache "
            "(return_dict_in_generate=True returns it)."
        )
    elif kind is None:
        logger.warning(
            f"A {type(cache).__name__} with sliding-window layers cannot be rewound past rejected drafts: speculative "
            "decoding runs on a DynamicCache instead, as transformers' assisted decoding does."
        )
    return DynamicCache(), 0


def _check_rewindable(model, cache, generation_config, rows: int, tree: bool, prompt_length: int, num_nodes: int):
    """Refuses a cache the loop cannot rewind for this call, and a sliding window the call could overflow."""
    kind, sliding = cache_kind(cache), has_sliding_layers(cache)
    if kind is None:
        raise ValueError(
            f"Speculative decoding rewinds the cache past rejected drafts, which it can do to a DynamicCache or a "
            f"StaticCache without sliding-window layers, not to a {type(cache).__name__}"
            f"{' with sliding-window layers' * sliding}, in a batch, a tree or a sampled call. Drop "
            "cache_implementation / the cache argument, or generate one prompt at a time, greedily and without "
            "n_candidates."
        )
    if kind == "static" and (rows > 1 or tree):
        raise ValueError(
            f"A static cache serves one sequence drafting chains, and this call has "
            f"{f'{rows} sequences' if rows > 1 else 'tree candidates'}: the rows' rejected drafts would take slots it "
            "cannot free. Drop cache_implementation / the cache argument (a DynamicCache serves batches and trees), "
            "or generate one prompt at a time without n_candidates."
        )
    window = getattr(model.config.get_text_config(), "sliding_window", None)
    worst_case = prompt_length + (generation_config.max_length - prompt_length) * (num_nodes + 1)
    if sliding and window and worst_case > window:
        raise ValueError(
            f"This model attends over a sliding window of {window} cache slots, and rejected drafts occupy slots: "
            f"this call could fill up to {worst_case} slots and silently see fewer real tokens than the model should. "
            "Lower max_new_tokens, or generate one prompt at a time without n_candidates."
        )


def cache_for_assisted_decoding(model_kwargs: dict) -> None:
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
    elif has_sliding_layers(cache) and not REWINDS_SLIDING_LAYERS:
        model_kwargs[name] = DynamicCache()
