"""A reduced draft vocabulary: heads score a subset of the tokens, drafts map back to base ids, decoding stays exact."""

from types import SimpleNamespace

import pytest
import torch
from conftest import HIDDEN, VOCAB, make_prompt, make_verifier
from huggingface_hub.errors import StrictDataclassClassValidationError
from safetensors.torch import load_file, save_file
from transformers import AutoModel

from hf_mlp_speculator import MLPSpeculatorConfig, MLPSpeculatorPreTrainedModel
from hf_mlp_speculator.drafting.drafts import TreeSpec, draft_chain, draft_tree

DRAFT_IDS = torch.tensor([3, 5, 8, 13, 21, 34, 55, 89])


def draft_vocab_speculator(n_predict=3, tie_weights=False, seed=1):
    torch.manual_seed(seed)
    config = MLPSpeculatorConfig(vocab_size=VOCAB, emb_dim=HIDDEN, inner_dim=48, n_predict=n_predict,
                                 top_k_tokens_per_head=[2] * n_predict, tie_weights=tie_weights,
                                 draft_vocab_size=len(DRAFT_IDS))  # fmt: skip
    speculator = MLPSpeculatorPreTrainedModel(config).eval()
    speculator.speculator.draft_vocab.copy_(DRAFT_IDS)
    return speculator


def test_step_scores_the_draft_vocabulary_only():
    speculator = draft_vocab_speculator()
    heads = speculator.speculator
    hidden, tokens = torch.randn(2, 1, HIDDEN), torch.randint(0, VOCAB, (2, 4))
    with torch.no_grad():
        parallel = speculator(hidden_states=hidden, input_ids=tokens).logits[:, :, 0]
        state = heads.input_state(hidden[:, 0])
        for i in range(3):
            state, logits = heads.step(i, state, tokens[:, i])
            assert logits.shape == (2, VOCAB)
            outside = torch.ones(VOCAB, dtype=torch.bool)
            outside[DRAFT_IDS] = False
            assert (logits[:, outside] == torch.finfo(logits.dtype).min).all()
            torch.testing.assert_close(logits[:, DRAFT_IDS], parallel[i])
            # The same numbers as the head's own weights rows, independently of the package's mapping.
            expected = state @ heads.head[i].weight.T
            torch.testing.assert_close(logits[:, DRAFT_IDS], expected)


def test_chains_and_trees_draft_over_the_draft_vocabulary_as_over_the_whole_one():
    """Greedy chains and trees score the draft vocabulary alone: the same drafts and confidences as the heads' logits
    spread over the whole vocabulary give, computed here from `step`."""
    heads = draft_vocab_speculator(n_predict=3).speculator.requires_grad_(False)
    hidden, last = torch.randn(4, HIDDEN), torch.randint(0, VOCAB, (4,))
    chain = draft_chain(heads, hidden, last, None, 3)
    state, token, expected, confidences = heads.input_state(hidden), last, [last], []
    for head in range(3):
        state, logits = heads.step(head, state, token)
        token = logits.argmax(dim=-1)
        expected.append(token)
        confidences.append(logits.softmax(dim=-1)[torch.arange(4), token])
    assert torch.equal(chain.tokens, torch.stack(expected, dim=1))
    assert set(chain.tokens[:, 1:].flatten().tolist()) <= set(DRAFT_IDS.tolist())
    torch.testing.assert_close(chain.confidences, torch.stack(confidences, dim=1))
    tree = TreeSpec((2, 2, 2), 4, 3)
    whole = SimpleNamespace(step=heads.step, input_state=heads.input_state)  # the logits spread over all the tokens
    expected_tree, drafted_tree = draft_tree(whole, hidden, last, None, 3, tree), draft_tree(heads, hidden, last, None,
                                                                                             3, tree)
    assert torch.equal(drafted_tree.tokens, expected_tree.tokens)
    assert torch.equal(drafted_tree.tree.parents, expected_tree.tree.parents)


def test_a_tree_wider_than_the_draft_vocabulary_keeps_every_draft_token():
    """A head that keeps more tokens per branch than the draft vocabulary holds keeps them all (the rest have
    probability zero), and the likeliest paths are those of a tree over the whole vocabulary."""
    heads = draft_vocab_speculator(n_predict=2).speculator.requires_grad_(False)
    hidden, last = torch.randn(2, HIDDEN), torch.randint(0, VOCAB, (2,))
    tree = TreeSpec((len(DRAFT_IDS) + 2, 3), 5, 2)
    drafted = draft_tree(heads, hidden, last, None, 2, tree)
    whole = draft_tree(SimpleNamespace(step=heads.step, input_state=heads.input_state), hidden, last, None, 2, tree)
    assert torch.equal(drafted.tokens, whole.tokens) and torch.equal(drafted.tree.parents, whole.tree.parents)
    assert set(drafted.tokens[:, 1:].flatten().tolist()) <= set(DRAFT_IDS.tolist()) | {0}  # 0: padding nodes


def test_labels_are_mapped_into_the_draft_vocabulary():
    speculator = draft_vocab_speculator()
    hidden, tokens = torch.randn(1, 4, HIDDEN), torch.randint(0, VOCAB, (1, 7))
    labels = torch.tensor([[[5, 89, 4, -100]], [[3, 3, 3, 3]], [[90, 91, 92, 13]]])
    out = speculator(hidden_states=hidden, input_ids=tokens, labels=labels)
    # Base ids 5 -> 1, 89 -> 7, 3 -> 0, 13 -> 3; 4, 90, 91, 92 are outside the draft vocabulary and not learned.
    mapped = [torch.tensor([1, 7]), torch.tensor([0, 0, 0, 0]), torch.tensor([3])]
    kept = [torch.tensor([0, 1]), torch.arange(4), torch.tensor([3])]
    expected = [
        torch.nn.functional.cross_entropy(out.logits[i, 0, kept[i]], mapped[i]) for i in range(3)
    ]
    torch.testing.assert_close(out.head_losses, torch.stack(expected))


@pytest.mark.parametrize("tie_weights", [False, True])
def test_save_and_load_round_trip(tmp_path, tie_weights):
    speculator = draft_vocab_speculator(tie_weights=tie_weights)
    speculator.save_pretrained(tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    assert torch.equal(stored["speculator.draft_vocab"], DRAFT_IDS)
    assert stored["speculator.head.0.weight"].shape == (len(DRAFT_IDS), 48)
    loaded = AutoModel.from_pretrained(tmp_path)
    assert loaded.config.draft_vocab_size == len(DRAFT_IDS)
    assert torch.equal(loaded.speculator.draft_vocab, DRAFT_IDS)
    for key, value in speculator.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[key], value)


def test_missing_index_tensor_names_the_fix(tmp_path):
    draft_vocab_speculator().save_pretrained(tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    del stored["speculator.draft_vocab"]
    save_file(stored, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"draft_vocab_size=8.*no `speculator.draft_vocab` tensor.*Re-save"):
        AutoModel.from_pretrained(tmp_path)


def test_index_tensor_out_of_range_is_refused(tmp_path):
    speculator = draft_vocab_speculator()
    speculator.speculator.draft_vocab[-1] = VOCAB + 3
    speculator.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="draft_vocab must hold distinct ids below vocab_size 96"):
        AutoModel.from_pretrained(tmp_path)


def test_draft_vocab_larger_than_the_vocabulary_names_the_fix():
    with pytest.raises(StrictDataclassClassValidationError, match=r"draft_vocab_size is 100.*vocabulary of 96 tokens: set at most 96"):
        MLPSpeculatorConfig(vocab_size=VOCAB, emb_dim=HIDDEN, draft_vocab_size=100)


def test_full_vocabulary_config_keeps_the_published_fields(tmp_path):
    MLPSpeculatorConfig(vocab_size=VOCAB, emb_dim=HIDDEN).save_pretrained(tmp_path)
    assert "draft_vocab_size" not in (tmp_path / "config.json").read_text()


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_greedy_output_is_identical_to_plain(arch):
    verifier, prompt = make_verifier(arch), make_prompt()
    speculator = draft_vocab_speculator()
    expected = verifier.generate(prompt, max_new_tokens=16, do_sample=False)
    assert torch.equal(verifier.generate(prompt, max_new_tokens=16, do_sample=False, assistant_model=speculator),
                       expected)  # fmt: skip
    assert speculator.speculation_metrics.num_draft_tokens > 0
    batch = torch.cat([make_prompt(seed=3), make_prompt(seed=4)])
    expected = verifier.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=10, do_sample=False)
    speculative = verifier.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=10, do_sample=False,
                                    assistant_model=speculator)  # fmt: skip
    assert torch.equal(speculative, expected)


def sharp_draft_vocab_pair():
    """test_sampling's pair, with a speculator whose heads score tokens 0, 2 and 3 only: its q is 0 for token 1."""
    from test_sampling import sharp_pair

    verifier, full = sharp_pair()
    config = MLPSpeculatorConfig(**{**full.config.to_dict(), "draft_vocab_size": 3})
    speculator = MLPSpeculatorPreTrainedModel(config).eval()
    speculator.speculator.draft_vocab.copy_(torch.tensor([0, 2, 3]))
    with torch.no_grad():
        for head in speculator.speculator.head:
            head.weight.mul_(4)
    return verifier, speculator


def test_sampling_follows_the_verifier_distribution_exactly():
    """The draft distribution is zero outside the draft vocabulary; rejection sampling on it stays exact."""
    from test_sampling import (
        BATCH_SAMPLES,
        SAMPLES,
        SHORT_PROMPT,
        batched_sample_counts,
        chi_square_p_value,
        exact_distribution,
        sample_counts,
    )

    verifier, speculator = sharp_draft_vocab_pair()
    probs = exact_distribution(verifier)
    counts, drafted, accepted = sample_counts(verifier, speculator)
    assert 0.2 * drafted < accepted < 0.8 * drafted
    assert chi_square_p_value(counts, probs, SAMPLES) > 1e-3
    assert any(1 in continuation for continuation in counts)  # token 1 is emitted although never drafted
    counts, _, metrics = batched_sample_counts(verifier, speculator)
    assert 0.2 * metrics.num_draft_tokens < metrics.num_accepted_tokens < 0.8 * metrics.num_draft_tokens
    assert chi_square_p_value(counts[0], probs, BATCH_SAMPLES) > 1e-3
    assert chi_square_p_value(counts[1], exact_distribution(verifier, SHORT_PROMPT), BATCH_SAMPLES) > 1e-3


@pytest.mark.parametrize("tie_weights", [False, True])
def test_expanded_copy_saves_the_published_layout(tmp_path, tie_weights):
    speculator = draft_vocab_speculator(tie_weights=tie_weights)
    full = speculator.expand_draft_vocab()
    full.save_pretrained(tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    assert "speculator.draft_vocab" not in stored and "draft_vocab_size" not in (tmp_path / "config.json").read_text()
    assert stored["speculator.head.0.weight"].shape == (VOCAB, 48)
    hidden, tokens = torch.randn(2, 1, HIDDEN), torch.randint(0, VOCAB, (2, 4))
    with torch.no_grad():
        reduced = speculator(hidden_states=hidden, input_ids=tokens).logits
        expanded = AutoModel.from_pretrained(tmp_path)(hidden_states=hidden, input_ids=tokens).logits
    torch.testing.assert_close(expanded[..., DRAFT_IDS], reduced)  # the draft vocabulary scores as before
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[DRAFT_IDS] = False
    assert not expanded[..., outside].any()  # the other tokens get logit 0
    with pytest.raises(ValueError, match="already scores the whole vocabulary"):
        full.expand_draft_vocab()
