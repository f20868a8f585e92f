"""Heads that start from the base model's embeddings and LM head: tied and untied bases, full and draft vocabulary."""

import math

import pytest
import torch
from conftest import HIDDEN, VOCAB, make_speculator
from transformers import LlamaConfig, LlamaForCausalLM

from hf_mlp_speculator.training.initialization import initialize_from_base

DRAFT_VOCAB = torch.tensor([2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73, 79, 83])


def tiny_llama(tied: bool):
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, tie_word_embeddings=tied)  # fmt: skip
    base = LlamaForCausalLM(config)
    with torch.no_grad():  # a non-trivial spread, so that a missing rescale shows
        base.get_input_embeddings().weight.mul_(7)
    return base


def rms(weight) -> float:
    return weight.pow(2).mean().sqrt().item()


def positive_multiple(actual, direction) -> None:
    """`actual` is `direction` times a positive number."""
    scale = (actual * direction).sum() / direction.pow(2).sum()
    assert scale > 0
    torch.testing.assert_close(actual, scale * direction, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("inner_dim", [HIDDEN, 16], ids=["inner=hidden", "inner<hidden"])
@pytest.mark.parametrize("reduced", [False, True], ids=["full-vocab", "draft-vocab"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied-base", "tied-base"])
def test_heads_start_from_the_base_embeddings_and_lm_head(tied, reduced, inner_dim):
    base = tiny_llama(tied)
    embeddings = base.get_input_embeddings().weight.detach().clone()
    lm_head = base.get_output_embeddings().weight.detach().clone()
    assert torch.equal(embeddings, lm_head) == tied
    kwargs = {"draft_vocab_size": len(DRAFT_VOCAB)} if reduced else {}
    speculator = make_speculator(n_predict=3, inner_dim=inner_dim, **kwargs)
    if reduced:
        speculator.speculator.draft_vocab.copy_(DRAFT_VOCAB)
        lm_head = lm_head[DRAFT_VOCAB]
    initialize_from_base(speculator, base)
    heads = speculator.speculator
    assert torch.equal(base.get_input_embeddings().weight, embeddings)  # the base is left alone

    if inner_dim == HIDDEN:
        projection = torch.eye(HIDDEN)
    else:
        # The projection, read back from head 0's embedding (the embeddings have full column rank)...
        projection = torch.linalg.lstsq(embeddings, heads.emb[0].weight.detach()).solution
        projection = projection / projection.norm(dim=0).mean()
        # ...is orthonormal, and spans the top right-singular vectors of the (draft rows of the) LM head.
        torch.testing.assert_close(projection.T @ projection, torch.eye(inner_dim), rtol=0, atol=1e-3)
        top = torch.linalg.svd(lm_head.double(), full_matrices=False).Vh[:inner_dim].T.float()
        torch.testing.assert_close(top @ (top.T @ projection), projection, rtol=0, atol=1e-3)
    std = 1 / math.sqrt(inner_dim)
    for i in range(3):
        emb, head = heads.emb[i].weight.detach(), heads.head[i].weight.detach()
        assert emb.shape == (VOCAB, inner_dim) and head.shape == (len(lm_head), inner_dim)
        positive_multiple(emb, embeddings @ projection)
        positive_multiple(head, lm_head @ projection)
        assert rms(emb) == pytest.approx(std, rel=1e-4) and rms(head) == pytest.approx(std, rel=1e-4)


def test_heads_wider_than_the_base_are_refused():
    speculator = make_speculator(inner_dim=HIDDEN + 8)
    message = r"inner_dim=72 is wider than the base model's hidden size 64.*--no-init-from-base"
    with pytest.raises(ValueError, match=message):
        initialize_from_base(speculator, tiny_llama(tied=False))


def test_a_draft_vocabulary_smaller_than_the_heads_still_starts_from_the_base():
    """8 draft tokens span only 8 of the 16 directions the heads need; the projection must still be 16 wide."""
    base = tiny_llama(tied=False)
    embeddings = base.get_input_embeddings().weight.detach()
    speculator = make_speculator(n_predict=2, inner_dim=16, draft_vocab_size=8)
    speculator.speculator.draft_vocab.copy_(DRAFT_VOCAB[:8])
    initialize_from_base(speculator, base)
    lm_head = base.get_output_embeddings().weight.detach()[DRAFT_VOCAB[:8]]
    projection = torch.linalg.lstsq(embeddings, speculator.speculator.emb[0].weight.detach()).solution
    projection = projection / projection.norm(dim=0).mean()
    torch.testing.assert_close(projection.T @ projection, torch.eye(16), rtol=0, atol=1e-3)
    # The draft rows' whole row space lies inside the heads' 16 directions, so their logits keep all of it.
    rows = torch.linalg.svd(lm_head, full_matrices=False).Vh.T
    torch.testing.assert_close(projection @ (projection.T @ rows), rows, rtol=0, atol=1e-3)
    for i in range(2):
        positive_multiple(speculator.speculator.head[i].weight.detach(), lm_head @ projection)
