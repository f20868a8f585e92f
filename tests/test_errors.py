"""Mistakes users make get a ValueError that names the problem and the fix."""

import pytest
import torch
from conftest import HIDDEN, VOCAB, make_prompt, make_speculator, make_verifier
from huggingface_hub.errors import StrictDataclassClassValidationError
from transformers import GenerationConfig

from hf_mlp_speculator import MLPSpeculatorConfig, MLPSpeculatorPreTrainedModel


@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(n_predict=0, top_k_tokens_per_head=[]), r"n_predict must be >= 1, got 0"),
        (dict(n_predict=3, top_k_tokens_per_head=[5, 4]), r"has 2 entries but n_predict is 3"),
        (dict(n_predict=1, top_k_tokens_per_head=[5], tie_weights=True), r"tie_weights=True needs n_predict > 1"),
        (dict(vocab_size=0), r"vocab_size must be positive, got 0"),
        (dict(emb_dim=-4), r"emb_dim must be positive, got -4"),
        (dict(inner_dim=-1), r"inner_dim must be >= 0 \(0 means emb_dim\), got -1"),
        (dict(top_k_tokens_per_head=[5, 0, 3]), r"must hold positive values"),
    ],
)
def test_malformed_config(fields, message):
    # transformers 5 configs report validation failures as StrictDataclassClassValidationError, carrying our message.
    with pytest.raises(StrictDataclassClassValidationError, match=message):
        MLPSpeculatorConfig(**fields)


def test_config_defaults_and_alias():
    config = MLPSpeculatorConfig()
    assert (config.vocab_size, config.emb_dim, config.inner_dim, config.n_predict) == (32000, 4096, 0, 3)
    assert config.top_k_tokens_per_head == [5, 4, 3] and config.n_candidates == 5
    assert not config.tie_weights and not config.scale_input and config.base_model_name_or_path is None
    assert config.hidden_size == 4096 and config.speculator_inner_dim == 4096
    assert MLPSpeculatorConfig(hidden_size=768, inner_dim=1024).emb_dim == 768


@pytest.mark.parametrize("n_predict,top_k", [(1, [5]), (2, [5, 4]), (4, [5, 4, 3, 2]), (6, [5, 4, 3, 2, 2, 2])])
def test_default_branching_follows_n_predict(n_predict, top_k):
    config = MLPSpeculatorConfig(n_predict=n_predict)
    assert config.top_k_tokens_per_head == top_k
    # and survives a save and load as it is
    assert MLPSpeculatorConfig.from_dict(config.to_dict()).top_k_tokens_per_head == top_k


def test_hidden_size_mismatch_names_both_numbers():
    speculator = make_speculator()
    speculator.config.emb_dim = 32
    speculator.config.base_model_name_or_path = "some/other-model"
    with pytest.raises(ValueError, match=r"emb_dim is 32 but the model's hidden_size is 64.*some/other-model"):
        make_verifier().generate(make_prompt(), max_new_tokens=4, assistant_model=speculator)


def test_vocab_mismatch_names_both_numbers_and_the_padding_fix():
    speculator = make_speculator()
    speculator.resize_vocab(VOCAB + 32)
    with pytest.raises(ValueError, match=rf"vocab_size is {VOCAB + 32} but the model's vocab_size is {VOCAB}"):
        make_verifier().generate(make_prompt(), max_new_tokens=4, assistant_model=speculator)
    small = make_speculator()
    small.config.vocab_size = VOCAB - 16
    with pytest.raises(ValueError, match=rf"speculator.resize_vocab\({VOCAB}\)"):
        make_verifier().generate(make_prompt(), max_new_tokens=4, assistant_model=small)


def test_resize_vocab_pads_losslessly():
    """A speculator for a padded verifier vocabulary: pad it, and greedy output stays identical."""
    real = VOCAB - 8
    speculator = make_speculator(vocab_size=real)
    original = speculator.speculator.head[0].weight.clone()
    speculator.resize_vocab(VOCAB)
    heads = speculator.speculator
    assert heads.emb[0].weight.shape == (VOCAB, 48) and not heads.emb[0].weight[real:].any()
    assert torch.equal(heads.head[0].weight, original)  # the heads still score the real ids only
    assert torch.equal(heads.draft_vocab, torch.arange(real))
    verifier, prompt = make_verifier(), make_prompt()
    expected = verifier.generate(prompt, max_new_tokens=12, do_sample=False)
    assert torch.equal(
        verifier.generate(prompt, max_new_tokens=12, do_sample=False, assistant_model=speculator), expected
    )
    with pytest.raises(ValueError, match="only pads"):
        speculator.resize_vocab(10)


def test_resize_vocab_keeps_ties_and_never_drafts_a_padded_id(tmp_path):
    """Padded ids must never win the argmax nor get sampling mass, even when every real logit is negative."""
    real = VOCAB - 8
    speculator = make_speculator(tie_weights=True, vocab_size=real)
    speculator.resize_vocab(VOCAB)
    heads = speculator.speculator
    for modules in (heads.emb, heads.head):
        assert all(module.weight is modules[0].weight for module in modules)
    assert not heads.emb[0].weight[real:].any()

    hidden, token = torch.randn(3, HIDDEN), torch.tensor([4, 5, 6])
    with torch.no_grad():
        state, _ = heads.step(0, heads.input_state(hidden), token)
        # Real head rows pointing away from this state: every real logit of the next head is negative.
        heads.head[1].weight[:real] = -state.mean(0) - 1.0
        _, logits = heads.step(1, state, token)
    assert (logits[:, :real] < 0).all()
    assert (logits.argmax(-1) < real).all()
    assert (logits.softmax(-1)[:, real:] == 0).all()
    assert (logits[:, real:] == torch.finfo(logits.dtype).min).all()

    # The padding survives saving and loading.
    speculator.save_pretrained(tmp_path)
    loaded = MLPSpeculatorPreTrainedModel.from_pretrained(tmp_path)
    assert loaded.config.draft_vocab_size == real and loaded.speculator.head[2].weight is loaded.speculator.head[0].weight
    with torch.no_grad():
        _, reloaded = loaded.speculator.step(1, state, token)
    torch.testing.assert_close(reloaded, logits)


def test_batch_of_inputs_embeds():
    verifier, prompts = make_verifier(), torch.cat([make_prompt(seed=1), make_prompt(seed=2)])
    embeds = verifier.get_input_embeddings()(prompts)
    with pytest.raises(ValueError, match=r"needs the batch as input_ids .* a batch of 2 came as inputs_embeds"):
        verifier.generate(inputs_embeds=embeds, attention_mask=torch.ones_like(prompts), max_new_tokens=4,
                          assistant_model=make_speculator())  # fmt: skip


def test_beam_search():
    """Refused wherever num_beams comes from: kwargs, a positional or keyword generation config, the model's."""
    verifier, prompt, speculator = make_verifier(), make_prompt(), make_speculator()
    refused = r"Beam search \(num_beams=3\) cannot use an MLPSpeculator"
    with pytest.raises(ValueError, match=refused):
        verifier.generate(prompt, max_new_tokens=4, num_beams=3, assistant_model=speculator)
    with pytest.raises(ValueError, match=refused):
        verifier.generate(prompt, GenerationConfig(num_beams=3, max_new_tokens=4), assistant_model=speculator)
    with pytest.raises(ValueError, match=refused):
        verifier.generate(prompt, generation_config=GenerationConfig(num_beams=3, max_new_tokens=4),
                          assistant_model=speculator)  # fmt: skip
    verifier.generation_config.num_beams = 3
    with pytest.raises(ValueError, match=refused):
        verifier.generate(prompt, max_new_tokens=4, assistant_model=speculator)
    # A call's own num_beams=1 overrides the model's default.
    expected = verifier.generate(prompt, max_new_tokens=4, num_beams=1)
    assert torch.equal(verifier.generate(prompt, max_new_tokens=4, num_beams=1, assistant_model=speculator), expected)


def test_training_forward_checks_input_length():
    speculator = make_speculator(n_predict=3)
    with pytest.raises(ValueError, match=r"sequence_length \+ n_predict = 8 tokens per row"):
        speculator(hidden_states=torch.zeros(1, 5, HIDDEN), input_ids=torch.zeros(1, 5, dtype=torch.long))


def test_encoder_decoder_base_is_refused():
    from transformers import T5Config, T5ForConditionalGeneration

    t5 = T5ForConditionalGeneration(T5Config(d_model=HIDDEN, d_ff=128, num_layers=1, num_heads=2, d_kv=32,
                                             vocab_size=VOCAB, decoder_start_token_id=0, pad_token_id=0,
                                             eos_token_id=1)).eval()  # fmt: skip
    with pytest.raises(ValueError, match="T5ForConditionalGeneration is an encoder-decoder model"):
        t5.generate(make_prompt(), max_new_tokens=4, assistant_model=make_speculator())


def test_speculator_on_the_meta_device_is_refused():
    with torch.device("meta"):
        speculator = make_speculator()
    with pytest.raises(ValueError, match=r"weights are on the meta device \(e.g. speculator.emb.0.weight\)"):
        make_verifier().generate(make_prompt(), max_new_tokens=4, assistant_model=speculator)


@pytest.mark.parametrize("num_assistant_tokens", [0, -1])
@pytest.mark.parametrize("batch", [1, 2])
def test_num_assistant_tokens_below_one_is_refused(num_assistant_tokens, batch):
    """0 would silently mean all heads, and a negative count would silently turn drafting off."""
    prompt = make_prompt().repeat(batch, 1)
    refused = rf"num_assistant_tokens={num_assistant_tokens}: .* between 1 and n_predict=3"
    with pytest.raises(ValueError, match=refused):
        make_verifier().generate(prompt, max_new_tokens=4, num_assistant_tokens=num_assistant_tokens,
                                 assistant_model=make_speculator())  # fmt: skip
