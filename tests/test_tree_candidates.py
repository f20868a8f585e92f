"""Tree candidates: the top-n_candidates suffixes of the top_k_tokens_per_head tree, verified in one forward."""

import pytest
import torch
from conftest import ARCHITECTURES, expected_steps, make_oracle, make_prompt, make_speculator, make_verifier
from test_batched_decoding import ragged_batch

from hf_mlp_speculator import speculation_state
from hf_mlp_speculator.drafting.drafts import DraftKind, TreeSpec, draft_tree, tree_from_candidates


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
@pytest.mark.parametrize("top_k, n_candidates", [([2, 2, 2], 3), ([3, 1, 2], 6), ([1, 1, 1], 1)])
def test_tree_greedy_equals_plain_greedy(arch, top_k, n_candidates):
    verifier, prompt = make_verifier(arch), make_prompt()
    speculator = make_oracle(verifier, prompt, 30, wrong=lambda p, h: (p + 2 * h) % 3 == 0)
    output = verifier.generate(prompt, max_new_tokens=30, do_sample=False, assistant_model=speculator,
                               top_k_tokens_per_head=top_k, n_candidates=n_candidates)  # fmt: skip
    assert torch.equal(output, verifier.generate(prompt, max_new_tokens=30, do_sample=False))
    assert speculator.speculation_metrics.num_accepted_tokens > 0


def test_random_speculator_tree_greedy_equals_plain_greedy_on_a_ragged_batch():
    verifier, (input_ids, attention_mask) = make_verifier(), ragged_batch()
    speculator = make_speculator(n_predict=4)
    output = verifier.generate(input_ids, attention_mask=attention_mask, max_new_tokens=25, do_sample=False,
                               assistant_model=speculator, n_candidates=4)  # fmt: skip
    expected = verifier.generate(input_ids, attention_mask=attention_mask, max_new_tokens=25, do_sample=False)
    assert torch.equal(output, expected)


def test_tree_accepts_more_than_the_chain_when_the_top_draft_is_a_near_miss():
    """
    The oracle's head-0 draft is always wrong, with the right token a close second. A chain can then never accept
    anything; a tree keeping 2 tokens at head 0 always holds the right path, and accepts every draft.
    """
    verifier, prompt = make_verifier(), make_prompt()
    near_miss = lambda p, h: h == 0  # noqa: E731
    chain = make_oracle(verifier, prompt, 24, wrong=near_miss)
    tree = make_oracle(verifier, prompt, 24, wrong=near_miss)
    plain = verifier.generate(prompt, max_new_tokens=24, do_sample=False)
    assert torch.equal(verifier.generate(prompt, max_new_tokens=24, do_sample=False, assistant_model=chain), plain)
    output = verifier.generate(prompt, max_new_tokens=24, do_sample=False, assistant_model=tree,
                               top_k_tokens_per_head=[2, 1, 1], n_candidates=2)  # fmt: skip
    assert torch.equal(output, plain)

    chain_steps = expected_steps(prompt.shape[1], 24, 3, near_miss)
    tree_steps = expected_steps(prompt.shape[1], 24, 3, lambda p, h: False)
    assert chain.speculation_metrics.num_accepted_tokens == sum(a for _, _, a in chain_steps) == 0
    assert tree.speculation_metrics.num_steps == len(tree_steps)
    assert tree.speculation_metrics.num_accepted_tokens == sum(a for _, _, a in tree_steps)
    assert tree.speculation_metrics.mean_tokens_per_step > 3 > 1 == chain.speculation_metrics.mean_tokens_per_step


def test_tree_merges_shared_prefixes():
    candidates = torch.tensor([[[5, 6, 7], [5, 6, 8], [9, 6, 7]]])
    tree = tree_from_candidates(candidates, torch.tensor([1]), torch.tensor([3]))
    assert tree.tokens.tolist() == [[1, 5, 6, 7, 8, 9, 6, 7]]
    assert tree.tree.parents.tolist() == [[0, 0, 1, 2, 2, 0, 5, 6]]
    assert tree.tree.depths.tolist() == [[0, 1, 2, 3, 3, 1, 2, 3]]
    assert tree.tree.paths(tree.tokens, tree.max_depth)[0, 4].tolist() == [5, 6, 8]
    ancestors = tree.tree.ancestors[0]
    assert ancestors[4].nonzero().squeeze(1).tolist() == [0, 1, 2, 4]
    # A row with budget for one draft keeps only the distinct first tokens.
    short = tree_from_candidates(candidates, torch.tensor([1]), torch.tensor([1]))
    assert short.tokens.tolist() == [[1, 5, 9]]


def test_draft_tree_keeps_the_most_likely_paths():
    """Against an independent enumeration of every path of the top-k tree, scored by summed log-probabilities."""
    speculator = make_speculator(n_predict=3, inner_dim=16)
    heads = speculator.speculator
    hidden, token = torch.randn(1, 64), torch.tensor([4])
    top_k, n = [3, 2, 2], 5
    with torch.no_grad():
        tree = draft_tree(heads, hidden, token, torch.tensor([3]), 3, TreeSpec(tuple(top_k), n, 3))
        paths = []

        def walk(state, last, head, tokens, score):
            if head == 3:
                paths.append((score, tokens))
                return
            state, logits = heads.step(head, state, last)
            logp = logits.log_softmax(-1)[0]
            for t in logp.topk(top_k[head]).indices.tolist():
                walk(state, torch.tensor([t]), head + 1, tokens + [t], score + logp[t].item())

        walk(heads.input_state(hidden), token, 0, [], 0.0)
    best = [tokens for _, tokens in sorted(paths, key=lambda p: -p[0])[:n]]
    leaves = tree.tree.depths[0] == 3
    assert sorted(tree.tree.paths(tree.tokens, 3)[0, leaves].tolist()) == sorted(best)


def test_trees_teach_the_controller_their_acceptance():
    """A tree's drafts have no single confidence: its acceptance per depth is still recorded, so that the controller
    sizes trees from what they achieved rather than from its prior."""
    verifier, prompt = make_verifier(), make_prompt()
    speculator = make_oracle(verifier, prompt, 30)
    verifier.generate(prompt, max_new_tokens=30, do_sample=False, assistant_model=speculator, n_candidates=3)
    estimate = speculation_state(verifier, speculator).acceptance[DraftKind.TREE]
    assert estimate.drafted.sum() > 0 and estimate.means()[0] > 0.9
