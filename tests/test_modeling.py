"""The step-wise drafting path and the training forward compute the same thing; the loss is per-head cross-entropy."""

import pytest
import torch
from conftest import HIDDEN, VOCAB, make_speculator


@pytest.mark.parametrize("tie_weights,scale_input", [(False, False), (True, True)])
def test_step_api_equals_training_forward(tie_weights, scale_input):
    speculator = make_speculator(n_predict=4, tie_weights=tie_weights, scale_input=scale_input)
    hidden = torch.randn(2, 1, HIDDEN)
    tokens = torch.randint(0, VOCAB, (2, 1 + 4))
    with torch.no_grad():
        parallel = speculator(hidden_states=hidden, input_ids=tokens).logits[:, :, 0]
        heads, state = speculator.speculator, speculator.speculator.input_state(hidden[:, 0])
        for i in range(4):
            state, logits = heads.step(i, state, tokens[:, i])
            torch.testing.assert_close(logits, parallel[i])


def test_labels_give_summed_per_head_cross_entropy():
    speculator = make_speculator(n_predict=3)
    hidden, tokens = torch.randn(2, 6, HIDDEN), torch.randint(0, VOCAB, (2, 9))
    labels = torch.randint(0, VOCAB, (3, 2, 6))
    labels[1, 0, :2] = -100
    out = speculator(hidden_states=hidden, input_ids=tokens, labels=labels)
    expected = [
        torch.nn.functional.cross_entropy(out.logits[i].reshape(-1, VOCAB), labels[i].reshape(-1)) for i in range(3)
    ]
    torch.testing.assert_close(out.head_losses, torch.stack(expected))
    torch.testing.assert_close(out.loss, sum(expected))
    out.loss.backward()
    assert speculator.speculator.head[2].weight.grad is not None


def test_state_scaling_uses_the_trained_head_count():
    """Drafting with fewer heads than trained keeps state_weight from the trained n_predict (a TGI bug)."""
    four = make_speculator(n_predict=4, inner_dim=48)
    state_weight = 0.5 ** (0.5 / 4)
    expected = ((1 - state_weight**2) * 48 / 2) ** 0.5 / state_weight
    assert four.speculator.emb_scale == pytest.approx(expected)
