"""SDPA attention that reads grouped key/value heads in place on CPU: for decoding, and for the trainer's targets.

Under an attention mask, transformers' `sdpa` attention copies each key and value head `num_key_value_groups` times
(`repeat_kv`) before every call, because CUDA's SDPA kernels take grouped heads only without a mask (5.25 spares
one-token steps the copies, not longer ones). Since torch 2.9 the CPU flash kernel takes both (`enable_gqa`), with
the same results to the bit; torch 2.7 and 2.8 send grouped heads under a mask to the slower math kernel, which copies
them itself. The copies grow with the cache, whatever the new tokens: at every step of a padded batch, plain or
speculative, and of a tree, the whole cache is copied three times per layer for SmolLM2-135M (9 query heads, 3
key/value heads), 12% of a batch-8 step of plain decoding on a 2-core AMD EPYC (AVX2, transformers 5.17, 2026-12-07).
The trainer continues its prompts 128 rows at a time, left-padded: 150 positions/s with the copies and 239 without on
a 2-core Xeon, with the same tokens.
"""

import contextlib
import functools

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils.import_utils import is_torch_greater_or_equal

CPU_FLASH_TAKES_GROUPED_HEADS = is_torch_greater_or_equal("2.9")


def grouped_sdpa_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    *,
    sdpa,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """`sdpa`, transformers' attention function, except that on CPU grouped heads under a mask are read in place.
    (With a mask, `sdpa` does not use `is_causal`: the mask holds the causal pattern.)"""
    grouped = key.shape[1] != query.shape[1]
    elsewhere = query.device.type != "cpu" or any(kwargs.get(k) is not None for k in ("position_bias", "softcap"))
    if attention_mask is None or not grouped or elsewhere:
        return sdpa(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    output = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )
    return output.transpose(1, 2).contiguous(), None


@functools.cache
def _reading_in_place(sdpa):
    """The one entry that stands for `sdpa` in every call: a compiled forward traced with it is not traced again."""
    return functools.partial(grouped_sdpa_attention_forward, sdpa=sdpa)


@contextlib.contextmanager
def grouped_sdpa(model: nn.Module):
    """
    Inside, `sdpa` attention on CPU reads grouped key/value heads in place under a mask, for `model` and any other
    model of the process (the same results); for a model elsewhere, before torch 2.9, or inside another `grouped_sdpa`,
    nothing changes. The entry is swapped in transformers' attention registry rather than `model` switched to a new
    name, because some models test for the name "sdpa" itself (sparse-attention ones apply their index mask only under
    it).
    """
    previous = ALL_ATTENTION_FUNCTIONS["sdpa"]
    nested = getattr(previous, "func", None) is grouped_sdpa_attention_forward
    if model.device.type != "cpu" or not CPU_FLASH_TAKES_GROUPED_HEADS or nested:
        yield model
        return
    ALL_ATTENTION_FUNCTIONS["sdpa"] = _reading_in_place(previous)
    try:
        yield model
    finally:
        del ALL_ATTENTION_FUNCTIONS["sdpa"]  # this override; transformers' own entry shows again
        if ALL_ATTENTION_FUNCTIONS["sdpa"] is not previous:  # an override that was there before
            ALL_ATTENTION_FUNCTIONS["sdpa"] = previous
