"""The generator drafts from the hidden state of the position that emitted the last token, after every round.

Greedy equality cannot see a wrong row (a bad draft is just rejected), so these tests use an oracle speculator whose
drafts are right only from the right state, and deliberately wrong at known (position, head) pairs: the number of
tokens accepted each step is then known exactly, and any other row shows up as a different count.
"""

import pytest
import torch
from conftest import expected_steps, make_oracle, make_prompt, make_verifier

from hf_mlp_speculator import MLPSpeculatorCandidateGenerator
from hf_mlp_speculator.generation import mixin as generation
from hf_mlp_speculator.generation.speculative_decoding import SpeculativeBatch


@pytest.mark.parametrize("loop", ["ours", "transformers"])
@pytest.mark.parametrize("n_predict", [1, 2, 3, 5])
@pytest.mark.parametrize("pattern", [lambda p, h: (p + h) % 3 == 2, lambda p, h: (p * p + h) % 3 == 1])
def test_acceptance_is_exactly_what_the_right_rows_give(n_predict, pattern, loop):
    verifier, prompt = make_verifier(), make_prompt()
    speculator = make_oracle(verifier, prompt, 40, n_predict=n_predict, wrong=pattern)
    output = greedy(verifier, prompt, loop, assistant_model=speculator)
    assert torch.equal(output, greedy(verifier, prompt, loop))

    steps = expected_steps(prompt.shape[1], 40, n_predict, pattern)
    metrics = speculator.speculation_metrics
    assert metrics.num_steps == len(steps)
    assert metrics.num_draft_tokens == sum(d for _, d, _ in steps)
    assert metrics.num_accepted_tokens == sum(a for _, _, a in steps)
    assert n_predict == 1 or len({a for _, d, a in steps if d == n_predict}) > 1  # several pruning offsets occur
    assert metrics.head_accepted_tokens == [sum(a > head for _, _, a in steps) for head in range(n_predict)]
    # The rows themselves: the position that emitted the last token, for every step that drafted.
    assert speculator.speculator.positions_seen == [p for p, drafted, _ in steps if drafted]
    assert speculator.speculator.positions_seen[0] == prompt.shape[1] - 1


def greedy(verifier, prompt, loop, **kwargs):
    """Greedy `generate()` in the package's loop, or in transformers' (where per-token scores send it)."""
    if loop == "ours":
        return verifier.generate(prompt, max_new_tokens=40, do_sample=False, **kwargs)
    output = verifier.generate(prompt, max_new_tokens=40, do_sample=False, return_dict_in_generate=True,
                               output_scores=True, **kwargs)  # fmt: skip
    assert len(output.scores) == 40  # only transformers' loop returns them
    return output.sequences


@pytest.mark.parametrize("loop", ["ours", "transformers"])
def test_wrong_row_would_be_caught(loop, monkeypatch):
    """The check above has teeth: drafting from the last verified row instead of row m changes the counts."""
    verifier, prompt = make_verifier(), make_prompt()
    pattern = lambda p, h: (p + h) % 3 == 2  # noqa: E731
    speculator = make_oracle(verifier, prompt, 40, n_predict=3, wrong=pattern)
    if loop == "ours":
        accept_chain = SpeculativeBatch.accept_chain

        def last_row(self, drafts, outputs):
            return accept_chain(self, drafts, outputs)._replace(hidden=outputs.hidden_states[-1][:, -1])

        monkeypatch.setattr(SpeculativeBatch, "accept_chain", last_row)
    else:

        class LastRow(MLPSpeculatorCandidateGenerator):
            def get_candidates(self, input_ids, *, n_last_matches, **kwargs):
                return super().get_candidates(input_ids, n_last_matches=self.num_drafted, **kwargs)

        monkeypatch.setattr(generation, "MLPSpeculatorCandidateGenerator", LastRow)
    greedy(verifier, prompt, loop, assistant_model=speculator)
    steps = expected_steps(prompt.shape[1], 40, 3, pattern)
    assert speculator.speculation_metrics.num_accepted_tokens != sum(a for _, _, a in steps)
