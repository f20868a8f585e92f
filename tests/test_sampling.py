"""Sampling with a speculator follows the verifier's distribution exactly (rejection sampling on the real q)."""

import itertools

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_mlp_speculator import MLPSpeculatorCandidateGenerator, MLPSpeculatorConfig, MLPSpeculatorPreTrainedModel

V, NEW_TOKENS, TEMPERATURE, TOP_K, SAMPLES = 4, 4, 0.8, 3, 800
PROMPT = torch.tensor([[1, 2, 3]])


def sharp_pair():
    """A tiny verifier and speculator over 4 tokens whose distributions are peaked and depend on the context."""
    torch.manual_seed(0)
    verifier = LlamaForCausalLM(
        LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            vocab_size=V,
            bos_token_id=0,
            eos_token_id=None,
            pad_token_id=0,
        )  # fmt: skip
    ).eval()
    with torch.no_grad():
        verifier.lm_head.weight.mul_(10)
        verifier.model.embed_tokens.weight.mul_(10)
    config = MLPSpeculatorConfig(vocab_size=V, emb_dim=32, inner_dim=16, n_predict=3, top_k_tokens_per_head=[2, 2, 2])
    speculator = MLPSpeculatorPreTrainedModel(config).eval()
    with torch.no_grad():
        for head in speculator.speculator.head:
            head.weight.mul_(4)
    return verifier, speculator


def exact_distribution(verifier, prompt=PROMPT):
    """P(x_1..x_n | prompt) for every continuation, from the verifier's logits after temperature and top-k."""
    probs = {}
    with torch.no_grad():
        for continuation in itertools.product(range(V), repeat=NEW_TOKENS):
            ids = torch.cat([prompt, torch.tensor([continuation])], dim=1)
            logits = verifier(ids).logits[0, prompt.shape[1] - 1 : -1] / TEMPERATURE
            kth = logits.topk(TOP_K, dim=-1).values[:, -1:]
            step_probs = logits.masked_fill(logits < kth, float("-inf")).softmax(-1)
            probs[continuation] = step_probs[torch.arange(NEW_TOKENS), list(continuation)].prod().item()
    return probs


def chi_square_p_value(counts, probs, samples):
    """Pearson's test, pooling cells expected fewer than 5 times."""
    observed, expected, pooled_o, pooled_e = [], [], 0, 0.0
    for cell, p in probs.items():
        if p * samples >= 5:
            observed.append(counts.get(cell, 0))
            expected.append(p * samples)
        else:
            pooled_o, pooled_e = pooled_o + counts.get(cell, 0), pooled_e + p * samples
    if pooled_e > 0:
        observed.append(pooled_o)
        expected.append(pooled_e)
    o, e = torch.tensor(observed, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64)
    statistic = ((o - e) ** 2 / e).sum()
    dof = torch.tensor((len(observed) - 1) / 2, dtype=torch.float64)
    return torch.special.gammaincc(dof, statistic / 2).item()


def sampled_counts(verifier, speculator, input_ids, attention_mask=None, copies=1, calls=SAMPLES, **generate_kwargs):
    """Each prompt's continuation counts over `calls` sampled generate() calls of `copies` rows per prompt, with the
    speculation metrics summed over the calls and every row's own metrics."""
    torch.manual_seed(0)
    attention_mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    counts, total, per_row = [{} for _ in input_ids], None, []
    for _ in range(calls):
        out = verifier.generate(input_ids.repeat(copies, 1), attention_mask=attention_mask.repeat(copies, 1),
                                max_new_tokens=NEW_TOKENS, do_sample=True, temperature=TEMPERATURE, top_k=TOP_K,
                                top_p=1.0, assistant_model=speculator, **generate_kwargs)  # fmt: skip
        for row, tokens in enumerate(out[:, input_ids.shape[1] :].tolist()):
            prompt_counts = counts[row % len(input_ids)]
            prompt_counts[tuple(tokens)] = prompt_counts.get(tuple(tokens), 0) + 1
        metrics = speculator.speculation_metrics
        total = metrics if total is None else total + metrics
        per_row += speculator.speculation_metrics_per_row
    return counts, total, per_row


def sample_counts(verifier, speculator):
    """Counts of each continuation of PROMPT over SAMPLES calls, and the drafted and accepted totals."""
    (counts,), metrics, _ = sampled_counts(verifier, speculator, PROMPT)
    return counts, metrics.num_draft_tokens, metrics.num_accepted_tokens


@pytest.fixture(scope="module")
def pair_and_truth():
    verifier, speculator = sharp_pair()
    return verifier, speculator, exact_distribution(verifier)


def test_speculative_sampling_matches_the_verifier_distribution(pair_and_truth):
    verifier, speculator, probs = pair_and_truth
    counts, drafted, accepted = sample_counts(verifier, speculator)
    assert 0.2 * drafted < accepted < 0.8 * drafted  # both acceptance and rejection paths ran often
    assert chi_square_p_value(counts, probs, SAMPLES) > 1e-3


def test_the_check_catches_greedy_drafts_under_sampling(pair_and_truth, monkeypatch):
    """Drafting by argmax while handing transformers the sampling logits as q (transformers #47932) biases the
    output towards the drafts, and the same check sees it."""
    verifier, speculator, probs = pair_and_truth
    monkeypatch.setattr(MLPSpeculatorCandidateGenerator, "select", lambda self, logits: logits.argmax(dim=-1))
    counts, _, _ = sample_counts(verifier, speculator)
    assert chi_square_p_value(counts, probs, SAMPLES) < 1e-3


SHORT_PROMPT = torch.tensor([[2, 1]])
BATCH_SAMPLES = 4000  # rows are cheap in a batch: a stronger test than the batch-1 one


def batched_sample_counts(verifier, speculator, copies=1000):
    """Each prompt's continuation counts over BATCH_SAMPLES rows, sampled `copies` rows of each prompt per batch."""
    input_ids = torch.cat([PROMPT, torch.cat([torch.zeros(1, 1, dtype=torch.long), SHORT_PROMPT], dim=1)])
    attention_mask = torch.tensor([[1, 1, 1], [0, 1, 1]])
    counts, metrics, per_row = sampled_counts(verifier, speculator, input_ids, attention_mask, copies,
                                              BATCH_SAMPLES // copies)  # fmt: skip
    return counts, [m.num_accepted_tokens for m in per_row], metrics


@pytest.fixture(scope="module")
def short_prompt_truth(pair_and_truth):
    return exact_distribution(pair_and_truth[0], SHORT_PROMPT)


def test_batched_sampling_matches_the_verifier_distribution_row_by_row(pair_and_truth, short_prompt_truth):
    verifier, speculator, probs = pair_and_truth
    counts, accepted_per_row, metrics = batched_sample_counts(verifier, speculator)
    assert len(set(accepted_per_row)) > 2  # rows accepted different numbers of drafts
    assert 0.2 * metrics.num_draft_tokens < metrics.num_accepted_tokens < 0.8 * metrics.num_draft_tokens
    assert chi_square_p_value(counts[0], probs, BATCH_SAMPLES) > 1e-3
    assert chi_square_p_value(counts[1], short_prompt_truth, BATCH_SAMPLES) > 1e-3


def test_batched_check_catches_greedy_drafts_under_sampling(pair_and_truth, short_prompt_truth, monkeypatch):
    import hf_mlp_speculator.speculative_decoding as loop

    verifier, speculator, probs = pair_and_truth
    draft_chain = loop.draft_chain
    greedy = lambda s: s.argmax(dim=-1)  # noqa: E731
    # Its arguments: heads, hidden, last_tokens, num_drafts, process, select, confidence_threshold.
    monkeypatch.setattr(loop, "draft_chain", lambda *args: draft_chain(*args[:5], greedy, *args[6:]))
    counts, _, _ = batched_sample_counts(verifier, speculator)
    assert chi_square_p_value(counts[0], probs, BATCH_SAMPLES) < 1e-3
    assert chi_square_p_value(counts[1], short_prompt_truth, BATCH_SAMPLES) < 1e-3


def test_rejection_sampling_never_accepts_a_draft_the_verifier_rules_out(monkeypatch):
    """Even when the uniform draw is exactly 0 (torch.rand is in [0, 1)), a draft with p = 0 is rejected."""
    from hf_mlp_speculator.drafting import DraftTree
    from hf_mlp_speculator.speculative_decoding import _accept_by_rejection_sampling

    draft, allowed = 2, 1
    drafts = DraftTree(tokens=torch.tensor([[0, draft]]), parents=torch.tensor([[0, 0]]),
                       depths=torch.tensor([[0, 1]]), valid=torch.tensor([[True, True]]),
                       draft_logits=torch.tensor([[[0.0, 0.0, 5.0, 0.0]]]))  # fmt: skip
    scores = torch.full((1, 2, V), torch.finfo(torch.float32).min)
    scores[0, 0, allowed] = 0.0  # the verifier allows only `allowed` after the root
    scores[0, 1] = 0.0
    monkeypatch.setattr(torch, "rand_like", torch.zeros_like)
    accepted, next_token = _accept_by_rejection_sampling(drafts, scores, torch.tensor([1]))
    assert accepted.tolist() == [0] and next_token.tolist() == [allowed]
