"""`export` writes what each engine loads unchanged: checked with the engines' loading rules written out here
(ArcticInference's architecture checks, prefix stripping and LSTM projection fusing; vLLM V0's and TGI's fields)."""

import json

import pytest
import torch
from conftest import HIDDEN, VOCAB, make_speculator, make_verifier
from safetensors.torch import load_file
from test_arctic_lstm import GATES, make_lstm_speculator

from hf_mlp_speculator import MLPSpeculatorPreTrainedModel, export_speculator
from hf_mlp_speculator.cli import main

ARCTIC = {"ArcticMLPSpeculatorPreTrainedModel", "ArcticLSTMSpeculatorPreTrainedModel"}


def read_weights(folder):
    files = sorted(folder.glob("*.safetensors"))
    if files:
        return {k: v for f in files for k, v in load_file(f).items()}
    return torch.load(folder / "pytorch_model.bin", weights_only=True)


def arctic_inference_reads(folder):
    """The config and parameters ArcticInference's loader makes of `folder` (its rules, not its code)."""
    config = json.loads((folder / "config.json").read_text())
    architectures = config["architectures"]
    assert isinstance(architectures, list) and len(architectures) == 1 and architectures[0] in ARCTIC
    assert isinstance(config["base_model_archs"], list)
    weights = read_weights(folder)
    if architectures[0] == "ArcticLSTMSpeculatorPreTrainedModel":
        assert config["method"] == "sum_lstm" and config["tie_lstm_embs"] and config["tie_weights"]
        for gate in GATES[1:]:
            weights.pop(f"{gate}_emb.0.weight", None)
        for j in (0, 1):  # popped by unprefixed names: a prefixed LSTM would fail here, as in the engine
            weights[f"projs.{j}.weight"] = torch.cat([weights.pop(f"{gate}_proj.{j}.weight") for gate in GATES])
    return config, {name.replace("speculator.", ""): tensor for name, tensor in weights.items()}


def test_an_lstm_for_arctic_inference(tmp_path):
    speculator = make_lstm_speculator()
    speculator.config.base_model_name_or_path = "meta-llama/Llama-3.1-8B-Instruct"
    export_speculator(speculator, tmp_path, "arctic", base_model_arch="LlamaForCausalLM")
    config, weights = arctic_inference_reads(tmp_path)
    assert config["architectures"] == ["ArcticLSTMSpeculatorPreTrainedModel"]
    assert config["base_model_archs"] == ["LlamaForCausalLM"]
    assert (config["input_hidden_dim"], config["emb_dim"], config["inner_dim"], config["proj_dim"]) == (
        HIDDEN, "32", "32", "32")  # fmt: skip
    heads = speculator.speculator
    for j in (0, 1):
        fused = torch.cat([getattr(heads, f"{gate}_proj")[j].weight for gate in ("forget", "input", "output", "cell")])
        assert torch.equal(weights[f"projs.{j}.weight"], fused)
    assert torch.equal(weights["forget_emb.0.weight"], heads.forget_emb[0].weight)
    assert torch.equal(weights["head.0.weight"], heads.head[0].weight)
    assert torch.equal(weights["state_ln.0.bias"], heads.state_ln[0].bias)
    again = MLPSpeculatorPreTrainedModel.from_pretrained(tmp_path)
    hidden, ids = torch.randn(2, 4, HIDDEN), torch.randint(VOCAB, (2, 7))
    assert torch.equal(again(hidden, ids).logits, speculator(hidden, ids).logits)


@pytest.mark.parametrize("tie_weights", [False, True])
def test_an_mlp_for_arctic_inference(tmp_path, tie_weights):
    speculator = make_speculator(tie_weights=tie_weights, inner_dim=0)
    export_speculator(speculator, tmp_path, "arctic", base_model_arch="Qwen2ForCausalLM")
    config, weights = arctic_inference_reads(tmp_path)
    assert config["architectures"] == ["ArcticMLPSpeculatorPreTrainedModel"]
    assert config["base_model_archs"] == ["Qwen2ForCausalLM"] and config["inner_dim"] == HIDDEN
    for name, tensor in speculator.speculator.state_dict().items():
        if name in weights:
            assert torch.equal(weights[name], tensor), name
    assert {"emb.0.weight", "proj.0.weight", "proj.1.weight", "head.0.weight", "ln.0.weight"} <= set(weights)


def test_vllm_and_tgi_get_the_published_layout_with_the_whole_vocabulary(tmp_path):
    speculator = make_speculator(inner_dim=0, draft_vocab_size=40, base_model_name_or_path="tiny/llama")
    export_speculator(speculator, tmp_path, "vllm")
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["MLPSpeculatorPreTrainedModel"]
    assert len(config["top_k_tokens_per_head"]) == config["n_predict"] == 3
    assert config["inner_dim"] == HIDDEN and config["base_model_name_or_path"] == "tiny/llama"
    assert "draft_vocab_size" not in config
    weights = load_file(tmp_path / "model.safetensors")
    assert all(name.startswith("speculator.") for name in weights) and "speculator.draft_vocab" not in weights
    assert weights["speculator.head.0.weight"].shape == (VOCAB, HIDDEN)
    again = MLPSpeculatorPreTrainedModel.from_pretrained(tmp_path)
    hidden, ids = torch.randn(1, 3, HIDDEN), torch.randint(VOCAB, (1, 6))
    drafts = speculator.speculator.draft_vocab
    torch.testing.assert_close(again(hidden, ids).logits[..., drafts], speculator(hidden, ids).logits)


def test_the_verifier_architecture_is_read_from_base_model_name_or_path(tmp_path):
    base = make_verifier().config
    base.architectures = ["LlamaForCausalLM"]
    base.save_pretrained(tmp_path / "base")
    speculator = make_lstm_speculator()
    speculator.config.base_model_name_or_path = str(tmp_path / "base")
    export_speculator(speculator, tmp_path / "out", "arctic")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["base_model_archs"] == ["LlamaForCausalLM"]


def run_cli(*argv, capsys):
    capsys.readouterr()
    status = main(["export", *map(str, argv)])
    return status, capsys.readouterr()


def test_the_command_line(tmp_path, capsys):
    lstm = make_lstm_speculator()
    lstm.save_pretrained(tmp_path / "lstm")
    status, out = run_cli(tmp_path / "lstm", tmp_path / "v", "--engine", "vllm", capsys=capsys)
    assert status == 2 and out.err == (
        "hf-mlp-speculator export: error: vLLM V0 and TGI run MLP speculators only, and this is an LSTM one: export "
        "it with --engine arctic for ArcticInference.\n"
    )
    status, out = run_cli(tmp_path / "lstm", tmp_path / "a", "--engine", "arctic", capsys=capsys)
    assert status == 2 and out.err.count("\n") == 1
    assert "no base_model_name_or_path to read it from: pass --base-model-arch" in out.err
    status, out = run_cli(tmp_path / "lstm", tmp_path / "a", "--engine", "arctic", "--base-model-arch",
                          "LlamaForCausalLM", capsys=capsys)  # fmt: skip
    assert status == 0 and out.out == f"Wrote the LSTM speculator for arctic to {tmp_path / 'a'}\n"
    make_speculator().save_pretrained(tmp_path / "mlp")
    status, out = run_cli(tmp_path / "mlp", tmp_path / "m", "--engine", "vllm", capsys=capsys)
    assert status == 2 and "which this speculator's config lacks: pass --base-model" in out.err
    status, out = run_cli(tmp_path / "mlp", tmp_path / "m", "--engine", "vllm", "--base-model", "tiny/llama",
                          capsys=capsys)  # fmt: skip
    assert status == 0
    assert json.loads((tmp_path / "m" / "config.json").read_text())["base_model_name_or_path"] == "tiny/llama"
