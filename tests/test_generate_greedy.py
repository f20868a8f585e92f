"""Greedy speculative decoding is token-identical to plain greedy decoding."""


import pytest
import torch
from conftest import ARCHITECTURES, VOCAB, expected_steps, make_oracle, make_prompt, make_speculator, make_verifier
from transformers import CompileConfig, GenerationConfig
from transformers.generation.streamers import BaseStreamer

from hf_mlp_speculator.cpu import weight_layouts
from hf_mlp_speculator.generation import mixin


def greedy(model, prompt, **kwargs):
    return model.generate(prompt, do_sample=False, **kwargs)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
@pytest.mark.parametrize(
    "n_predict,tie_weights,scale_input",
    [(1, False, False), (2, True, True), (3, False, True), (4, True, False), (5, False, False)],
)
def test_greedy_equality_random_speculator(arch, n_predict, tie_weights, scale_input):
    verifier = make_verifier(arch)
    speculator = make_speculator(n_predict=n_predict, tie_weights=tie_weights, scale_input=scale_input)
    prompt = make_prompt()
    expected = greedy(verifier, prompt, max_new_tokens=24)
    assert torch.equal(greedy(verifier, prompt, max_new_tokens=24, assistant_model=speculator), expected)
    assert speculator.speculation_metrics.num_emitted_tokens == 24 - 1  # the prefill token is not a decode step


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_greedy_equality_with_partial_acceptance(arch):
    """An oracle speculator accepts 0..n_predict drafts per step, exercising every pruning offset."""
    verifier, prompt = make_verifier(arch), make_prompt()
    speculator = make_oracle(verifier, prompt, 30, n_predict=4, wrong=lambda p, h: (3 * p + h) % 4 == 0)
    expected = greedy(verifier, prompt, max_new_tokens=30)
    assert torch.equal(greedy(verifier, prompt, max_new_tokens=30, assistant_model=speculator), expected)
    assert 0 < speculator.speculation_metrics.draft_acceptance_rate < 1


def test_prompt_longer_than_2048_tokens():
    verifier, prompt = make_verifier("llama"), make_prompt(2100)
    speculator = make_oracle(verifier, prompt, 12, wrong=lambda p, h: h == 2)
    expected = greedy(verifier, prompt, max_new_tokens=12)
    assert torch.equal(greedy(verifier, prompt, max_new_tokens=12, assistant_model=speculator), expected)
    # Speculation really ran on the long prompt (vLLM once silently disabled it past 2k tokens).
    assert speculator.speculation_metrics.num_accepted_tokens > 0


@pytest.mark.parametrize("max_new_tokens", range(1, 11))
def test_max_new_tokens_is_respected(max_new_tokens):
    verifier, prompt = make_verifier(), make_prompt()
    speculator = make_oracle(verifier, prompt, max_new_tokens)  # perfect drafts: the cap must do the stopping
    expected = greedy(verifier, prompt, max_new_tokens=max_new_tokens)
    output = greedy(verifier, prompt, max_new_tokens=max_new_tokens, assistant_model=speculator)
    assert output.shape[1] == prompt.shape[1] + max_new_tokens
    assert torch.equal(output, expected)


def test_eos_inside_an_accepted_draft():
    verifier, prompt = make_verifier(), make_prompt()
    continuation = greedy(verifier, prompt, max_new_tokens=40)[0, prompt.shape[1] :].tolist()
    # An EOS that the verifier first emits at step >= 2, so that perfect drafts run through it.
    eos_step = next(i for i, token in enumerate(continuation) if i >= 2 and token not in continuation[:i])
    eos = continuation[eos_step]
    speculator = make_oracle(verifier, prompt, 40, n_predict=5)
    expected = greedy(verifier, prompt, max_new_tokens=40, eos_token_id=eos)
    output = greedy(verifier, prompt, max_new_tokens=40, eos_token_id=eos, assistant_model=speculator)
    assert torch.equal(output, expected)
    assert output[0, -1].item() == eos and output.shape[1] == prompt.shape[1] + eos_step + 1
    # The drafts that followed EOS were right, yet nothing after EOS was emitted.
    assert speculator.speculation_metrics.num_emitted_tokens == eos_step


@pytest.mark.parametrize("kwargs", [{}, {"prompt_lookup_num_tokens": 2}], ids=["speculator", "hybrid"])
def test_static_cache(kwargs):
    """A static cache (torch.compile's kind) is rewound past rejected drafts on the device: identical output, on every
    transformers release (their own assisted decoding refuses one on 5.16 and 5.17)."""
    verifier, prompt = make_verifier(), make_prompt()
    speculator = make_oracle(verifier, prompt, 20, wrong=lambda p, h: (p + h) % 3 == 0)
    expected = greedy(verifier, prompt, max_new_tokens=20, cache_implementation="static")
    output = greedy(verifier, prompt, max_new_tokens=20, cache_implementation="static", assistant_model=speculator,
                    **kwargs)  # fmt: skip
    assert torch.equal(output, expected)
    assert speculator.speculation_metrics.num_accepted_tokens > 0
    assert speculator.speculation_metrics.num_draft_tokens > speculator.speculation_metrics.num_accepted_tokens


@pytest.mark.parametrize("packing", [False, True], ids=["plain weights", "the CPU weight choice"])
def test_compiled_verifier_with_a_static_cache(packing, monkeypatch):
    """Where plain `generate()` compiles its decoding steps (a static cache and a `compile_config`), speculative
    decoding compiles its verifier's steps too (one graph per token count) and stays identical. Dynamo with its eager
    backend here: the graphs are traced as on a GPU, without the minutes of code generation. With the CPU weight
    choice on, as a CPU user who compiles has it, its hooks stay out of the graphs."""
    if packing:
        monkeypatch.setattr(mixin, "adaptive_weights", weight_layouts.adaptive_weights)
    verifier, prompt = make_verifier(), make_prompt()
    speculator = make_oracle(verifier, prompt, 20, wrong=lambda p, h: (p + h) % 3 == 0)
    config = CompileConfig(backend="eager", fullgraph=False, mode=None)
    config._compile_all_devices = True  # transformers compiles on GPUs only unless told
    kwargs = dict(max_new_tokens=20, cache_implementation="static", compile_config=config)
    expected = greedy(verifier, prompt, **kwargs)
    compiled = []
    original = type(verifier).get_compiled_call
    verifier.get_compiled_call = lambda config: compiled.append(config) or original(verifier, config)
    assert torch.equal(greedy(verifier, prompt, assistant_model=speculator, **kwargs), expected)
    assert compiled == [config] and speculator.speculation_metrics.num_accepted_tokens > 0
    assert not packing or weight_layouts.cpu_weights(verifier).agrees  # the choice was on: packing agrees here


def test_a_model_compiled_in_place_with_the_cpu_weight_choice(monkeypatch):
    """`model.compile()`: every forward, prefill too, runs compiled; the CPU weight choice's hooks stay out of it."""
    monkeypatch.setattr(mixin, "adaptive_weights", weight_layouts.adaptive_weights)
    verifier, prompt = make_verifier(), make_prompt()
    speculator = make_oracle(verifier, prompt, 16, wrong=lambda p, h: (p + h) % 3 == 0)
    expected = greedy(verifier, prompt, max_new_tokens=16)
    verifier.compile(backend="eager")
    assert torch.equal(greedy(verifier, prompt, max_new_tokens=16, assistant_model=speculator), expected)
    assert speculator.speculation_metrics.num_accepted_tokens > 0


def test_return_dict_scores_and_user_hidden_states():
    verifier, prompt = make_verifier(), make_prompt()
    speculator = make_oracle(verifier, prompt, 16, wrong=lambda p, h: h == 1)
    kwargs = dict(max_new_tokens=16, return_dict_in_generate=True, output_scores=True, output_hidden_states=True)
    expected = greedy(verifier, prompt, **kwargs)
    output = greedy(verifier, prompt, assistant_model=speculator, **kwargs)
    assert torch.equal(output.sequences, expected.sequences)
    assert len(output.scores) == len(expected.scores) == 16
    for ours, theirs in zip(output.scores, expected.scores):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    # The user's own request for every layer survives: one entry per token, each with all layers.
    num_layers = verifier.config.num_hidden_layers + 1
    assert len(output.hidden_states) == 16
    assert all(len(step) == num_layers for step in output.hidden_states)
    assert sum(step[-1].shape[1] for step in output.hidden_states) == prompt.shape[1] + 15


def test_streamer_receives_every_token_once():
    class Collect(BaseStreamer):
        def __init__(self):
            self.tokens, self.ended = [], False

        def put(self, value):
            self.tokens += value.flatten().tolist()

        def end(self):
            self.ended = True

    verifier, prompt = make_verifier(), make_prompt()
    speculator = make_oracle(verifier, prompt, 20, wrong=lambda p, h: h == 2)
    streamer = Collect()
    output = greedy(verifier, prompt, max_new_tokens=20, assistant_model=speculator, streamer=streamer)
    assert streamer.tokens == output[0].tolist() and streamer.ended


@pytest.mark.parametrize("verifier_dtype", [torch.float32, torch.bfloat16])
def test_fp16_speculator_on_other_dtype_verifier(verifier_dtype):
    verifier = make_verifier().to(verifier_dtype)
    speculator = make_speculator(n_predict=3).to(torch.float16)
    prompt = make_prompt()
    expected = greedy(verifier, prompt, max_new_tokens=16)
    assert torch.equal(greedy(verifier, prompt, max_new_tokens=16, assistant_model=speculator), expected)
    # The fp16 heads really drafted (an ignored speculator leaves no metrics).
    metrics = speculator.speculation_metrics
    assert metrics.num_emitted_tokens == 15 and metrics.num_draft_tokens >= metrics.num_steps > 0
    # Drafts made in fp16 from the other dtype's hidden state are accepted where they are right.
    oracle = make_oracle(verifier, prompt, 16, wrong=lambda p, h: h == 2)
    oracle.to(torch.float16)
    assert torch.equal(greedy(verifier, prompt, max_new_tokens=16, assistant_model=oracle), expected)
    steps = expected_steps(prompt.shape[1], 16, 3, lambda p, h: h == 2)
    assert oracle.speculation_metrics.num_accepted_tokens == sum(a for _, _, a in steps) > 0


def test_num_assistant_tokens_limits_heads():
    verifier, prompt = make_verifier(), make_prompt()
    speculator = make_oracle(verifier, prompt, 20, n_predict=4)
    greedy(verifier, prompt, max_new_tokens=20, assistant_model=speculator, num_assistant_tokens=2)
    metrics = speculator.speculation_metrics
    assert len(metrics.head_draft_tokens) == 2
    assert metrics.mean_tokens_per_step == pytest.approx(19 / metrics.num_steps)
    assert metrics.num_steps == 7  # 19 decode tokens, 3 per step with perfect drafts: ceil(19 / 3)


def test_confidence_threshold_stops_the_chain_after_an_unconfident_draft():
    """As transformers' assistants do: the draft below `assistant_confidence_threshold` is the chain's last."""
    verifier, prompt = make_verifier(), make_prompt()
    expected = greedy(verifier, prompt, max_new_tokens=20)
    # Head 1 puts its wrong token at p = 0.73 (the right one close behind); heads 0 and 2 are right at p ~ 1.
    for threshold, drafted in ((0.8, 2), (0.5, 3), (0.0, 3)):
        speculator = make_oracle(verifier, prompt, 20, wrong=lambda p, h: h == 1)
        output = greedy(verifier, prompt, max_new_tokens=20, assistant_model=speculator,
                        assistant_confidence_threshold=threshold)  # fmt: skip
        assert torch.equal(output, expected)
        metrics = speculator.speculation_metrics
        # 19 decode tokens at 2 per step; near the length limit there is room for fewer drafts.
        assert metrics.num_steps == 10 and len(metrics.head_draft_tokens) == drafted
        assert metrics.head_draft_tokens[:2] == [9, 9]
        assert metrics.head_acceptance_rates[:2] == [1.0, 0.0]

    # Unset, no threshold applies (transformers' default of 0.4 on the verifier's config is not read, as stock
    # transformers does not read it there): every head drafts (the test fixture's stand-in for the controller).
    verifier.generation_config.assistant_confidence_threshold = 0.4
    speculator = make_speculator(n_predict=3)
    assert torch.equal(greedy(verifier, prompt, max_new_tokens=20, assistant_model=speculator), expected)
    assert len(speculator.speculation_metrics.head_draft_tokens) == 3
    # Set on the speculator's generation_config, where transformers reads an assistant's: a random speculator's
    # drafts are all below it, one per step.
    speculator.generation_config = GenerationConfig(assistant_confidence_threshold=0.4)
    assert torch.equal(greedy(verifier, prompt, max_new_tokens=20, assistant_model=speculator), expected)
    metrics = speculator.speculation_metrics
    assert metrics.num_steps == 19 and metrics.head_draft_tokens == [18]  # the last step has no room for a draft


def test_pipeline_with_assistant_model():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, pipeline

    vocab = {f"w{i}": i for i in range(VOCAB)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="w1"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w1", pad_token="w0")
    verifier = make_verifier()
    speculator = make_speculator()
    generator = pipeline("text-generation", model=verifier, tokenizer=tokenizer)
    text = "w5 w17 w3 w44 w9"
    expected = generator(text, max_new_tokens=12, do_sample=False)
    output = generator(text, max_new_tokens=12, do_sample=False, assistant_model=speculator)
    assert output == expected
    assert speculator.speculation_metrics.num_steps > 0
    # The README's form: the speculator given when the pipeline is built (it has no special tokens of its own).
    speculator.speculation_metrics = None
    speculative = pipeline("text-generation", model=verifier, tokenizer=tokenizer, assistant_model=speculator)
    assert speculative(text, max_new_tokens=12, do_sample=False) == expected
    assert speculator.speculation_metrics.num_steps > 0
