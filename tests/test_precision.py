"""A bfloat16 verifier with a speculator in bfloat16, float16 or float32: output identical to plain bfloat16."""

import pytest
import torch
from conftest import make_oracle, make_prompt, make_speculator, make_verifier


def bf16_batch(batch: int):
    verifier = make_verifier().to(torch.bfloat16)
    prompts = torch.cat([make_prompt(seed=seed) for seed in range(batch)])
    return verifier, prompts, dict(attention_mask=torch.ones_like(prompts), max_new_tokens=20)


@pytest.mark.parametrize("batch", [1, 3])
def test_bf16_verifier_greedy_with_accepted_drafts(batch):
    """Most drafts are right here, so the verifier scores several tokens per forward in bfloat16."""
    verifier, prompts, kwargs = bf16_batch(batch)
    speculator = make_oracle(verifier, prompts, 20, attention_mask=kwargs["attention_mask"],
                             wrong=lambda row, position, head: (position + row + head) % 4 == 0)  # fmt: skip
    expected = verifier.generate(prompts, do_sample=False, **kwargs)
    assert torch.equal(verifier.generate(prompts, do_sample=False, assistant_model=speculator, **kwargs), expected)
    assert speculator.speculation_metrics.num_accepted_tokens > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("batch", [1, 3])
def test_bf16_verifier_with_a_speculator_in_any_dtype(dtype, batch):
    verifier, prompts, kwargs = bf16_batch(batch)
    speculator = make_speculator().to(dtype)
    expected = verifier.generate(prompts, do_sample=False, **kwargs)
    assert torch.equal(verifier.generate(prompts, do_sample=False, assistant_model=speculator, **kwargs), expected)
    assert speculator.speculation_metrics.num_draft_tokens > 0
    # Sampling runs too, and a seed gives the same tokens.
    outputs = []
    for _ in range(2):
        torch.manual_seed(7)
        outputs.append(verifier.generate(prompts, do_sample=True, assistant_model=speculator, **kwargs))
    assert torch.equal(*outputs)
    assert next(speculator.parameters()).dtype == dtype  # the call changed nothing
