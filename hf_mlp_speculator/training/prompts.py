"""Prompts for the base model to continue: the user's, and user turns the base model writes itself (Magpie).

A chat model continued from its template's user prefix (the system turn and the opening of a user turn, with nothing
after it) writes a plausible user request, as Magpie (Xu et al., 2024) found. Sampling many of these gives prompts in
the base model's own distribution, without limit. They are deduplicated, never include a held-out prompt, and are
rendered as chat turns up to the assistant's answer, which is what the speculator must learn to draft.
"""

import re

import torch
from transformers.utils import logging

from .targets import end_of_sequence_ids

logger = logging.get_logger(__name__)

_SENTINEL = "\u2063hf-mlp-speculator-user-turn\u2063"


def normalized(text: str) -> str:
    """The form in which two prompts count as the same: lower case, single spaces, no edge punctuation."""
    return re.sub(r"\s+", " ", text).strip().strip(".!?:;,\"'").lower()


def render_chat_prompt(tokenizer, user_text: str) -> list[int]:
    """`user_text` as one user turn, rendered up to the assistant's answer, as token ids."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": user_text}], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]


def user_prefix(tokenizer) -> list[int]:
    """The token ids the chat template puts before a user's words (system turn included)."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            "Synthesizing prompts needs a chat model: the tokenizer has no chat template to take the user turn's "
            "prefix from. Give prompts with --prompts, or set --synthesize-prompts 0."
        )
    text = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], tokenize=False)
    return tokenizer(text[: text.index(_SENTINEL)], add_special_tokens=False)["input_ids"]


@torch.no_grad()
def synthesize_user_turns(base, tokenizer, count: int, seed: int, max_new_tokens: int = 48) -> list[str]:
    """
    `count` user requests sampled from the base model after its chat template's user prefix (temperature 1, top-p
    0.95), ending at the end of the turn. Some come out empty or cut off; callers filter them.
    """
    prefix = torch.tensor([user_prefix(tokenizer)], device=base.device)
    end_of_turn = set(end_of_sequence_ids(base, tokenizer))
    torch.manual_seed(seed)
    output = base.generate(
        prefix.repeat(count, 1), attention_mask=torch.ones(count, prefix.shape[1], dtype=torch.long, device=base.device),
        do_sample=True, temperature=1.0, top_p=0.95, top_k=0, max_new_tokens=max_new_tokens,
        eos_token_id=sorted(end_of_turn), pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
    )  # fmt: skip
    turns = []
    for row in output[:, prefix.shape[1] :].tolist():
        ended = any(token in end_of_turn for token in row)
        text = tokenizer.decode([t for t in row if t not in end_of_turn], skip_special_tokens=True).strip()
        turns.append(text if ended else "")  # a turn cut off by max_new_tokens is not a whole request
    return turns


def keep_new(candidates: list[str], seen: set[str], min_chars: int = 8) -> list[str]:
    """The candidates that are long enough and not yet `seen` (which they are added to), compared `normalized`."""
    kept = []
    for text in candidates:
        key = normalized(text)
        if len(key) >= min_chars and key not in seen:
            seen.add(key)
            kept.append(text)
    return kept
