"""Caches a call is given or gives back. A cache that already holds part of the prompt (a system prompt, a chat's
earlier turns): only the rest is computed, and the output is what plain `generate()` gives with the same cache, and
what it gives without one. One sequence's cache comes back for the next turn; sliding-window models' caches."""

import copy

import pytest
import torch
from conftest import ARCHITECTURES, make_prompt, make_speculator, make_verifier
from transformers import DynamicCache

CACHED = 12


def prompts_and_cache(verifier, rows: int):
    """`rows` prompts of 20 tokens (the second left-padded by 3), and a cache holding their first CACHED tokens."""
    input_ids = torch.cat([make_prompt(20, seed=seed) for seed in range(2, 2 + rows)])
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1:, :3] = 0
    cache = DynamicCache(config=verifier.config)
    with torch.no_grad():
        verifier(input_ids[:, :CACHED], attention_mask=attention_mask[:, :CACHED], past_key_values=cache,
                 use_cache=True)  # fmt: skip
    return input_ids, attention_mask, cache


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("options", [{}, {"n_candidates": 3}, {"prompt_lookup_num_tokens": 3}],
                         ids=["chain", "tree", "hybrid"])  # fmt: skip
def test_greedy_with_a_prefix_cache_is_plain_greedy(rows, options):
    verifier, speculator = make_verifier(), make_speculator()
    input_ids, attention_mask, cache = prompts_and_cache(verifier, rows)
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=24, do_sample=False)
    expected = verifier.generate(input_ids, past_key_values=copy.deepcopy(cache), **kwargs)
    assert torch.equal(expected, verifier.generate(input_ids, **kwargs))
    forwards = []
    verifier.register_forward_pre_hook(lambda module, args, kwargs: forwards.append(kwargs["input_ids"].shape[1]),
                                       with_kwargs=True)  # fmt: skip
    output = verifier.generate(input_ids, past_key_values=copy.deepcopy(cache), assistant_model=speculator, **kwargs,
                               **options)  # fmt: skip
    assert torch.equal(output, expected)
    assert forwards[0] == input_ids.shape[1] - CACHED  # the prefill computed only what the cache did not hold


@pytest.mark.parametrize("rows", [1, 2])
def test_a_seeded_sampled_call_gives_the_same_tokens_with_a_prefix_cache(rows):
    verifier, speculator = make_verifier(), make_speculator()
    input_ids, attention_mask, cache = prompts_and_cache(verifier, rows)
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=24, do_sample=True, assistant_model=speculator)
    torch.manual_seed(7)
    without = verifier.generate(input_ids, **kwargs)
    torch.manual_seed(7)
    assert torch.equal(verifier.generate(input_ids, past_key_values=copy.deepcopy(cache), **kwargs), without)


def test_a_cache_holding_the_whole_prompt_is_refused():
    verifier, speculator = make_verifier(), make_speculator()
    input_ids, attention_mask, cache = prompts_and_cache(verifier, 1)
    with pytest.raises(ValueError, match=r"already holds 12 tokens, and the prompt has 12: a cache must hold"):
        verifier.generate(input_ids[:, :CACHED], past_key_values=cache, max_new_tokens=4, assistant_model=speculator)


@pytest.mark.parametrize("do_sample", [False, True])
def test_one_prompt_on_a_sliding_window_model_runs_past_its_window(do_sample):
    """One chain leaves no masked slot: a sliding-window model decodes past its window, greedy and sampled."""
    verifier, prompt, speculator = sliding_model(window=16), make_prompt(12), make_speculator()
    kwargs = dict(max_new_tokens=40, do_sample=do_sample)
    torch.manual_seed(3)
    output = verifier.generate(prompt, assistant_model=speculator, **kwargs)
    if do_sample:  # the same seed, other drafting: the same tokens
        torch.manual_seed(3)
        expected = verifier.generate(prompt, assistant_model=speculator, num_assistant_tokens=1, **kwargs)
    else:
        expected = verifier.generate(prompt, **kwargs)
    assert output.shape[1] == 52 and torch.equal(output, expected)


def test_one_sequence_gets_its_cache_back_for_a_second_turn():
    """`return_dict_in_generate` returns the cache at batch 1, as plain `generate()` does: the sequence's tokens but
    the last (drafts kept past the end dropped), ready for the next turn."""
    verifier, prompt, speculator = make_verifier(), make_prompt(20), make_speculator()
    kwargs = dict(max_new_tokens=16, do_sample=False, return_dict_in_generate=True)
    plain = verifier.generate(prompt, **kwargs)
    speculative = verifier.generate(prompt, assistant_model=speculator, **kwargs)
    (name, cache), (_, expected) = list(speculative.items())[-1], list(plain.items())[-1]
    assert name in ("cache", "past_key_values") and cache.get_seq_length() == expected.get_seq_length() == 35
    turn = torch.cat([plain.sequences, make_prompt(5, seed=9)], dim=1)
    kwargs = dict(max_new_tokens=8, do_sample=False)
    expected = verifier.generate(turn, past_key_values=expected, **kwargs)
    assert torch.equal(verifier.generate(turn, past_key_values=cache, assistant_model=speculator, **kwargs), expected)


def sliding_model(window: int | None = None):
    torch.manual_seed(0)
    verifier = ARCHITECTURES["mistral"]()
    if window is not None:
        verifier.config.sliding_window = window
    return verifier.eval()


def test_a_sliding_window_model_with_a_static_cache_or_a_sliding_prefix_cache():
    """A sliding model's static cache slides, and a sliding cache that holds tokens cannot be traded for one that keeps
    every slot: one greedy prompt runs them in transformers' loop, identical to plain."""
    verifier, prompt, speculator = sliding_model(), make_prompt(20), make_speculator()
    kwargs = dict(max_new_tokens=10, do_sample=False, cache_implementation="static")
    expected = verifier.generate(prompt, **kwargs)
    assert torch.equal(verifier.generate(prompt, assistant_model=speculator, **kwargs), expected)
    verifier = sliding_model(window=16)
    cache = DynamicCache(config=verifier.config)
    with torch.no_grad():
        verifier(prompt[:, :CACHED], past_key_values=cache, use_cache=True)
    kwargs = dict(max_new_tokens=30, do_sample=False)
    expected = verifier.generate(prompt, past_key_values=copy.deepcopy(cache), **kwargs)
    output = verifier.generate(prompt, past_key_values=copy.deepcopy(cache), assistant_model=speculator, **kwargs)
    assert output.shape[1] == 50 and torch.equal(output, expected)
