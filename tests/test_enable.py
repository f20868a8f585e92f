"""The explicit, non-patching ways: enable_mlp_speculator(model) and the mixin."""

import torch
from conftest import make_oracle, make_prompt, make_verifier
from transformers import GenerationMixin, LlamaForCausalLM

import hf_mlp_speculator
from hf_mlp_speculator import MLPSpeculatorGenerationMixin, enable_mlp_speculator


def test_install_patches_only_the_two_hooks_and_uninstall_restores_them():
    hf_mlp_speculator.uninstall()
    try:
        assert GenerationMixin.generate is hf_mlp_speculator.generation._STOCK["generate"]
        verifier, prompt = make_verifier(), make_prompt()
        speculator = make_oracle(verifier, prompt, 12)
        expected = verifier.generate(prompt, max_new_tokens=12, do_sample=False)

        # Unpatched transformers cannot use the speculator at all ...
        try:
            verifier.generate(prompt, max_new_tokens=12, assistant_model=speculator)
            raise AssertionError("stock transformers accepted an MLPSpeculator")
        except AttributeError:
            pass

        # ... while one enabled model can, and others stay untouched.
        enable_mlp_speculator(verifier)
        output = verifier.generate(prompt, max_new_tokens=12, do_sample=False, assistant_model=speculator)
        assert torch.equal(output, expected)
        assert speculator.speculation_metrics.num_accepted_tokens > 0
        assert "generate" not in make_verifier().__dict__
    finally:
        hf_mlp_speculator.install()
    assert GenerationMixin.generate is MLPSpeculatorGenerationMixin.generate


def test_mixin_on_a_model_class():
    class SpeculativeLlama(MLPSpeculatorGenerationMixin, LlamaForCausalLM):
        pass

    hf_mlp_speculator.uninstall()
    try:
        verifier = make_verifier()
        model = SpeculativeLlama(verifier.config).eval()
        model.load_state_dict(verifier.state_dict())
        prompt = make_prompt()
        speculator = make_oracle(model, prompt, 12, wrong=lambda p, h: h == 1)
        expected = model.generate(prompt, max_new_tokens=12, do_sample=False)
        assert torch.equal(model.generate(prompt, max_new_tokens=12, do_sample=False, assistant_model=speculator),
                           expected)  # fmt: skip
        assert speculator.speculation_metrics.num_accepted_tokens > 0
    finally:
        hf_mlp_speculator.install()
