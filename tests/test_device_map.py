"""A verifier that accelerate dispatched (`device_map`), here with a layer offloaded to disk on the CPU: speculative
generate() gives plain generate()'s tokens on the same model in every mode, and timings go to the forward's device."""

from types import SimpleNamespace

import pytest
import torch
from conftest import make_prompt, make_speculator, make_verifier
from transformers import AutoModelForCausalLM

from hf_mlp_speculator import speculation_state
from hf_mlp_speculator.utils.devices import forward_device

DEVICE_MAP = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk", "model.norm": "cpu",
              "model.rotary_emb": "cpu", "lm_head": "cpu"}  # fmt: skip


@pytest.fixture(scope="module")
def dispatched(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dispatched")
    make_verifier().save_pretrained(folder / "model")
    model = AutoModelForCausalLM.from_pretrained(folder / "model", device_map=DEVICE_MAP,
                                                 offload_folder=str(folder / "offload")).eval()  # fmt: skip
    assert model.hf_device_map["model.layers.1"] == "disk" and model.model.layers[1].self_attn.q_proj.weight.is_meta
    model.generation_config.assistant_confidence_threshold = 0.0
    return model


def batch_with_an_early_end(model):
    """Two prompts, and an end-of-sequence id that the first row's greedy continuation reaches at its third token."""
    prompts = torch.cat([make_prompt(9, seed=5), make_prompt(9, seed=6)])
    plain = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=12, do_sample=False)
    return prompts, int(plain[0, 11])


MODES = {
    "chain": {},
    "tree": {"n_candidates": 3},
    "hybrid": {"prompt_lookup_num_tokens": 2},
    "num_return_sequences": {"num_return_sequences": 2, "do_sample": True, "top_k": 4},
    "sampled": {"do_sample": True, "top_k": 4},
}


@pytest.mark.parametrize("mode", list(MODES))
def test_a_dispatched_verifier_gives_plain_tokens(dispatched, mode):
    speculator = make_speculator()
    prompts, eos = batch_with_an_early_end(dispatched)
    options = dict(max_new_tokens=16, eos_token_id=eos, pad_token_id=0, attention_mask=torch.ones_like(prompts),
                   **MODES[mode])  # fmt: skip
    drafting = {k: options.pop(k) for k in ("n_candidates", "prompt_lookup_num_tokens") if k in options}
    options.setdefault("do_sample", False)
    torch.manual_seed(3)
    plain = dispatched.generate(prompts, **options)
    torch.manual_seed(3)
    speculative = dispatched.generate(prompts, assistant_model=speculator, **options, **drafting)
    if options["do_sample"]:  # keyed sampling: the same seed gives the same tokens, whatever was drafted
        torch.manual_seed(3)
        again = dispatched.generate(prompts, assistant_model=speculator, **options, **drafting)
        assert torch.equal(speculative, again) and speculative.shape[0] == plain.shape[0]
    else:
        assert torch.equal(speculative, plain)
        assert (plain[0] == eos).any() and not (plain[1, : plain.shape[1] - 4] == eos).all()  # row 0 ended early
    assert speculator.speculation_metrics.num_draft_tokens > 0


def test_a_dispatched_verifier_with_a_static_cache(dispatched):
    speculator, prompt = make_speculator(), make_prompt(9)
    plain = dispatched.generate(prompt, max_new_tokens=12, do_sample=False, cache_implementation="static")
    output = dispatched.generate(prompt, max_new_tokens=12, do_sample=False, cache_implementation="static",
                                 assistant_model=speculator)  # fmt: skip
    assert torch.equal(output, plain)


@pytest.mark.cost_aware
def test_timings_go_to_the_device_that_runs_the_forward(dispatched):
    """An offloaded layer's parameters are on the meta device; the forward runs on the CPU, and is timed there."""
    assert forward_device(dispatched) == torch.device("cpu")
    assert forward_device(make_verifier()) == torch.device("cpu")
    speculator = make_speculator()
    dispatched.generate(make_prompt(9), max_new_tokens=8, do_sample=False, assistant_model=speculator)
    costs = speculation_state(dispatched, speculator).cost_models
    assert costs and all(key[0] == "cpu" for key in costs)


def test_forward_device_is_the_one_that_runs_the_last_module_of_a_device_map():
    class Dispatched(torch.nn.Module):
        hf_device_map = {"embed": "cpu", "layers.0": 0, "layers.1": "disk", "head": "cpu"}

    # Modules mapped to the CPU or disk run on accelerate's main device, by default the map's first accelerator.
    assert forward_device(Dispatched()) == torch.device("cuda", 0)
    Dispatched.hf_device_map = {"embed": "cpu", "layers.0": "cuda:0", "layers.1": "cuda:1", "head": "cuda:1"}
    assert forward_device(Dispatched()) == torch.device("cuda:1")
    Dispatched.hf_device_map = {"embed": "cuda:1", "layers.0": "cuda:1", "layers.1": "cuda:0", "head": "cuda:0"}
    assert forward_device(Dispatched()) == torch.device("cuda:0")
    # dispatch_model(..., main_device="cpu"): the model's own hook runs the CPU's modules on the CPU, after the GPU's.
    split = Dispatched()
    split.hf_device_map = {"embed": 0, "layers.0": 0, "layers.1": "cpu", "head": "cpu"}
    split._hf_hook = SimpleNamespace(execution_device="cpu")
    assert forward_device(split) == torch.device("cpu")
