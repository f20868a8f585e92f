"""The targets' attention on CPU: grouped key/value heads read in place under a padding mask, same results as `sdpa`."""

import pytest
import torch
import transformers.integrations.sdpa_attention as sdpa_attention
from conftest import VOCAB, make_verifier

from hf_mlp_speculator.training.grouped_attention import grouped_sdpa
from hf_mlp_speculator.training.targets import continue_prompts


@pytest.fixture
def repeat_kv_calls(monkeypatch):
    """How many times transformers' `sdpa` attention copied grouped key/value heads."""
    calls, real = [], sdpa_attention.repeat_kv

    def counting(hidden_states, n_rep):
        calls.append(n_rep)
        return real(hidden_states, n_rep)

    monkeypatch.setattr(sdpa_attention, "repeat_kv", counting)
    return calls


def padded_batch():
    input_ids = torch.randint(1, VOCAB, (3, 9), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(input_ids)
    mask[0, :4], mask[2, :1] = 0, 0
    return input_ids, mask


@torch.no_grad()
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_padded_forward_reads_grouped_heads_in_place_with_sdpa_results(arch, repeat_kv_calls):
    model = make_verifier(arch)  # 4 query heads, 2 key/value heads
    input_ids, mask = padded_batch()
    expected = model(input_ids, attention_mask=mask).logits
    assert len(repeat_kv_calls) == 2 * model.config.num_hidden_layers  # keys and values, every layer: the copies
    repeat_kv_calls.clear()

    with grouped_sdpa(model):
        logits = model(input_ids, attention_mask=mask).logits
    assert repeat_kv_calls == []
    torch.testing.assert_close(logits, expected, rtol=1e-6, atol=1e-6)
    assert model.config._attn_implementation == "sdpa"


def test_the_model_attends_as_before_after_an_error_inside():
    model = make_verifier()
    with pytest.raises(RuntimeError, match="stop"), grouped_sdpa(model):
        assert model.config._attn_implementation != "sdpa"
        raise RuntimeError("stop")
    assert model.config._attn_implementation == "sdpa"


def test_a_model_that_does_not_attend_with_sdpa_is_left_as_it_is():
    model = make_verifier()
    model.set_attn_implementation("eager")
    with grouped_sdpa(model):
        assert model.config._attn_implementation == "eager"
    assert model.config._attn_implementation == "eager"


def test_continuations_of_padded_prompts_are_the_same_as_with_sdpa(repeat_kv_calls):
    model = make_verifier()
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16]]
    expected = continue_prompts(model, prompts, 8, [], pad_token_id=0, top_k=4)
    copied = len(repeat_kv_calls)
    with grouped_sdpa(model):
        targets = continue_prompts(model, prompts, 8, [], pad_token_id=0, top_k=4)
    assert copied and len(repeat_kv_calls) == copied  # none inside
    assert torch.equal(targets.next_tokens, expected.next_tokens)
    assert torch.equal(targets.topk_ids, expected.topk_ids)
    # Kept in float16: a sum in another order may round a value to the neighbouring float16.
    torch.testing.assert_close(targets.states, expected.states, rtol=2**-10, atol=1e-5)
    torch.testing.assert_close(targets.topk_logprobs, expected.topk_logprobs, rtol=2**-10, atol=1e-5)


def test_the_trainer_computes_its_targets_without_copies_of_grouped_heads(tmp_path, repeat_kv_calls):
    from test_training_data import ONE_PROCESS, data_args
    from tiny_tokenizer import char_tokenizer

    from hf_mlp_speculator.training.training_data import build_training_data

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n\n".join(f"prompt {i} of {'a longer ' * (i % 3)}run" for i in range(12)))
    base = make_verifier()
    data = build_training_data(data_args(tmp_path, prompts), base, char_tokenizer(), ONE_PROCESS)
    assert len(data.train) and len(data.eval)
    assert repeat_kv_calls == []  # every batch is padded: each forward would have copied them
    assert base.config._attn_implementation == "sdpa"
