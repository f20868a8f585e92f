"""Freeing rejected drafts' cache slots in batches: lossless whenever it runs, and a cache that stays close to the
tokens it holds."""

import pytest
import torch
from conftest import make_oracle, make_prompt, make_verifier
from test_sampling import (  # noqa: F401 (fixtures)
    BATCH_SAMPLES,
    MODES,
    batched_sample_counts,
    chi_square_p_value,
    keyed_plain_sampling,
    pair_and_truth,
    sampled,
    short_prompt_truth,
)

from hf_mlp_speculator.generation import cache_slots


@pytest.fixture
def always(monkeypatch):
    """Compaction after every step, even when it frees nothing."""
    monkeypatch.setattr(cache_slots, "COMPACT_SHARE", -1.0)


def ragged_batch(rows=3):
    prompts = torch.cat([make_prompt(seed=2 + row) for row in range(rows)])
    mask = torch.ones_like(prompts)
    mask[1:, :3] = 0  # left padding on all rows but the first
    return prompts, mask


@pytest.mark.parametrize("options", [{}, {"n_candidates": 3}, {"prompt_lookup_num_tokens": 3}],
                         ids=["chain", "tree", "hybrid"])  # fmt: skip
def test_greedy_identical_with_compaction_after_every_step(always, options):
    verifier = make_verifier()
    prompts, mask = ragged_batch()
    # Rows accept different numbers of drafts: their kept slots end up at different places.
    speculator = make_oracle(verifier, prompts, 30, attention_mask=mask,
                             wrong=lambda row, position, head: (row + position + head) % 4 == 3)  # fmt: skip
    kwargs = dict(attention_mask=mask, max_new_tokens=30, do_sample=False)
    expected = verifier.generate(prompts, **kwargs)
    assert torch.equal(verifier.generate(prompts, assistant_model=speculator, **kwargs, **options), expected)
    metrics = speculator.speculation_metrics
    assert metrics.num_accepted_tokens > 0
    if not options:  # (a tree finds the right token among its branches; its other nodes are what gets freed)
        assert metrics.num_accepted_tokens < metrics.num_draft_tokens


@pytest.mark.parametrize("mode", ["batch 3", "batch 3, hybrid", "batch 3, tree"])
def test_sampled_tokens_are_plain_sampling_with_compaction_after_every_step(always, pair_and_truth,  # noqa: F811
                                                                             mode):
    verifier, speculator, _ = pair_and_truth
    for seed in range(3):
        input_ids, attention_mask, output = sampled(verifier, speculator, MODES[mode], seed)
        assert torch.equal(output, keyed_plain_sampling(verifier, input_ids, attention_mask, seed))


def test_batched_sampling_follows_the_verifier_with_compaction_after_every_step(always, pair_and_truth,  # noqa: F811
                                                                                short_prompt_truth):  # noqa: F811
    verifier, speculator, probs = pair_and_truth
    counts, accepted_per_row, _ = batched_sample_counts(verifier, speculator)
    assert len(set(accepted_per_row)) > 2
    assert chi_square_p_value(counts[0], probs, BATCH_SAMPLES) > 1e-3
    assert chi_square_p_value(counts[1], short_prompt_truth, BATCH_SAMPLES) > 1e-3


def slots_per_token(share: float, monkeypatch) -> float:
    """
    The most cache slots per generated token, 3 drafts every step: row 0's drafts are all right, the other rows' mostly
    wrong, so that every step the other rows leave rejected slots behind in the columns row 0 keeps.
    """
    monkeypatch.setattr(cache_slots, "COMPACT_SHARE", share)
    verifier, new_tokens = make_verifier(), 80
    prompts = torch.cat([make_prompt(seed=row) for row in range(4)])
    speculator = make_oracle(verifier, prompts, new_tokens, attention_mask=torch.ones_like(prompts),
                             wrong=lambda row, position, head: row > 0 and head < 2)  # fmt: skip
    verifier.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens, do_sample=False,
                      assistant_model=speculator)  # fmt: skip
    rates = speculator.speculation_metrics.head_acceptance_rates
    assert rates[0] < 0.5  # most drafts rejected
    return (speculator.speculation_metrics.cache_slots - prompts.shape[1]) / new_tokens


def test_the_cache_holds_few_more_slots_than_tokens(monkeypatch):
    assert slots_per_token(cache_slots.COMPACT_SHARE, monkeypatch) <= 1.15
    assert slots_per_token(float("inf"), monkeypatch) > 1.5  # never compacted: rejected drafts keep their slots
