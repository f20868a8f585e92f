"""Attention on CPU, in decoding and in the trainer's targets: grouped key/value heads read in place under a mask,
with `sdpa`'s results."""

import pytest
import torch
import transformers.integrations.sdpa_attention as sdpa_attention
from conftest import VOCAB, make_oracle, make_verifier
from test_batched_decoding import ragged_batch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from hf_mlp_speculator import fast_cpu_decoding
from hf_mlp_speculator.cpu import grouped_attention
from hf_mlp_speculator.cpu.grouped_attention import grouped_sdpa, grouped_sdpa_attention_forward
from hf_mlp_speculator.training.targets import continue_prompts


# torch 2.7 and 2.8 run grouped heads under a mask in the math kernel, slower than copying them: nothing to read there.
needs_cpu_flash = pytest.mark.skipif(not grouped_attention.CPU_FLASH_TAKES_GROUPED_HEADS, reason="torch < 2.9")


@pytest.fixture
def repeat_kv_calls(monkeypatch):
    """How many times transformers' `sdpa` attention copied grouped key/value heads."""
    calls, real = [], sdpa_attention.repeat_kv

    def counting(hidden_states, n_rep):
        calls.append(n_rep)
        return real(hidden_states, n_rep)

    monkeypatch.setattr(sdpa_attention, "repeat_kv", counting)
    monkeypatch.delenv("TRANSFORMERS_SDPA_FORCE_GQA", raising=False)  # transformers 5.25's own switch
    return calls


def padded_batch():
    input_ids = torch.randint(1, VOCAB, (3, 9), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(input_ids)
    mask[0, :4], mask[2, :1] = 0, 0
    return input_ids, mask


@needs_cpu_flash
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
    assert torch.equal(logits, expected)  # the flash kernel computes each query head as it does on the copies
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention.sdpa_attention_forward


@needs_cpu_flash
def test_the_registry_is_as_before_afterwards_after_an_error_and_with_an_override_of_the_users(repeat_kv_calls):
    transformers_sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    with pytest.raises(RuntimeError, match="stop"), grouped_sdpa(make_verifier()):
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is not transformers_sdpa
        raise RuntimeError("stop")
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is transformers_sdpa

    users = []  # a user's own `sdpa`, which the fallback must call
    ALL_ATTENTION_FUNCTIONS["sdpa"] = lambda *args, **kwargs: users.append(1) or transformers_sdpa(*args, **kwargs)
    try:
        users_sdpa, model = ALL_ATTENTION_FUNCTIONS["sdpa"], make_verifier()
        with torch.no_grad(), grouped_sdpa(model), grouped_sdpa(model):  # nested: the inner one changes nothing more
            model(*padded_batch()[:1])  # no mask: the user's function computes it
            assert len(users) == model.config.num_hidden_layers
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is users_sdpa
    finally:
        del ALL_ATTENTION_FUNCTIONS["sdpa"]
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is transformers_sdpa


def test_other_devices_positional_biases_and_heads_that_are_not_grouped_attend_with_sdpa_itself():
    calls = []

    def sdpa(*args, **kwargs):
        calls.append(kwargs)
        return "sdpa's", None

    def attend(query, heads=2, device="cpu", mask=True, **kwargs):
        key = torch.zeros(1, heads, 5, 8, device=device)
        attention_mask = torch.ones(1, 1, 1, 5, dtype=torch.bool, device=device) if mask else None
        return grouped_sdpa_attention_forward(None, query, key, key, attention_mask, sdpa=sdpa, **kwargs)[0]

    cpu, meta = torch.zeros(1, 4, 1, 8), torch.zeros(1, 4, 1, 8, device="meta")
    assert attend(meta, device="meta") == "sdpa's"
    assert attend(cpu, position_bias=torch.zeros(1, 4, 1, 5)) == "sdpa's"
    assert attend(cpu, softcap=30.0) == "sdpa's" and calls[-1] == {"softcap": 30.0}
    assert attend(cpu, heads=4) == "sdpa's"
    assert attend(cpu, mask=False) == "sdpa's"
    assert len(calls) == 5
    assert attend(cpu).shape == (1, 1, 4, 8) and len(calls) == 5  # grouped under a mask on CPU: read in place


@needs_cpu_flash
@torch.no_grad()
@pytest.mark.parametrize("tree", [False, True])
def test_speculative_and_fast_plain_decoding_of_a_padded_batch_read_grouped_heads_in_place(tree, repeat_kv_calls):
    """
    Every forward of speculative `generate()` on a padded batch has a mask (chains a 2D one, trees a 4D one), and so
    would copy the whole cache's grouped heads: it reads them in place instead, as `fast_cpu_decoding` does for plain
    decoding, with plain `generate()`'s tokens. Plain `generate()` itself is left as it is.
    """
    verifier, (input_ids, mask) = make_verifier(), ragged_batch()
    kwargs = dict(attention_mask=mask, max_new_tokens=20, do_sample=False)
    expected = verifier.generate(input_ids, **kwargs)
    assert repeat_kv_calls  # plain generate() copies them

    speculator = make_oracle(verifier, input_ids, 20, attention_mask=mask, wrong=lambda r, p, h: (r + p + h) % 4 == 0)
    repeat_kv_calls.clear()
    tree_kwargs = {"n_candidates": 3, "top_k_tokens_per_head": [2, 2, 1]} if tree else {}
    output = verifier.generate(input_ids, **kwargs, assistant_model=speculator, **tree_kwargs)
    assert torch.equal(output, expected)
    assert speculator.speculation_metrics.num_accepted_tokens > 0  # steps verified drafts: several tokens per row
    with fast_cpu_decoding(verifier):
        assert torch.equal(verifier.generate(input_ids, **kwargs), expected)
    assert repeat_kv_calls == []
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention.sdpa_attention_forward


@needs_cpu_flash
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


@needs_cpu_flash
def test_the_trainer_computes_its_targets_without_copies_of_grouped_heads(tmp_path, repeat_kv_calls):
    from test_training_data import ONE_PROCESS, data_args
    from tiny_tokenizer import char_tokenizer

    from hf_mlp_speculator.training.training_data import build_training_data

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n\n".join(f"prompt {i} of {'a longer ' * (i % 3)}run" for i in range(12)))
    base = make_verifier()
    data = build_training_data(data_args(tmp_path, prompts), base, char_tokenizer(), ONE_PROCESS)
    assert len(data.train) and len(data.eval)
    assert repeat_kv_calls == []  # its training batches are padded: each of their forwards would have copied them
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention.sdpa_attention_forward


@pytest.mark.parametrize("torch_reads_them", [False, True])
def test_before_torch_2_9_and_off_the_cpu_sdpa_stays_as_it_is(torch_reads_them, repeat_kv_calls, monkeypatch):
    monkeypatch.setattr(grouped_attention, "CPU_FLASH_TAKES_GROUPED_HEADS", torch_reads_them)
    model = make_verifier()
    model = model if not torch_reads_them else model.to("meta")
    with grouped_sdpa(model):
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention.sdpa_attention_forward
