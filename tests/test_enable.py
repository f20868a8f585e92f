"""The explicit, non-patching ways: enable_mlp_speculator(model) and the mixin."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from conftest import make_oracle, make_prompt, make_verifier
from transformers import GenerationMixin, LlamaForCausalLM
from transformers.generation.candidate_generator import CandidateGenerator

import hf_mlp_speculator
from hf_mlp_speculator import MLPSpeculatorGenerationMixin, enable_mlp_speculator
from hf_mlp_speculator.generation import transformers_hooks
from hf_mlp_speculator.generation.transformers_hooks import check_transformers_hooks


def test_install_patches_only_the_two_hooks_and_uninstall_restores_them():
    hf_mlp_speculator.uninstall()
    try:
        stock = transformers_hooks.STOCK
        assert all(getattr(GenerationMixin, name) is method for name, method in stock.items())
        verifier, prompt = make_verifier(), make_prompt()
        speculator = make_oracle(verifier, prompt, 12)
        expected = verifier.generate(prompt, max_new_tokens=12, do_sample=False)

        # One enabled model drafts with the speculator, while other models keep transformers' own methods.
        enable_mlp_speculator(verifier)
        output = verifier.generate(prompt, max_new_tokens=12, do_sample=False, assistant_model=speculator)
        assert torch.equal(output, expected)
        assert speculator.speculation_metrics.num_accepted_tokens > 0
        other = make_verifier()
        assert all(getattr(other, name).__func__ is method for name, method in stock.items())
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


def test_a_changed_transformers_hook_fails_at_import():
    """A transformers whose private hooks changed is refused at import, naming the tested range, not mid-generation."""
    code = (
        "from transformers import GenerationMixin\n"
        "GenerationMixin._get_candidate_generator = lambda self, generation_config, input_ids, model_kwargs: None\n"
        "import hf_mlp_speculator\n"
    )
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("ImportError: hf_mlp_speculator supports transformers>=5.13.0 as far as its private "
                                "hooks stay as they were, but transformers")  # fmt: skip
    assert "changed GenerationMixin._get_candidate_generator" in last_line
    assert last_line.endswith("Install a release it was tested on: pip install 'transformers>=5.13.0,<=5.25.0'.")


def test_a_transformers_older_than_the_range_fails_at_import(monkeypatch):
    monkeypatch.setattr(transformers, "__version__", "5.12.0")
    message = "hf_mlp_speculator supports transformers>=5.13.0, but transformers 5.12.0 is installed. Upgrade it: "
    with pytest.raises(ImportError, match=re.escape(message + "pip install 'transformers>=5.13.0'.")):
        check_transformers_hooks()


@pytest.mark.parametrize(
    "owner,name,replacement,named",
    [
        (GenerationMixin, "_sample", lambda self, input_ids, generation_config, **kwargs: None,
         "the decoding-method convention of GenerationMixin._sample"),
        (GenerationMixin, "_prepare_generation_config", lambda self, **kwargs: None,
         "GenerationMixin._prepare_generation_config"),
        (CandidateGenerator, "requires_model_outputs", None, "CandidateGenerator.requires_model_outputs"),
    ],
)  # fmt: skip
def test_each_private_hook_is_checked(monkeypatch, owner, name, replacement, named):
    if replacement is None:
        monkeypatch.delattr(owner, name)
    else:
        monkeypatch.setattr(owner, name, replacement)
    with pytest.raises(ImportError, match=rf"supports transformers>=5.13.0 as far .* changed {named}"):
        check_transformers_hooks()
