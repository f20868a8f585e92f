"""Hybrid drafting: prompt lookup next to the speculator, lossless at batch 1 and batched, exact under sampling."""

import pytest
import torch
from conftest import make_speculator, make_verifier
from test_sampling import chi_square_p_value, exact_distribution, sampled_counts, sharp_pair

from hf_mlp_speculator.drafting.drafts import Drafts
from hf_mlp_speculator.drafting.prompt_lookup import HybridDrafter, lookup_continuation, lookup_drafts, with_lookup

NEW_TOKENS = 4


def test_lookup_takes_the_longest_ngram_at_its_latest_occurrence():
    sequences = [
        [5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7],  # "6 7" occurs twice before the end: the latest one is followed by 9 2
        [5, 6, 7, 8, 1, 2, 7, 9, 3, 6, 7],  # "6 7" once (then 8 1 2 ...); "7" alone occurs later, but is shorter
        [1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 0],  # no earlier "9 0", and no earlier "0"
        [4, 4, 4, 4],  # "4 4" right before the suffix, then its last 4
    ]  # fmt: skip
    assert [lookup_continuation(ids, max_ngram_size=2, num_tokens=3) for ids in sequences] == [
        [9, 2, 6], [8, 1, 2], [], [4]
    ]  # fmt: skip
    # A one-token match where two tokens find none ("2 7" is new, "7" is not); the cut to num_tokens.
    assert lookup_continuation(sequences[1][:7], 2, 10) == [8, 1, 2, 7]
    assert lookup_continuation(sequences[0], max_ngram_size=2, num_tokens=1) == [9]


def test_each_row_drafts_from_the_source_that_lately_matched_longer():
    """Row 0 copies its prompt: after one step the lookup, which matched what was emitted, drafts it. Row 1's lookup
    matched nothing the verifier then wrote, and the speculator keeps drafting."""
    hybrid = HybridDrafter(2, num_tokens=4, max_ngram_size=2)
    sequences = [[1, 2, 3, 4, 5, 6, 1, 2], [1, 2, 3, 4, 5, 6, 1, 2]]
    lookup, use_lookup = hybrid.propose(sequences, [0, 1], [20, 20])
    assert lookup == [[3, 4, 5, 6], [3, 4, 5, 6]] and use_lookup == [False, False]  # nothing observed yet

    # The speculator drafted 9 9 in both rows; the verifier wrote "3 4" in row 0 (the lookup's continuation) and "7 8"
    # in row 1.
    hybrid.record([0, 1], lookup, use_lookup, [[9, 9], [9, 9]], [[3, 4], [7, 8]])
    sequences[0] += [3, 4]
    sequences[1] += [7, 8]
    lookup, use_lookup = hybrid.propose(sequences, [0, 1], [20, 20])
    assert use_lookup == [True, False] and lookup[0] == [5, 6, 1, 2]

    # On the device: row 0's chain is its lookup continuation (no heads ran for it), row 1's the speculator's.
    use, drafts = lookup_drafts(lookup, use_lookup, "cpu")
    speculator_chain = Drafts(torch.tensor([[4, 0, 0], [8, 9, 9]]), torch.tensor([0, 2]), 2)
    merged = with_lookup(speculator_chain, use, drafts)
    assert merged.tokens[0].tolist() == [4, 5, 6, 1, 2] and merged.limits.tolist() == [4, 2]
    assert merged.tokens[1, :3].tolist() == [8, 9, 9] and merged.max_depth == 4

    # A row that left the batch keeps its scores under its original index; room caps the lookup draft. Row 0's
    # speculator score did not move while it drafted from lookup.
    speculator_score = list(hybrid.speculator_score)
    hybrid.record([0, 1], lookup, use_lookup, [[5, 6, 1, 2], [9, 9]], [[5, 6, 1, 2, 3], [1]])
    sequences[0] += [5, 6, 1, 2, 3]
    lookup, use_lookup = hybrid.propose(sequences, [0], [1])
    assert use_lookup == [True] and lookup == [[4]]
    assert hybrid.speculator_score[0] == speculator_score[0] and hybrid.lookup_score[0] > speculator_score[0]


def repeating_prompts(verifier, rows=3, length=10, seed=0):
    """Prompts that repeat their own text, and what the verifier writes after them, so lookup has spans to copy."""
    generator = torch.Generator().manual_seed(seed)
    text = torch.randint(3, verifier.config.vocab_size, (rows, length), generator=generator)
    return torch.cat([text, text, text[:, :3]], dim=1)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_hybrid_greedy_is_identical_to_plain_at_batch_1_and_batched(arch):
    verifier, speculator = make_verifier(arch), make_speculator()
    prompts = repeating_prompts(verifier)
    attention_mask = torch.ones_like(prompts)
    attention_mask[1, :4] = 0  # a left-padded row
    settings = dict(max_new_tokens=24, do_sample=False)
    plain = verifier.generate(prompts, attention_mask=attention_mask, **settings)
    hybrid = verifier.generate(prompts, attention_mask=attention_mask, assistant_model=speculator,
                               prompt_lookup_num_tokens=6, **settings)  # fmt: skip
    assert torch.equal(plain, hybrid)
    metrics = speculator.speculation_metrics
    assert metrics.num_lookup_accepted_tokens > 0 and metrics.num_draft_tokens > metrics.num_lookup_draft_tokens
    for row in range(len(prompts)):
        alone = prompts[row : row + 1, attention_mask[row].bool()]
        plain = verifier.generate(alone, **settings)
        assert torch.equal(plain, verifier.generate(alone, assistant_model=speculator, prompt_lookup_num_tokens=6,
                                                    **settings))  # fmt: skip
        metrics = speculator.speculation_metrics
        assert metrics.num_lookup_draft_tokens > 0
        assert metrics.num_accepted_tokens == metrics.num_emitted_tokens - metrics.num_steps
        assert "Prompt lookup:" in str(metrics)


# Sampling: a lookup draft is kept when it equals the token the verifier samples at its position.

COPYING_PROMPT = torch.tensor([[1, 2, 3, 0, 1, 1, 1, 1]])  # the start of what the verifier writes itself
SAMPLES = 1200


def hybrid_sample_counts(verifier, speculator, prompt, rows, **generate_kwargs):
    """Continuation counts over SAMPLES sampled rows of `prompt`, `rows` rows per call (1: transformers' loop)."""
    (counts,), metrics, _ = sampled_counts(verifier, speculator, prompt, copies=rows, calls=SAMPLES // rows,
                                           prompt_lookup_num_tokens=3, max_matching_ngram_size=2,
                                           **generate_kwargs)  # fmt: skip
    return counts, metrics.num_lookup_draft_tokens, metrics.num_lookup_accepted_tokens


@pytest.fixture(scope="module")
def copying_truth():
    verifier, speculator = sharp_pair()
    return verifier, speculator, exact_distribution(verifier, COPYING_PROMPT)


@pytest.mark.parametrize("rows,sampling", [(1, "keyed"), (400, "keyed"), (1, "rejection")],
                         ids=["batch-1", "batched", "batch-1 rejection"])  # fmt: skip
def test_hybrid_sampling_matches_the_verifier_distribution(copying_truth, rows, sampling, monkeypatch):
    """Four tokens are too few for the running scores to pick lookup often: here a coin picks each row's source
    each step instead, which, like the scores, knows nothing of the verifier's view of the step."""
    verifier, speculator, probs = copying_truth
    monkeypatch.setattr(HybridDrafter, "prefers_lookup", lambda self, rows: (torch.rand(len(rows)) < 0.7).tolist())
    counts, drafted, accepted = hybrid_sample_counts(verifier, speculator, COPYING_PROMPT, rows,
                                                     speculative_sampling=sampling)  # fmt: skip
    assert 0.1 * drafted < accepted < 0.9 * drafted  # lookup drafts were both accepted and rejected, often
    assert chi_square_p_value(counts, probs, SAMPLES) > 1e-3
