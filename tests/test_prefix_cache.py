"""Caches a call is given or gives back. A cache that already holds part of the prompt (a system prompt, a chat's
earlier turns): only the rest is computed, and the output is what plain `generate()` gives with the same cache, and
what it gives without one. One sequence's cache comes back for the next turn; sliding-window models' caches."""

import copy
import logging

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


def test_a_sliding_window_model_with_a_static_cache():
    """A sliding model's static cache slides: one greedy prompt runs it in transformers' loop, identical to plain."""
    verifier, prompt, speculator = sliding_model(), make_prompt(20), make_speculator()
    kwargs = dict(max_new_tokens=10, do_sample=False, cache_implementation="static")
    expected = verifier.generate(prompt, **kwargs)
    assert torch.equal(verifier.generate(prompt, assistant_model=speculator, **kwargs), expected)


def sliding_prefix_cache(verifier, prompt, length: int):
    cache = DynamicCache(config=verifier.config)
    with torch.no_grad():
        verifier(prompt[:, :length], past_key_values=cache, use_cache=True)
    return cache


def test_a_sliding_prefix_cache_within_its_window():
    """A sliding cache that has dropped nothing yet runs as one that keeps every slot, in either loop, on every
    transformers release (before 5.17 a sliding layer cannot be cropped once past its window): greedy is plain greedy
    with the same cache, and the same seed gives the same tokens as without a cache."""
    verifier, prompt, speculator = sliding_model(window=16), make_prompt(20), make_speculator()
    cache = sliding_prefix_cache(verifier, prompt, CACHED)
    kwargs = dict(max_new_tokens=30, do_sample=False)
    expected = verifier.generate(prompt, past_key_values=copy.deepcopy(cache), **kwargs)
    forwards = []
    hook = verifier.register_forward_pre_hook(
        lambda module, args, kwargs: forwards.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    output = verifier.generate(prompt, past_key_values=copy.deepcopy(cache), assistant_model=speculator, **kwargs)
    hook.remove()
    assert output.shape[1] == 50 and torch.equal(output, expected) and forwards[0] == 20 - CACHED
    scored = verifier.generate(prompt, past_key_values=copy.deepcopy(cache), assistant_model=speculator,
                               return_dict_in_generate=True, output_scores=True, **kwargs)  # transformers' loop
    assert torch.equal(scored.sequences, expected) and len(scored.scores) == 30
    kwargs = dict(max_new_tokens=30, do_sample=True, assistant_model=speculator)
    torch.manual_seed(5)
    without = verifier.generate(prompt, **kwargs)
    torch.manual_seed(5)
    assert torch.equal(verifier.generate(prompt, past_key_values=copy.deepcopy(cache), **kwargs), without)


def test_a_sliding_prefix_cache_past_its_window(caplog):
    """A sliding cache that has dropped tokens cannot be rewound past a rejected draft, in either loop: the prompt is
    computed again in a new cache, said in a warning, and greedy is plain greedy with the cache passed."""
    verifier, prompt, speculator = sliding_model(window=16), make_prompt(20), make_speculator()
    cache = sliding_prefix_cache(verifier, prompt, 18)
    kwargs = dict(max_new_tokens=20, do_sample=False)
    expected = verifier.generate(prompt, past_key_values=copy.deepcopy(cache), **kwargs)
    with caplog.at_level(logging.WARNING, logger="hf_mlp_speculator"):
        output = verifier.generate(prompt, past_key_values=copy.deepcopy(cache), assistant_model=speculator, **kwargs)
        scored = verifier.generate(prompt, past_key_values=copy.deepcopy(cache), assistant_model=speculator,
                                   return_dict_in_generate=True, output_scores=True, **kwargs)  # transformers' loop
    assert torch.equal(output, expected) and torch.equal(scored.sequences, expected)
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 2 and "sliding-window layers already dropped tokens" in warnings[0]
    assert "cannot start from a cache that already holds part of the prompt" in warnings[1]


@pytest.mark.parametrize("options", [dict(do_sample=False, output_scores=True, return_dict_in_generate=True),
                                     dict(do_sample=True, speculative_sampling="rejection")],
                         ids=["scores", "rejection"])  # fmt: skip
def test_transformers_loop_with_a_prefix_cache(options):
    """transformers' assisted decoding computes the whole prompt again on top of a prefix cache (other tokens, through
    5.25 at least): the calls that run in it start from a new cache, and give what they give without one."""
    verifier, speculator = make_verifier(), make_speculator()
    input_ids, _, cache = prompts_and_cache(verifier, 1)
    kwargs = dict(max_new_tokens=24, assistant_model=speculator, **options)
    torch.manual_seed(11)
    without = verifier.generate(input_ids, **kwargs)
    torch.manual_seed(11)
    output = verifier.generate(input_ids, past_key_values=copy.deepcopy(cache), **kwargs)
    if options["do_sample"]:
        assert torch.equal(output, without)
    else:
        assert torch.equal(output.sequences, without.sequences) and len(output.scores) == 24
        assert torch.equal(without.sequences, verifier.generate(input_ids, max_new_tokens=24, do_sample=False))
