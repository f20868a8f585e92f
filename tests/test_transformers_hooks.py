"""Each private transformers touchpoint (`generation/transformers_hooks.py`) does what the package relies on, tested by
its behaviour on the installed transformers: CI runs this file on every supported release, so that a release that
changes one fails here, by name, rather than in a user's call."""

import copy

import pytest
import torch
from conftest import ARCHITECTURES, make_prompt, make_verifier
from transformers import CompileConfig, DynamicCache, GenerationConfig, GenerationMixin, StaticCache
from transformers.generation.candidate_generator import CandidateGenerator

from hf_mlp_speculator.generation import transformers_hooks as hooks


def prefilled(verifier, prompt, cache=None):
    """A forward over `prompt` into `cache` (a new DynamicCache if None), passed under the forward's own name."""
    cache = DynamicCache(config=verifier.config) if cache is None else cache
    with torch.no_grad():
        outputs = verifier(prompt, use_cache=True, **hooks.cache_kwargs(verifier, cache))
    return outputs, cache


def test_forwards_take_and_return_the_cache_under_the_names_used():
    verifier, prompt = make_verifier(), make_prompt(8)
    outputs, cache = prefilled(verifier, prompt)
    assert cache.get_seq_length() == 8  # the forward wrote into the cache it was given
    assert hooks.output_cache(outputs) is cache


def test_generate_hands_custom_generate_its_cache_and_returns_it_under_the_field_used():
    verifier, prompt = make_verifier(), make_prompt(6)
    seen = {}

    def custom(model, input_ids, logits_processor, stopping_criteria, generation_config, **model_kwargs):
        seen["cache"] = hooks.pop_prepared_cache(model_kwargs)
        return input_ids

    cache = DynamicCache(config=verifier.config)
    verifier.generate(prompt, max_new_tokens=2, custom_generate=custom, **hooks.cache_kwargs(verifier, cache))
    assert seen["cache"] is cache
    output = verifier.generate(prompt, max_new_tokens=2, do_sample=False, return_dict_in_generate=True)
    assert getattr(output, hooks.GENERATE_OUTPUT_CACHE).get_seq_length() == prompt.shape[1] + 1


def test_the_overridden_generation_methods_are_transformers_own():
    assert hooks.STOCK["generate"].__qualname__ == "GenerationMixin.generate"
    assert hooks.STOCK["_get_candidate_generator"].__qualname__ == "GenerationMixin._get_candidate_generator"
    assert CandidateGenerator.requires_model_outputs is False  # the protocol the candidate generator turns on
    hooks.check_transformers_hooks()


@pytest.mark.parametrize("count", [0, 1, 3])
def test_dropping_the_last_slots_of_a_dynamic_cache(count):
    """`crop(-n)` forgets the last n slots and keeps the others as they were; 0 forgets nothing (crop(0) would empty
    the cache on 5.13)."""
    verifier, prompt = make_verifier(), make_prompt(10)
    _, cache = prefilled(verifier, prompt)
    keys = cache.layers[0].keys.clone()
    hooks.drop_last_slots(cache, count)
    assert cache.get_seq_length() == 10 - count
    assert torch.equal(cache.layers[0].keys, keys[:, :, : 10 - count])


def test_a_static_cache_rewound_without_reading_the_device_is_written_over():
    """Lowering `StaticLayer.cumulative_length` makes the next forward write over the dropped slots: its logits are
    those of a cache that never held them."""
    verifier, prompt = make_verifier(), make_prompt(10)
    static = StaticCache(config=verifier.config, max_cache_len=32)
    assert hooks.cache_kind(static) == "static" and hooks.cache_kind(DynamicCache()) == "dynamic"
    prefilled(verifier, prompt, static)
    hooks.drop_last_slots(static, 3)
    assert int(static.get_seq_length()) == 7
    fresh_outputs, _ = prefilled(verifier, prompt[:, :7])
    fresh = fresh_outputs.logits
    with torch.no_grad():
        rewound = verifier(prompt[:, 7:9], position_ids=torch.tensor([[7, 8]]), use_cache=True,
                           **hooks.cache_kwargs(verifier, static)).logits  # fmt: skip
        expected = verifier(prompt[:, :9]).logits[:, 7:9]
    assert fresh.shape[1] == 7
    torch.testing.assert_close(rewound, expected, rtol=1e-4, atol=1e-5)


def test_gathering_slots_moves_each_rows_keys_and_values():
    verifier = make_verifier()
    _, cache = prefilled(verifier, torch.randint(1, 90, (2, 6)))
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    order = torch.tensor([[5, 0, 2], [1, 1, 4]])
    assert hooks.can_gather_slots(cache)
    hooks.gather_slots(cache, order)
    for layer, (keys, values) in zip(cache.layers, before):
        for row in range(2):
            assert torch.equal(layer.keys[row], keys[row][:, order[row]])
            assert torch.equal(layer.values[row], values[row][:, order[row]])


def test_selecting_rows_hands_each_layer_the_index_on_its_own_device():
    """A model dispatched over devices keeps each layer's cache on that layer's device. Here every other layer reports
    the meta device, and records the index it gets (then selects on the CPU, where its tensors really are)."""
    verifier = make_verifier()
    _, cache = prefilled(verifier, torch.randint(1, 90, (3, 5)))
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    seen, index = [], torch.tensor([2, 0])
    for number, layer in enumerate(cache.layers):
        if number % 2:
            layer.device = torch.device("meta")
        select = layer.batch_select_indices

        def recording(given, select=select, layer=layer):
            seen.append((given.device, layer.device))
            select(index)  # where the tensors really are

        layer.batch_select_indices = recording
    hooks.select_rows(cache, index)
    assert len(seen) == len(cache.layers) and all(index == own for index, own in seen)
    assert {own.type for _, own in seen} == {"cpu", "meta"}
    for layer, (keys, values) in zip(cache.layers, before):
        assert torch.equal(layer.keys, keys[[2, 0]]) and torch.equal(layer.values, values[[2, 0]])


def sliding_verifier(window=8):
    verifier = ARCHITECTURES["mistral"]()
    verifier.config.sliding_window = window
    return verifier.eval()


def test_sliding_layers_are_seen_and_copied_into_plain_layers():
    verifier = sliding_verifier()
    _, cache = prefilled(verifier, make_prompt(6))
    assert hooks.has_sliding_layers(cache) and not hooks.has_sliding_layers(DynamicCache())
    assert hooks.holds_every_token(cache)
    plain = hooks.every_slot_copy(cache)
    assert not hooks.has_sliding_layers(plain) and plain.get_seq_length() == 6
    assert torch.equal(plain.layers[0].keys, cache.layers[0].keys)
    _, past = prefilled(sliding_verifier(), make_prompt(12))  # past the window of 8
    assert not hooks.holds_every_token(past)


def test_sliding_layers_can_be_cropped_where_the_flag_says():
    """`REWINDS_SLIDING_LAYERS`: whether a sliding layer past its window can be rewound once told to keep what it drops
    (as transformers' assisted decoding tells it); where not, it refuses, and calls that need it get plain layers."""
    verifier = sliding_verifier()
    cache = DynamicCache(config=verifier.config)
    if hooks.REWINDS_SLIDING_LAYERS:
        cache.activate_past_recording()
    prefilled(verifier, make_prompt(12), cache)  # past the window of 8
    if hooks.REWINDS_SLIDING_LAYERS:
        cache.crop(-2)
        assert cache.get_seq_length() == 10
    else:
        with pytest.raises(Exception):
            cache.crop(-2)


def test_decoding_steps_compile_where_plain_generate_would():
    verifier = make_verifier()
    config = GenerationConfig(compile_config=CompileConfig(backend="eager"))
    config.compile_config._compile_all_devices = True  # transformers compiles on GPUs only unless told
    static = StaticCache(config=verifier.config, max_cache_len=16)
    assert hooks.compiled_call(verifier, DynamicCache(), config) is verifier
    compiled = hooks.compiled_call(verifier, static, config)
    assert compiled is not verifier and callable(compiled)
    assert hooks.compiled_call(verifier, static, GenerationConfig()) is verifier  # on a CPU, as plain generate()


def test_a_copied_cache_is_independent():
    """Callers copy caches with `copy.deepcopy` (a prefix cache reused); the rewinds above must not reach the copy."""
    verifier = make_verifier()
    _, cache = prefilled(verifier, make_prompt(8))
    kept = copy.deepcopy(cache)
    hooks.drop_last_slots(cache, 4)
    assert kept.get_seq_length() == 8


def test_candidate_generators_get_the_keywords_and_outputs_they_draft_from():
    """transformers' assisted decoding calls `get_candidates` with the verifier's outputs and the last round's matches
    under these names (the candidate generator has no defaults for them, so a rename fails loudly), and
    `update_candidate_strategy` after each verifier forward."""
    verifier, prompt = make_verifier(), make_prompt(6)
    calls = []

    class Recorder(CandidateGenerator):
        requires_model_outputs = True
        num_drafting_tokens = 1  # 5.25 sizes its cache rollback by it
        model_kwargs_overrides = {}  # 5.17 on: extra arguments of the verifier's forward

        def get_candidates(self, input_ids, *, model_outputs, is_first_iteration, n_last_matches, **kwargs):
            calls.append((is_first_iteration, n_last_matches, model_outputs is not None))
            return input_ids, None

        def update_candidate_strategy(self, input_ids, scores, num_matches):
            calls.append("update")

    original = GenerationMixin._get_candidate_generator
    try:
        GenerationMixin._get_candidate_generator = lambda self, *args, **kwargs: Recorder()
        verifier.generate(prompt, max_new_tokens=3, do_sample=False, assistant_model=make_verifier(seed=1))
    finally:
        GenerationMixin._get_candidate_generator = original
    assert calls[0] == (True, 0, False) and calls[1] == "update"
    assert calls[2][0] is False and calls[2][2] and calls[3] == "update"
