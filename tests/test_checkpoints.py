"""Published checkpoint layouts load through AutoModel, compute the reference math, and save back unchanged."""

import json
import math

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModel

from hf_mlp_speculator import MLPSpeculatorPreTrainedModel


def published_state_dict(emb_dim, inner_dim, n_predict, vocab, tied, dtype=torch.float16, seed=0):
    """Random weights under exactly the keys (and only the keys) a published checkpoint stores."""
    generator = torch.Generator().manual_seed(seed)
    heads = range(1) if tied else range(n_predict)
    projs = range(2) if tied else range(n_predict)

    def rand(*shape, scale=1 / math.sqrt(inner_dim)):
        return (torch.randn(*shape, generator=generator) * scale).to(dtype)

    state = {}
    for i in heads:
        state[f"speculator.emb.{i}.weight"] = rand(vocab, inner_dim)
        state[f"speculator.head.{i}.weight"] = rand(vocab, inner_dim)
        state[f"speculator.ln.{i}.weight"] = (1 + rand(inner_dim, scale=0.1)).to(dtype)
        state[f"speculator.ln.{i}.bias"] = rand(inner_dim, scale=0.1)
    for i in projs:
        state[f"speculator.proj.{i}.weight"] = rand(inner_dim, emb_dim if i == 0 else inner_dim)
    return state


def write_published(folder, config, state, shards=1):
    """Writes config.json and the weights the way the ibm-fms repositories do (fp16, optionally sharded)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    keys = sorted(state)
    if shards == 1:
        save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
        return folder
    weight_map = {}
    for shard in range(shards):
        name = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: state[k] for k in keys[shard::shards]}
        save_file(part, folder / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def reference_logits(state, config, hidden, tokens):
    """The MLPSpeculator math written out from the checkpoint tensors, independently of the package's modules."""
    n, inner = config["n_predict"], config["inner_dim"] or config["emb_dim"]
    tied, positions = config.get("tie_weights", False), hidden.shape[1]
    w = {k: v.double() for k, v in state.items()}
    state_weight = 0.5 ** (0.5 / n)
    emb_weight = math.sqrt((1 - state_weight**2) * inner / 2)
    s = hidden.double()
    if config.get("scale_input", False):
        s = s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) / math.sqrt(2)
    out = []
    for i in range(n):
        k, p = (0, min(i, 1)) if tied else (i, i)
        z = w[f"speculator.emb.{k}.weight"][tokens[:, i : i + positions]]
        s = s @ w[f"speculator.proj.{p}.weight"].T + (emb_weight / state_weight) * z
        s = s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6)
        s = s * w[f"speculator.ln.{k}.weight"] + w[f"speculator.ln.{k}.bias"]
        s = 0.5 * s * (1 + torch.erf(s / math.sqrt(2)))
        out.append(s @ w[f"speculator.head.{k}.weight"].T)
    return torch.stack(out)


LAYOUTS = {
    # ibm-fms/llama-160m-accelerator: its exact shapes; old config without tie_weights/scale_input fields.
    "llama-160m": dict(emb_dim=768, inner_dim=1024, n_predict=3, top_k_tokens_per_head=[5, 3, 2], vocab_size=32000),
    # ibm-fms/llama2-70b-accelerator, scaled down: tied (only unique tensors stored) with scale_input.
    "llama2-70b-small": dict(
        emb_dim=64,
        inner_dim=64,
        n_predict=4,
        top_k_tokens_per_head=[4, 3, 2, 2],
        vocab_size=500,
        tie_weights=True,
        scale_input=True,
    ),  # fmt: skip
    # granite-style, inner_dim 0 (= emb_dim), five heads, sharded with an index.
    "granite-sharded": dict(
        emb_dim=48,
        inner_dim=0,
        n_predict=5,
        top_k_tokens_per_head=[4, 3, 2, 2, 2],
        vocab_size=300,
        tie_weights=False,
        scale_input=False,
    ),  # fmt: skip
}


def published_config(layout):
    fields = LAYOUTS[layout]
    config = {"architectures": ["MLPSpeculatorPreTrainedModel"], "model_type": "mlp_speculator", "n_candidates": 5,
              "torch_dtype": "float16", "transformers_version": "4.38.2", **fields}  # fmt: skip
    return config


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_published_layout_loads_and_matches_reference(tmp_path, layout):
    config = published_config(layout)
    state = published_state_dict(config["emb_dim"], config["inner_dim"] or config["emb_dim"], config["n_predict"],
                                 config["vocab_size"], config.get("tie_weights", False))  # fmt: skip
    folder = write_published(tmp_path / layout, config, state, shards=3 if "sharded" in layout else 1)

    model = AutoModel.from_pretrained(folder, dtype=torch.float32)
    assert isinstance(model, MLPSpeculatorPreTrainedModel)
    assert model.config.hidden_size == config["emb_dim"]
    loaded = model.state_dict()
    for key, tensor in state.items():
        assert torch.equal(loaded[key], tensor.float()), key

    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 5, config["emb_dim"], generator=generator)
    tokens = torch.randint(0, config["vocab_size"], (2, 5 + config["n_predict"]), generator=generator)
    with torch.no_grad():
        logits = model(hidden_states=hidden, input_ids=tokens).logits
    expected = reference_logits(state, config, hidden, tokens)
    torch.testing.assert_close(logits.double(), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_save_writes_the_published_keys_and_round_trips(tmp_path, layout):
    config = published_config(layout)
    state = published_state_dict(config["emb_dim"], config["inner_dim"] or config["emb_dim"], config["n_predict"],
                                 config["vocab_size"], config.get("tie_weights", False))  # fmt: skip
    model = AutoModel.from_pretrained(write_published(tmp_path / "in", config, state), dtype=torch.float16)
    model.save_pretrained(tmp_path / "out")

    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as f:
        saved = {k: f.get_tensor(k) for k in f.keys()}
    assert sorted(saved) == sorted(state)  # tied checkpoints keep only the unique tensors, as vLLM/TGI expect
    assert all(torch.equal(saved[k], state[k]) for k in state)
    saved_config = json.loads((tmp_path / "out" / "config.json").read_text())
    for field in ("vocab_size", "emb_dim", "inner_dim", "n_predict", "top_k_tokens_per_head", "n_candidates"):
        assert saved_config[field] == config[field]
    assert saved_config["model_type"] == "mlp_speculator"
    assert saved_config["architectures"] == ["MLPSpeculatorPreTrainedModel"]

    reloaded = AutoModel.from_pretrained(tmp_path / "out")
    assert reloaded.dtype == torch.float16
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reloaded.state_dict().values()))
    if config.get("tie_weights"):
        assert reloaded.speculator.head[3].weight is reloaded.speculator.head[0].weight
        assert reloaded.speculator.proj[3].weight is reloaded.speculator.proj[1].weight
        assert reloaded.speculator.proj[1].weight is not reloaded.speculator.proj[0].weight


def small_checkpoint(tmp_path, tied=False, **overrides):
    config = {**published_config("granite-sharded"), "n_predict": 3, "top_k_tokens_per_head": [2, 2, 2], **overrides}
    return config, published_state_dict(48, 48, 3, 300, tied=tied)


def test_missing_key_is_named(tmp_path):
    config, state = small_checkpoint(tmp_path)
    del state["speculator.head.2.weight"]
    with pytest.raises(ValueError, match=r"missing key\(s\) \['speculator.head.2.weight'\]"):
        AutoModel.from_pretrained(write_published(tmp_path / "c", config, state))


def test_extra_key_is_named(tmp_path):
    config, state = small_checkpoint(tmp_path)
    state["speculator.head.3.weight"] = state["speculator.head.2.weight"].clone()
    with pytest.raises(ValueError, match=r"unexpected key\(s\) \['speculator.head.3.weight'\]"):
        AutoModel.from_pretrained(write_published(tmp_path / "c", config, state))


def test_wrong_shape_is_named(tmp_path):
    config, state = small_checkpoint(tmp_path)
    state["speculator.proj.1.weight"] = torch.zeros(48, 40, dtype=torch.float16)
    with pytest.raises(
        ValueError, match=r"wrongly shaped key\(s\) speculator\.proj\.1\.weight \[48, 40\] \(expected \[48, 48\]\)"
    ):
        AutoModel.from_pretrained(write_published(tmp_path / "c", config, state))


def test_config_that_disagrees_with_the_weights_is_an_error(tmp_path):
    """An untied checkpoint described as tied would otherwise drop heads 1.. silently."""
    config, state = small_checkpoint(tmp_path, tie_weights=True)
    with pytest.raises(ValueError, match=r"key\(s\) \[.*'speculator.emb.1.weight'.*\] hold weights of their own"):
        AutoModel.from_pretrained(write_published(tmp_path / "c", config, state))


def test_tied_checkpoint_described_as_untied_is_an_error(tmp_path):
    config, state = small_checkpoint(tmp_path, tied=True, tie_weights=False)
    with pytest.raises(ValueError, match=r"missing key\(s\).*speculator.emb.1.weight"):
        AutoModel.from_pretrained(write_published(tmp_path / "c", config, state))


def test_pytorch_model_bin_layout(tmp_path):
    config, state = small_checkpoint(tmp_path)
    folder = tmp_path / "bin"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    torch.save(state, folder / "pytorch_model.bin")
    model = AutoModel.from_pretrained(folder)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
