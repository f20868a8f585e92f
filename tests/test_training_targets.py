"""What the base model computes once: continuations and teacher forcing against plain forwards, the rows each head
learns from, and the draft vocabulary picked from them."""

import pytest
import torch
from conftest import VOCAB, make_verifier

from hf_mlp_speculator.training import SpeculatorTrainingArguments
from hf_mlp_speculator.training.loop import draft_vocabulary, make_speculator
from hf_mlp_speculator.training.losses import IGNORE_INDEX
from hf_mlp_speculator.training.targets import Targets, continue_prompts, teacher_force


def assert_fp16_of(stored: torch.Tensor, exact: torch.Tensor, slack: float = 1e-5) -> None:
    """`stored` (float16) is `exact` rounded to float16, up to `slack`: at most half a float16 ulp away from it."""
    assert stored.dtype == torch.float16
    error = (stored.float() - exact.float()).abs()
    bound = exact.float().abs() * 2.0**-11 + slack
    assert (error <= bound).all(), f"off by up to {(error - bound).max().item():.2e} beyond float16 rounding"


# Targets.batch: which row each head reads and learns.


def hand_built_targets() -> Targets:
    """Two sequences of 5 and 4 rows, every field distinct per row so that any misalignment shows."""
    lengths = [5, 4]
    rows = sum(lengths)
    states = torch.arange(rows * 3, dtype=torch.float32).view(rows, 3) / 8
    next_tokens = torch.arange(10, 10 + rows)
    topk_ids = torch.stack([torch.arange(40 + 2 * r, 42 + 2 * r) for r in range(rows)])
    topk_logprobs = -torch.arange(rows * 2, dtype=torch.float32).view(rows, 2) / 16 - 0.25
    split = lambda t: list(t.split(lengths))  # noqa: E731
    return Targets.from_sequences(split(states), split(next_tokens), split(topk_ids), split(topk_logprobs))


def test_draft_positions_are_every_row_but_each_sequence_last():
    targets = hand_built_targets()
    assert targets.ends.tolist() == [5, 9] and len(targets) == 9
    assert targets.draft_positions().tolist() == [0, 1, 2, 3, 5, 6, 7]


@pytest.mark.parametrize("n_predict", [1, 3])
def test_head_i_at_row_j_reads_token_j_plus_i_and_learns_row_j_plus_i_plus_1(n_predict):
    targets = hand_built_targets()
    rows = torch.tensor([7, 0, 3, 5, 2, 6, 1])  # shuffled, as training draws them
    batch = targets.batch(rows, n_predict)
    sequence_end = {0: 5, 1: 5, 2: 5, 3: 5, 5: 9, 6: 9, 7: 9}
    assert batch.input_ids.shape == (len(rows), n_predict + 1) and batch.labels.shape == (n_predict, len(rows))
    for b, j in enumerate(rows.tolist()):
        end = sequence_end[j]
        assert torch.equal(batch.states[b], targets.states[j].float())
        for i in range(n_predict):
            if j + i < end:
                assert batch.input_ids[b, i] == 10 + j + i  # next_tokens[j + i]
            learned = j + i + 1
            if learned < end:
                assert batch.labels[i, b] == 10 + learned
                assert batch.soft_ids[i, b].tolist() == [40 + 2 * learned, 41 + 2 * learned]
                assert torch.equal(batch.soft_logprobs[i, b], targets.topk_logprobs[learned].float())
            else:  # past this sequence's end (never the next sequence's rows)
                assert batch.labels[i, b] == IGNORE_INDEX
                assert (batch.soft_logprobs[i, b] == -torch.inf).all()
    assert batch.states.dtype == torch.float32 and batch.soft_logprobs.dtype == torch.float32


# continue_prompts and teacher_force against plain generate() and forward().


PROMPT_LENGTHS = (3, 8, 5)
NEW_TOKENS = 10


def prompts_for(seed=4) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


def pick_eos(base, prompts) -> int:
    """A token that ends prompt 0's greedy continuation early (preferably after a few tokens; random GPT-2s repeat one
    token) while another continuation never meets it."""
    plain = [
        base.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(p) :].tolist()
        for p in prompts
    ]
    for k in [*range(2, NEW_TOKENS - 1), 1, 0]:
        token = plain[0][k]
        if token not in plain[0][:k] and any(token not in other for other in plain[1:]):
            return token
    raise AssertionError("no suitable end-of-sequence token in this continuation; change the seed")


def check_against_full_forward(base, prompts, targets, tokens_per_prompt, top_k):
    """Each sequence's rows are the states and distributions of one unpadded forward of prompt + continuation."""
    assert targets.ends.tolist() == torch.tensor([len(t) for t in tokens_per_prompt]).cumsum(0).tolist()
    start = 0
    for prompt, tokens in zip(prompts, tokens_per_prompt):
        rows = slice(start, start + len(tokens))
        assert targets.next_tokens[rows].tolist() == tokens
        with torch.no_grad():
            output = base(torch.tensor([prompt + tokens]), output_hidden_states=True)
        # The state at position t emitted token t + 1: the rows start at the prompt's last position.
        positions = slice(len(prompt) - 1, len(prompt) - 1 + len(tokens))
        assert_fp16_of(targets.states[rows], output.hidden_states[-1][0, positions])
        values, ids = output.logits[0, positions].float().log_softmax(-1).topk(top_k, dim=-1)
        assert torch.equal(targets.topk_ids[rows], ids.int())
        assert_fp16_of(targets.topk_logprobs[rows], values)
        start += len(tokens)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_greedy_continuations_of_left_padded_prompts_match_generate_and_a_full_forward(arch):
    base = make_verifier(arch)
    prompts = prompts_for()
    eos = pick_eos(base, prompts)
    never = next(t for t in range(1, VOCAB) if t != eos)  # a second end id, to check that a list of them works
    targets = continue_prompts(base, prompts, NEW_TOKENS, [never, eos], pad_token_id=0, top_k=5)

    expected = []
    for p in prompts:
        out = base.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                            max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=[never, eos], pad_token_id=0)
        expected.append(out[0, len(p) :].tolist())  # fmt: skip
    lengths = [len(t) for t in expected]
    assert expected[0][-1] == eos and lengths[0] < NEW_TOKENS and NEW_TOKENS in lengths  # one stops early, one not
    check_against_full_forward(base, prompts, targets, expected, top_k=5)


def test_sampled_continuations_are_reproducible_and_follow_the_sampling_top_k():
    base = make_verifier("llama")
    prompts = prompts_for()
    sample = lambda seed: continue_prompts(  # noqa: E731
        base, prompts, NEW_TOKENS, [], pad_token_id=0, top_k=5, temperature=1.0, sampling_top_k=3, seed=seed
    )
    first, again, other = sample(7), sample(7), sample(8)
    assert torch.equal(first.next_tokens, again.next_tokens) and torch.equal(first.states, again.states)
    assert not torch.equal(first.next_tokens, other.next_tokens)
    greedy = continue_prompts(base, prompts, NEW_TOKENS, [], pad_token_id=0, top_k=5)
    assert not torch.equal(first.next_tokens, greedy.next_tokens)
    # Every sampled token is one of the 3 most likely there, and the rows still follow a plain forward.
    assert all(t in ids[:3] for t, ids in zip(first.next_tokens.tolist(), first.topk_ids.tolist()))
    tokens = [t.tolist() for t in first.next_tokens.split(NEW_TOKENS)]
    check_against_full_forward(base, prompts, first, tokens, top_k=5)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_teacher_forcing_matches_a_plain_forward_per_sequence(arch):
    base = make_verifier(arch)
    sequences = torch.randint(1, VOCAB, (3, 9), generator=torch.Generator().manual_seed(5))
    targets = teacher_force(base, sequences, top_k=4)
    assert targets.ends.tolist() == [8, 16, 24]
    for s, sequence in enumerate(sequences):
        rows = slice(8 * s, 8 * (s + 1))
        assert torch.equal(targets.next_tokens[rows], sequence[1:])
        with torch.no_grad():
            output = base(sequence[None, :-1], output_hidden_states=True)
        assert_fp16_of(targets.states[rows], output.hidden_states[-1][0])
        values, ids = output.logits[0].float().log_softmax(-1).topk(4, dim=-1)
        assert torch.equal(targets.topk_ids[rows], ids.int())
        assert_fp16_of(targets.topk_logprobs[rows], values)


# The draft vocabulary.


def targets_of(next_tokens, topk_ids, topk_probs) -> Targets:
    n = len(next_tokens)
    return Targets.from_sequences(
        [torch.zeros(n, 4)], [torch.tensor(next_tokens)], [torch.tensor(topk_ids)],
        [torch.tensor(topk_probs).log()],
    )  # fmt: skip


def test_draft_vocabulary_is_the_most_frequent_next_tokens_ties_by_soft_mass():
    # Counts: 7 x3, 2 x2, 9 x2, 4 x1, 5 x1. Soft mass: 9 more than 2, and 5 more than 4.
    next_tokens = [7, 2, 7, 9, 4, 7, 2, 9, 5]
    topk_ids = [[7, 9]] * 5 + [[7, 5]] * 4
    targets = targets_of(next_tokens, topk_ids, [[0.6, 0.3]] * 9)
    assert draft_vocabulary(targets, VOCAB, 1).tolist() == [7]
    assert draft_vocabulary(targets, VOCAB, 2).tolist() == [7, 9]  # 9 beats 2 on soft mass
    assert draft_vocabulary(targets, VOCAB, 3).tolist() == [2, 7, 9]  # ascending ids
    assert draft_vocabulary(targets, VOCAB, 4).tolist() == [2, 5, 7, 9]  # 5 beats 4 on soft mass


def test_draft_vocabulary_ranks_any_count_above_any_soft_mass():
    """Token 1 was emitted once; token 2 never, however much mass the base gave it: 1 is the more frequent."""
    rows = 2500
    targets = targets_of([1] + [3] * (rows - 1), [[3, 2]] * rows, [[0.45, 0.55]] * rows)
    assert draft_vocabulary(targets, VOCAB, 2).tolist() == [1, 3]


def test_make_speculator_takes_its_draft_vocabulary_from_the_targets_and_refuses_one_too_large():
    base = make_verifier("llama")
    targets = targets_of([7, 2, 7, 9, 4, 7, 2, 9, 5], [[7, 9]] * 9, [[0.6, 0.3]] * 9)
    def args(**kw):
        return SpeculatorTrainingArguments(base_model="tiny", prompts=["p"], n_predict=2, inner_dim=16, **kw)

    speculator = make_speculator(args(draft_vocab_size=3), base, targets)
    assert speculator.config.draft_vocab_size == 3 and speculator.speculator.draft_vocab.tolist() == [2, 7, 9]
    assert speculator.speculator.head[0].weight.shape == (3, 16)
    assert speculator.config.base_model_name_or_path == "tiny" and speculator.config.emb_dim == 64

    full = make_speculator(args(draft_vocab_size=VOCAB), base, targets)  # all of it: the published layout
    assert full.speculator.draft_vocab is None and "draft_vocab_size" not in full.config.to_dict()
    message = rf"draft_vocab_size=97 is larger than the base model's vocabulary of {VOCAB} tokens. Use at most {VOCAB}"
    with pytest.raises(ValueError, match=message):
        make_speculator(args(draft_vocab_size=VOCAB + 1), base, targets)
