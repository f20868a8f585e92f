"""Sampling with a speculator follows the verifier's distribution exactly, and a seed gives the same tokens every time:
each emitted token is the one plain decoding with the same position-keyed noise emits, whatever was drafted."""

import itertools
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_prompt, make_speculator, make_verifier
from transformers import LlamaConfig, LlamaForCausalLM

from hf_mlp_speculator import (
    FixedDepth,
    MLPSpeculatorCandidateGenerator,
    MLPSpeculatorConfig,
    MLPSpeculatorPreTrainedModel,
    speculation_state,
)
from hf_mlp_speculator.drafting import cost_model
from hf_mlp_speculator.generation.position_noise import PositionNoise

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


def sample_counts(verifier, speculator, **generate_kwargs):
    """Counts of each continuation of PROMPT over SAMPLES calls, and the drafted and accepted totals."""
    (counts,), metrics, _ = sampled_counts(verifier, speculator, PROMPT, **generate_kwargs)
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


def noise_blind_to_position(monkeypatch):
    """Breaks the keying: every position of a row gets the same noise (each token is still a sample of its own
    distribution, but the tokens of a row are no longer independent)."""
    real = PositionNoise.at
    monkeypatch.setattr(PositionNoise, "at", lambda self, rows, positions: real(self, rows, [0] * len(positions)))


def test_rejection_sampling_matches_the_verifier_distribution(pair_and_truth):
    """The documented alternative: transformers' rejection sampling on the speculator's real q."""
    verifier, speculator, probs = pair_and_truth
    counts, drafted, accepted = sample_counts(verifier, speculator, speculative_sampling="rejection")
    assert 0.2 * drafted < accepted < 0.8 * drafted
    assert chi_square_p_value(counts, probs, SAMPLES) > 1e-3


def test_the_check_catches_greedy_drafts_under_rejection_sampling(pair_and_truth, monkeypatch):
    """Drafting by argmax while handing transformers the sampling logits as q (transformers #47932) biases the
    output towards the drafts, and the same check sees it."""
    verifier, speculator, probs = pair_and_truth
    select = MLPSpeculatorCandidateGenerator.select
    monkeypatch.setattr(MLPSpeculatorCandidateGenerator, "select",
                        lambda self, scores, head: select(self, scores, head) * 0 + scores.argmax(dim=-1))  # fmt: skip
    counts, _, _ = sample_counts(verifier, speculator, speculative_sampling="rejection")
    assert chi_square_p_value(counts, probs, SAMPLES) < 1e-3


def test_the_check_catches_noise_shared_between_positions(pair_and_truth, monkeypatch):
    verifier, speculator, probs = pair_and_truth
    noise_blind_to_position(monkeypatch)
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


def test_batched_check_catches_noise_shared_between_positions(pair_and_truth, short_prompt_truth, monkeypatch):
    verifier, speculator, probs = pair_and_truth
    noise_blind_to_position(monkeypatch)
    counts, _, _ = batched_sample_counts(verifier, speculator)
    assert chi_square_p_value(counts[0], probs, BATCH_SAMPLES) < 1e-3
    assert chi_square_p_value(counts[1], short_prompt_truth, BATCH_SAMPLES) < 1e-3


def keyed_plain_sampling(verifier, input_ids, attention_mask, seed: int, max_new_tokens: int = 12):
    """
    An independent plain decoder: after `torch.manual_seed(seed)`, one full forward per token, temperature and top-k
    applied by hand, and at each position the token `argmax(p / noise)` with the noise of that row and position.
    """
    torch.manual_seed(seed)
    noise = PositionNoise(V, "cpu")
    ids, mask, rows = input_ids.clone(), attention_mask.clone(), torch.arange(len(input_ids))
    with torch.no_grad():
        for _ in range(max_new_tokens):
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            logits = verifier(ids, attention_mask=mask, position_ids=positions).logits[:, -1] / TEMPERATURE
            scores = logits.masked_fill(logits < logits.topk(TOP_K).values[:, -1:], float("-inf"))
            token = noise.sample(scores, rows.tolist(), [ids.shape[1]] * len(rows))
            ids, mask = torch.cat([ids, token[:, None]], 1), torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
    return ids


RAGGED = (torch.tensor([[1, 2, 3], [0, 2, 1], [3, 3, 1]]), torch.tensor([[1, 1, 1], [0, 1, 1], [1, 1, 1]]))
MODES = {
    "batch 1": {},
    "batch 1, hybrid": {"prompt_lookup_num_tokens": 2},
    "batch 1, tree": {"n_candidates": 3},
    "batch 1, 2 heads": {"num_assistant_tokens": 2},
    "batch 3": {"batch": True},
    "batch 3, hybrid": {"batch": True, "prompt_lookup_num_tokens": 2},
    "batch 3, tree": {"batch": True, "n_candidates": 4},
}


def sampled(verifier, speculator, mode: dict, seed: int, max_new_tokens: int = 12):
    options = dict(mode)
    input_ids, attention_mask = RAGGED if options.pop("batch", False) else (PROMPT, torch.ones_like(PROMPT))
    torch.manual_seed(seed)
    output = verifier.generate(input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                               do_sample=True, temperature=TEMPERATURE, top_k=TOP_K, top_p=1.0,
                               assistant_model=speculator, **options)  # fmt: skip
    return input_ids, attention_mask, output


@pytest.mark.parametrize("mode", list(MODES))
def test_each_token_is_plain_sampling_with_the_same_noise(pair_and_truth, mode):
    """Token for token what the independent plain decoder emits, however many drafts were kept."""
    verifier, speculator, _ = pair_and_truth
    accepted = 0
    for seed in range(4):
        input_ids, attention_mask, output = sampled(verifier, speculator, MODES[mode], seed)
        assert torch.equal(output, keyed_plain_sampling(verifier, input_ids, attention_mask, seed))
        accepted += speculator.speculation_metrics.num_accepted_tokens
    assert accepted > 0


def tokens_of_four_calls(mode: str) -> list[list[list[int]]]:
    verifier, speculator = sharp_pair()
    return [sampled(verifier, speculator, MODES[mode], seed=1234, max_new_tokens=24)[2].tolist() for _ in range(4)]


@pytest.mark.cost_aware
@pytest.mark.parametrize("mode", ["batch 1", "batch 3", "batch 1, hybrid", "batch 3, tree"])
def test_a_seed_gives_the_same_tokens_every_time(mode, monkeypatch):
    """Four calls under one seed, with the controller choosing depths from timings that are random values, and a
    fresh process: the same tokens."""
    jitter = random.Random(0)
    record = cost_model.CostModel.record_verify
    monkeypatch.setattr(cost_model.CostModel, "record_verify",
                        lambda self, length, tokens, _, *steady: record(self, length, tokens, jitter.random(),
                                                                         *steady))  # fmt: skip
    calls = tokens_of_four_calls(mode)
    assert all(tokens == calls[0] for tokens in calls)
    code = f"import json, test_sampling; print(json.dumps(test_sampling.tokens_of_four_calls({mode!r})))"
    result = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, capture_output=True, text=True,
                            timeout=300, check=True)  # fmt: skip
    assert json.loads(result.stdout.strip().splitlines()[-1]) == calls


def test_a_token_the_processors_rule_out_is_never_emitted(pair_and_truth):
    """With top_k=1 every position has one token of positive probability: sampling is greedy decoding."""
    verifier, speculator, _ = pair_and_truth
    greedy = verifier.generate(PROMPT, max_new_tokens=12, do_sample=False)
    for seed in range(3):
        torch.manual_seed(seed)
        output = verifier.generate(PROMPT, max_new_tokens=12, do_sample=True, top_k=1, assistant_model=speculator)
        assert torch.equal(output, greedy)


def test_a_seeded_rejection_call_repeats_its_tokens_only_under_a_fixed_depth():
    """What the docs promise for `speculative_sampling="rejection"`: the same seed gives the same tokens where the
    depths are the same (a fixed depth), and other depths draw other random numbers, hence other tokens."""
    verifier, speculator, prompt = make_verifier(), make_speculator(), make_prompt()
    state = speculation_state(verifier, speculator)

    def sampled(seed, depth):
        state.policy = FixedDepth(depth)
        torch.manual_seed(seed)
        return verifier.generate(prompt, do_sample=True, max_new_tokens=24, assistant_model=speculator,
                                 speculative_sampling="rejection")  # fmt: skip

    for seed in (0, 1):
        assert torch.equal(sampled(seed, 2), sampled(seed, 2))
    assert any(not torch.equal(sampled(seed, 1), sampled(seed, 3)) for seed in (0, 1, 2))
