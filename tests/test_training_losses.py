"""The distillation losses and the acceptance counts, against explicit per-position loops."""

import math

import pytest
import torch

from hf_mlp_speculator.training.losses import IGNORE_INDEX, Batch, acceptance_counts, draft_index, token_losses

VOCAB, HEADS, POSITIONS, TOP_K = 12, 3, 7, 4
DRAFT_VOCAB = torch.tensor([1, 4, 5, 9, 11])


def make_batch(seed=0) -> Batch:
    """Labels and top-k targets for 3 heads at 7 positions, some past a sequence's end, many outside DRAFT_VOCAB."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, VOCAB, (HEADS, POSITIONS), generator=generator)
    labels[1, 5:] = labels[2, 4:] = IGNORE_INDEX  # sequence ends: heads further ahead lose positions first
    labels[0, 0], labels[0, 1], labels[1, 0] = 4, 2, 11  # in, out of, and in the draft vocabulary
    soft_ids = torch.stack([torch.randperm(VOCAB, generator=generator)[:TOP_K] for _ in range(HEADS * POSITIONS)])
    soft_ids = soft_ids.view(HEADS, POSITIONS, TOP_K)
    soft_ids[0, 2] = torch.tensor([9, 4, 0, 1])
    soft_logprobs = torch.randn(HEADS, POSITIONS, TOP_K, generator=generator).log_softmax(-1) - 0.3
    soft_logprobs[labels == IGNORE_INDEX] = -torch.inf  # as Targets.batch leaves them
    return Batch(
        states=torch.randn(POSITIONS, 8, generator=generator),
        input_ids=torch.randint(0, VOCAB, (POSITIONS, HEADS + 1), generator=generator),
        labels=labels,
        soft_ids=soft_ids,
        soft_logprobs=soft_logprobs,
    )


def expected_losses(logits, batch, draft_vocab, loss) -> torch.Tensor:
    """Per head and position, with plain Python: log-softmax over the scored tokens, sums over the top-k list."""
    scored = list(range(VOCAB)) if draft_vocab is None else draft_vocab.tolist()
    expected = torch.zeros(HEADS, POSITIONS, dtype=torch.float64)
    for i in range(HEADS):
        for b in range(POSITIONS):
            label = batch.labels[i, b].item()
            if label == IGNORE_INDEX:
                continue
            row = logits[i, b].double().tolist()
            log_z = math.log(sum(math.exp(x) for x in row))
            logprob = {token: row[j] - log_z for j, token in enumerate(scored)}
            hard = -logprob[label] if label in logprob else 0.0  # a label the heads cannot score is not learned
            soft = 0.0
            for token, lp in zip(batch.soft_ids[i, b].tolist(), batch.soft_logprobs[i, b].tolist()):
                if token in logprob:  # mass on tokens outside the draft vocabulary is unreachable
                    soft -= math.exp(lp) * logprob[token]
            expected[i, b] = {"hard": hard, "soft": soft, "mix": 0.5 * (hard + soft)}[loss]
    return expected


@pytest.mark.parametrize("reduced", [False, True], ids=["full-vocab", "draft-vocab"])
@pytest.mark.parametrize("loss", ["soft", "hard", "mix"])
def test_token_losses_match_an_explicit_computation(loss, reduced):
    batch = make_batch()
    draft_vocab = DRAFT_VOCAB if reduced else None
    width = len(DRAFT_VOCAB) if reduced else VOCAB
    logits = torch.randn(HEADS, POSITIONS, width, generator=torch.Generator().manual_seed(1)) * 3
    losses = token_losses(logits, batch, draft_index(draft_vocab, VOCAB), loss)
    expected = expected_losses(logits, batch, draft_vocab, loss)
    assert losses.shape == (HEADS, POSITIONS)
    torch.testing.assert_close(losses.double(), expected, rtol=1e-5, atol=1e-5)
    assert (losses[batch.labels == IGNORE_INDEX] == 0).all()
    if reduced and loss == "hard":
        assert losses[0, 1] == 0 and losses[0, 0] > 0  # label 2 is outside the draft vocabulary, label 4 inside


def test_soft_loss_ignores_unreachable_mass_and_hard_ignores_unreachable_labels():
    """A position whose every target lies outside the draft vocabulary teaches nothing (and gives no gradient)."""
    batch = make_batch()
    batch.labels[:] = IGNORE_INDEX
    batch.labels[0, 3] = 2
    batch.soft_ids[0, 3] = torch.tensor([0, 2, 3, 6])  # none in DRAFT_VOCAB
    batch.soft_logprobs[0, 3] = torch.tensor([-0.5, -1.5, -2.0, -3.0])
    logits = torch.randn(HEADS, POSITIONS, len(DRAFT_VOCAB), requires_grad=True)
    for loss in ("soft", "hard", "mix"):
        losses = token_losses(logits, batch, draft_index(DRAFT_VOCAB, VOCAB), loss)
        assert losses[0, 3] == 0
        (grad,) = torch.autograd.grad(losses.sum(), logits)
        assert (grad == 0).all()


def test_draft_index_maps_base_ids_into_the_draft_vocabulary():
    index = draft_index(DRAFT_VOCAB, VOCAB)
    assert index.tolist() == [-100, 0, -100, -100, 1, 2, -100, -100, -100, 3, -100, 4]
    assert torch.equal(draft_index(None, VOCAB), torch.arange(VOCAB))


@pytest.mark.parametrize("reduced", [False, True], ids=["full-vocab", "draft-vocab"])
def test_acceptance_counts_heads_all_right_up_to_i(reduced):
    generator = torch.Generator().manual_seed(3)
    batch = make_batch()
    width = len(DRAFT_VOCAB) if reduced else VOCAB
    predictions = torch.randint(0, width, (HEADS, POSITIONS), generator=generator)
    as_base_ids = DRAFT_VOCAB[predictions] if reduced else predictions
    # Make many drafts right, so that the chains of right heads have every length.
    right = torch.rand(HEADS, POSITIONS, generator=generator) < 0.7
    labels = torch.where(right, as_base_ids, batch.labels)
    batch.labels = torch.where(batch.labels == IGNORE_INDEX, IGNORE_INDEX, labels)
    logits = torch.nn.functional.one_hot(predictions, width).float() * 5
    counts = acceptance_counts(logits, batch, DRAFT_VOCAB if reduced else None)

    hits, accepted, positions = [0] * HEADS, [0] * HEADS, [0] * HEADS
    for b in range(POSITIONS):
        chain = True
        for i in range(HEADS):
            label = batch.labels[i, b].item()
            ok = label != IGNORE_INDEX and as_base_ids[i, b].item() == label
            chain = chain and ok
            positions[i] += label != IGNORE_INDEX
            hits[i] += ok
            accepted[i] += chain
    assert counts.tolist() == [hits, accepted, positions]
    assert hits != accepted  # a head right after a wrong one is a hit but no acceptance
