"""A verifier/speculator pair's `SpeculationState`: what carries over between calls, how to see it, reset it, and fix
the depth; and a second kind of draft heads, whose state is two tensors, drafting chains and trees unchanged."""

import pytest
import torch
from conftest import HIDDEN, VOCAB, make_oracle, make_prompt, make_speculator, make_verifier

from hf_mlp_speculator import FixedDepth, SpeculationState, speculation_state
from hf_mlp_speculator.drafting.drafts import DraftKind, TreeSpec, draft_chain, draft_tree


@pytest.mark.cost_aware
def test_a_later_call_starts_from_what_the_earlier_ones_measured():
    verifier, prompt = make_verifier(), make_prompt()
    speculator = make_oracle(verifier, prompt, 24)
    state = speculation_state(verifier, speculator)
    assert "nothing measured yet" in state.summary()
    verifier.generate(prompt, max_new_tokens=24, do_sample=False, assistant_model=speculator)
    estimate, (cost_model,) = state.acceptance[DraftKind.CHAIN_GREEDY], state.cost_models.values()
    drafted, timings = estimate.drafted.sum(), cost_model.num_timings
    assert drafted > 0 and timings > 0
    verifier.generate(prompt, max_new_tokens=24, do_sample=False, assistant_model=speculator)
    assert state.acceptance[DraftKind.CHAIN_GREEDY] is estimate and cost_model.num_timings > timings
    summary = state.summary()
    assert summary.startswith("Speculation state of LlamaForCausalLM with MLPSpeculatorPreTrainedModel")
    assert "acceptance, chain, greedy: per head" in summary and "verify ms by new tokens" in summary
    state.reset()
    assert not state.acceptance and not state.cost_models and "nothing measured yet" in state.summary()


def test_a_fixed_depth_drafts_that_many_heads_every_step():
    verifier, prompt = make_verifier(), make_prompt()
    speculator = make_oracle(verifier, prompt, 20, n_predict=3)
    expected = verifier.generate(prompt, max_new_tokens=20, do_sample=False)
    for depth, drafted in ((0, 0), (2, 2), (None, 3), (7, 3)):
        speculation_state(verifier, speculator).policy = FixedDepth(depth)
        output = verifier.generate(prompt, max_new_tokens=20, do_sample=False, assistant_model=speculator)
        assert torch.equal(output, expected)
        steps = speculator.speculation_metrics.steps_by_depth
        # Every step at that depth, but the last ones, which have room for fewer drafts before max_new_tokens.
        assert steps[drafted] > 0 and not any(steps[drafted + 1 :]) and sum(steps[:drafted]) <= 2, (depth, steps)
    # The call's own "constant" schedule comes first.
    speculation_state(verifier, speculator).policy = FixedDepth(0)
    verifier.generate(prompt, max_new_tokens=20, do_sample=False, assistant_model=speculator,
                      num_assistant_tokens_schedule="constant", num_assistant_tokens=2)  # fmt: skip
    assert speculator.speculation_metrics.steps_by_depth[2] > 0


@pytest.mark.parametrize("depth", [-1, 1.5, True, "2"])
def test_a_fixed_depth_is_a_whole_number(depth):
    with pytest.raises(ValueError, match=rf"FixedDepth\({depth!r}\): give a whole number of heads"):
        FixedDepth(depth)


def test_the_class_policy_is_the_default_of_every_pair(monkeypatch):
    monkeypatch.setattr(SpeculationState, "policy", FixedDepth(1))
    state = speculation_state(make_verifier(), make_speculator())
    assert state.policy == FixedDepth(1) and "1 heads every step" in state.summary()
    state.policy = None  # this pair alone goes back to the cost-aware controller
    assert SpeculationState.policy == FixedDepth(1) and "cost-aware" in state.summary()


class TwoStateHeads(torch.nn.Module):
    """Draft heads whose state is a pair of tensors (as an LSTM's hidden and cell states): head `h` mixes the hidden
    state with the token's embedding, and the second tensor, a running sum of the tokens read, shifts the logits."""

    def __init__(self, num_heads=3):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN, generator=generator))
        self.mix = torch.nn.Parameter(torch.randn(num_heads, HIDDEN, HIDDEN, generator=generator) / HIDDEN**0.5)
        self.out = torch.nn.Parameter(torch.randn(HIDDEN, VOCAB, generator=generator))

    def input_state(self, hidden):
        return hidden, torch.zeros(*hidden.shape[:-1], VOCAB)

    def step(self, head, state, tokens):
        hidden, seen = state
        hidden = torch.tanh((hidden + self.embed[tokens]) @ self.mix[head])
        seen = seen + torch.nn.functional.one_hot(tokens, VOCAB).float()
        return (hidden, seen), hidden @ self.out - 3.0 * seen


class OneTensorHeads(TwoStateHeads):
    """The same heads with both parts in one tensor, drafted through the plain tensor path."""

    def input_state(self, hidden):
        return torch.cat(super().input_state(hidden), dim=-1)

    def step(self, head, state, tokens):
        (hidden, seen), logits = super().step(head, state.split([HIDDEN, VOCAB], dim=-1), tokens)
        return torch.cat([hidden, seen], dim=-1), logits


def test_a_state_of_two_tensors_drafts_chains_and_trees_as_one_tensor_does():
    hidden, last = torch.randn(2, HIDDEN), torch.tensor([4, 9])
    two, one = TwoStateHeads().requires_grad_(False), OneTensorHeads().requires_grad_(False)
    chain_two, chain_one = draft_chain(two, hidden, last, None, 3), draft_chain(one, hidden, last, None, 3)
    assert torch.equal(chain_two.tokens, chain_one.tokens)
    torch.testing.assert_close(chain_two.confidences, chain_one.confidences)
    tree = TreeSpec((2, 2, 2), 4, 3)
    tree_two, tree_one = draft_tree(two, hidden, last, None, 3, tree), draft_tree(one, hidden, last, None, 3, tree)
    assert torch.equal(tree_two.tokens, tree_one.tokens) and tree_two.tokens.shape[1] > 4
    assert torch.equal(tree_two.tree.parents, tree_one.tree.parents)
    # The second tensor matters: heads that ignore it draft otherwise.
    blind = BlindHeads().requires_grad_(False)
    assert not torch.equal(draft_chain(blind, hidden, last, None, 3).tokens, chain_two.tokens)


class BlindHeads(TwoStateHeads):
    """The same heads, ignoring the second tensor of their state."""

    def step(self, head, state, tokens):
        (hidden, seen), _ = super().step(head, state, tokens)
        return (hidden, seen), hidden @ self.out


def test_decoding_with_two_tensor_heads_is_lossless():
    verifier, prompt = make_verifier(), make_prompt()
    speculator = make_speculator(n_predict=3)
    speculator.speculator = TwoStateHeads()
    expected = verifier.generate(prompt, max_new_tokens=16, do_sample=False)
    for extra in ({}, {"n_candidates": 4}):
        output = verifier.generate(prompt, max_new_tokens=16, do_sample=False, assistant_model=speculator, **extra)
        assert torch.equal(output, expected)
