"""Prompts of different lengths as one batch, for the base model's generation in training and in the benchmark."""

import torch


def left_padded(prompts: list[list[int]], pad_token_id: int, device=None) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Token lists of different lengths as one batch padded on the left, as decoder-only generation needs, and its
    attention mask."""
    width = max(len(prompt) for prompt in prompts)
    input_ids = torch.tensor([[pad_token_id] * (width - len(p)) + p for p in prompts], device=device)
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    return input_ids, attention_mask


__all__ = ["left_padded"]
