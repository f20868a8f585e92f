"""SDPA attention that reads grouped key/value heads in place, for the base model's target computation on CPU.

Under an attention mask, transformers' `sdpa` attention copies each key and value head `num_key_value_groups` times
(`repeat_kv`) before every call, because CUDA's SDPA kernels take grouped heads only without a mask. The CPU flash
kernel takes both (`enable_gqa`, torch 2.5 and later), and there the copies are most of a decoding step: the base
continues its prompts 128 rows at a time, left-padded, so every step has a mask and copies the whole cache three
times for SmolLM2-135M (9 query heads, 3 key/value heads). Continuing 128 training prompts by 160 tokens on a 2-core
Xeon ran at 150 positions/s with the copies and 239 without, with bit-identical targets (2026-12-07).
"""

import contextlib

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

NAME = "hf_mlp_speculator_grouped_sdpa"


def grouped_sdpa_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' `sdpa` attention, except that on CPU grouped key/value heads under a mask are read in place."""
    grouped = key.shape[1] != query.shape[1]
    if attention_mask is None or not grouped or query.device.type != "cpu" or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    output = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )
    return output.transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def grouped_sdpa(model):
    """Inside, `model` attends with `grouped_sdpa_attention_forward` if it attends with `sdpa`; otherwise as it was."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        yield model
        return
    AttentionInterface.register(NAME, grouped_sdpa_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)  # the same masks as `sdpa`
    model.set_attn_implementation(NAME)
    try:
        yield model
    finally:
        model.set_attn_implementation("sdpa")
