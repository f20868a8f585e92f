"""Arctic speculators (Snowflake): LSTM and MLP checkpoints as ArcticTraining writes them load through AutoModel, the
LSTM's teacher-forced forward is the published equations, and it decodes losslessly wherever an MLP speculator does."""

import json
import math
import random

import pytest
import torch
from conftest import HIDDEN, VOCAB, make_prompt, make_verifier
from huggingface_hub.errors import StrictDataclassError
from test_sampling import MODES, keyed_plain_sampling, sampled, sharp_pair
from transformers import AutoModel

import hf_mlp_speculator  # noqa: F401  (registers the model type)
from hf_mlp_speculator import MLPSpeculatorConfig, MLPSpeculatorPreTrainedModel
from hf_mlp_speculator.drafting import cost_model

WIDTH, N_PREDICT = 32, 3
GATES = ("forget", "input", "output", "cell")


def arctic_lstm_weights(vocab=VOCAB, hidden=HIDDEN, width=WIDTH, n_predict=N_PREDICT, seed=0) -> dict:
    """An LSTM speculator's `state_dict()` as ArcticTraining saves it: no prefix, every tied name present."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=None):
        return torch.randn(*shape, generator=generator) * (scale or 1 / math.sqrt(min(shape)))

    embedding, head = randn(vocab, width), randn(vocab, width)
    weights = {f"{gate}_emb.0.weight": embedding for gate in GATES}
    for gate in GATES:
        weights[f"{gate}_proj.0.weight"] = randn(width, hidden)
        weights[f"{gate}_proj.1.weight"] = randn(width, width)
    for norm in ("cell_ln", "state_ln"):
        weights[f"{norm}.0.weight"] = 1 + 0.1 * randn(width, scale=1)
        weights[f"{norm}.0.bias"] = 0.1 * randn(width, scale=1)
    weights.update({f"head.{i}.weight": head for i in range(n_predict)})
    return weights


def arctic_lstm_config(vocab=VOCAB, hidden=HIDDEN, width=WIDTH, n_predict=N_PREDICT, **changes) -> dict:
    """An LSTM speculator's config.json as ArcticTraining writes it (its config object's `__dict__`)."""
    config = {
        "architectures": ["ArcticLSTMSpeculatorPreTrainedModel"], "base_model_name_or_path": "tiny/llama",
        "input_hidden_dim": hidden, "inner_dim": str(width), "proj_dim": str(width), "emb_dim": str(width),
        "model_type": "mlp_speculator", "n_candidates": n_predict, "n_predict": n_predict, "scale_input": True,
        "tie_weights": True, "tie_lstm_embs": True, "top_k_tokens_per_head": [1] * n_predict,
        "torch_dtype": "bfloat16", "transformers_version": "4.51.3", "vocab_size": vocab, "method": "sum_lstm",
    }  # fmt: skip
    config.update(changes)
    return config


def write_checkpoint(folder, config: dict, weights: dict):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    torch.save(weights, folder / "pytorch_model.bin")
    return folder


def lstm_equations(weights: dict, hidden_states, input_ids, n_predict=N_PREDICT, scale_input=True):
    """The published LSTM math, written out from the raw tensors: per-head logits `[n, batch, positions, vocab]`."""

    def rms(x, weight=None, bias=None):
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return x if weight is None else x * weight + bias

    def gelu(x):  # exact (erf) GELU
        return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))

    width = weights["forget_emb.0.weight"].shape[1]
    s = 0.5 ** (0.5 / n_predict)
    alpha = math.sqrt((1 - s**2) * width / 2) / s
    h = rms(hidden_states) / math.sqrt(2) if scale_input else hidden_states
    c = torch.zeros(*hidden_states.shape[:-1], width)
    positions, logits = hidden_states.shape[1], []
    for k in range(n_predict):
        j = 0 if k == 0 else 1
        z = alpha * weights["forget_emb.0.weight"][input_ids[:, k : k + positions]]
        f, i, o, cell = (h @ weights[f"{g}_proj.{j}.weight"].T + z for g in GATES)
        candidate = gelu(rms(cell, weights["cell_ln.0.weight"], weights["cell_ln.0.bias"]))
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * candidate
        h = torch.sigmoid(o) * gelu(rms(c, weights["state_ln.0.weight"], weights["state_ln.0.bias"]))
        logits.append(h @ weights[f"head.{k}.weight"].T)
    return torch.stack(logits)


@pytest.fixture
def arctic_lstm(tmp_path):
    weights = arctic_lstm_weights()
    return write_checkpoint(tmp_path / "lstm", arctic_lstm_config(), weights), weights


def test_an_arctic_training_lstm_checkpoint_loads_as_written(arctic_lstm):
    folder, weights = arctic_lstm
    model = AutoModel.from_pretrained(folder)
    assert isinstance(model, MLPSpeculatorPreTrainedModel) and model.config.is_lstm
    assert model.dtype == torch.bfloat16  # the config's torch_dtype, as for any transformers model
    assert (model.config.emb_dim, model.config.inner_dim, model.config.verifier_hidden_size) == (WIDTH, WIDTH, HIDDEN)
    model = AutoModel.from_pretrained(folder, dtype=torch.float32)
    state = model.state_dict()
    for key, tensor in weights.items():
        assert torch.equal(state[f"speculator.{key}"], tensor), key
    heads = model.speculator
    assert heads.input_emb[0].weight is heads.forget_emb[0].weight and heads.head[2].weight is heads.head[0].weight


def test_the_teacher_forced_forward_is_the_published_equations(arctic_lstm):
    folder, weights = arctic_lstm
    model = AutoModel.from_pretrained(folder, dtype=torch.float32)
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 5, HIDDEN, generator=generator) * 3
    input_ids = torch.randint(VOCAB, (2, 5 + N_PREDICT), generator=generator)
    logits = model(hidden_states=hidden, input_ids=input_ids).logits
    assert logits.shape == (N_PREDICT, 2, 5, VOCAB)
    torch.testing.assert_close(logits, lstm_equations(weights, hidden, input_ids), rtol=1e-5, atol=1e-5)
    labels = input_ids[:, 1 : 1 + 5].expand(N_PREDICT, -1, -1)
    assert model(hidden_states=hidden, input_ids=input_ids, labels=labels).loss.isfinite()


def test_drafting_steps_carry_both_states(arctic_lstm):
    """`input_state` and `step`, as the decoding loops call them, give the teacher-forced forward's logits."""
    folder, weights = arctic_lstm
    heads = AutoModel.from_pretrained(folder, dtype=torch.float32).speculator
    generator = torch.Generator().manual_seed(4)
    hidden = torch.randn(3, HIDDEN, generator=generator)
    tokens = torch.randint(VOCAB, (3, N_PREDICT), generator=generator)
    expected = lstm_equations(weights, hidden[:, None], tokens)[:, :, 0]
    state = heads.input_state(hidden)
    for k in range(N_PREDICT):
        state, logits = heads.step(k, state, tokens[:, k])
        torch.testing.assert_close(logits, expected[k], rtol=1e-5, atol=1e-5)


def test_save_pretrained_round_trips_without_the_tied_copies(arctic_lstm, tmp_path):
    folder, weights = arctic_lstm
    model = AutoModel.from_pretrained(folder, dtype=torch.float32)
    model.save_pretrained(tmp_path / "saved")
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "saved" / "model.safetensors")
    assert not any(key.startswith(("speculator.input_emb", "speculator.head.1")) for key in saved)
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert (config["method"], config["input_hidden_dim"], config["tie_lstm_embs"]) == ("sum_lstm", HIDDEN, True)
    again = AutoModel.from_pretrained(tmp_path / "saved")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))


def test_safetensors_with_the_prefix_load_too(arctic_lstm, tmp_path):
    from safetensors.torch import save_file

    _, weights = arctic_lstm
    folder = tmp_path / "prefixed"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(arctic_lstm_config()))
    save_file({f"speculator.{k}": v.clone() for k, v in weights.items()}, folder / "model.safetensors")
    model = AutoModel.from_pretrained(folder, dtype=torch.float32)
    assert torch.equal(model.speculator.cell_proj[1].weight, weights["cell_proj.1.weight"])


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"method": "sum_rnn"}, r"method='sum_rnn' \(ArcticTraining's default RNN speculator\) is not supported"),
        ({"method": None}, r"method=None \(ArcticTraining's default RNN speculator\) is not supported"),
        ({"tie_lstm_embs": False}, r"tie_lstm_embs=False is not supported: .* \(both true\)"),
        ({"emb_dim": "32.16"}, r"emb_dim='32\.16' is a stack of widths, which only ArcticTraining's sum_rnn"),
        ({"proj_dim": "16"}, r"one width, but the config gives emb_dim=32, inner_dim=32, proj_dim=16: make them"),
        ({"input_hidden_dim": None}, r"input_hidden_dim is None: an LSTM speculator needs its verifier's hidden size"),
    ],
)
def test_variants_that_do_not_run_here_are_named(tmp_path, changes, message):
    write_checkpoint(tmp_path, arctic_lstm_config(**changes), arctic_lstm_weights())
    with pytest.raises((ValueError, StrictDataclassError), match=message):
        AutoModel.from_pretrained(tmp_path)


def test_a_missing_lstm_key_is_named(tmp_path):
    weights = arctic_lstm_weights()
    del weights["forget_proj.1.weight"]
    write_checkpoint(tmp_path, arctic_lstm_config(), weights)
    with pytest.raises(ValueError, match=r"sum_lstm, .*missing key\(s\) \['speculator.forget_proj.1.weight'\]"):
        AutoModel.from_pretrained(tmp_path)


def test_an_arctic_training_mlp_checkpoint_loads_as_written(tmp_path):
    """ArcticTraining's MLP trainer: `architectures` a string, `top_k_tokesns_per_head` (sic), every tied copy saved
    unprefixed in pytorch_model.bin."""
    config = MLPSpeculatorConfig(vocab_size=VOCAB, emb_dim=HIDDEN, inner_dim=WIDTH, n_predict=3, tie_weights=True,
                                 scale_input=True)  # fmt: skip
    torch.manual_seed(5)
    reference = MLPSpeculatorPreTrainedModel(config)
    weights = {key.removeprefix("speculator."): value for key, value in reference.state_dict().items()}
    assert "emb.2.weight" in weights and "proj.2.weight" in weights  # the tied copies, as torch.save keeps them
    written = {"architectures": "MLPSpeculatorPreTrainedModel", "base_model_name_or_path": "tiny/llama",
               "emb_dim": HIDDEN, "inner_dim": WIDTH, "model_type": "mlp_speculator", "n_candidates": 3,
               "n_predict": 3, "scale_input": True, "tie_weights": True, "top_k_tokesns_per_head": [1, 1, 1],
               "torch_dtype": "bfloat16", "transformers_version": "4.51.3", "vocab_size": VOCAB}  # fmt: skip
    write_checkpoint(tmp_path, written, weights)
    model = AutoModel.from_pretrained(tmp_path, dtype=torch.float32)
    assert not model.config.is_lstm and model.config.top_k_tokens_per_head == [1, 1, 1]
    assert model.config.architectures == ["MLPSpeculatorPreTrainedModel"]
    hidden, ids = torch.randn(1, 4, HIDDEN), torch.randint(VOCAB, (1, 7))
    assert torch.equal(model(hidden, ids).logits, reference(hidden, ids).logits)


def make_lstm_speculator(n_predict=N_PREDICT, vocab=VOCAB, hidden=HIDDEN, width=WIDTH, seed=1, **kwargs):
    torch.manual_seed(seed)
    config = MLPSpeculatorConfig(method="sum_lstm", vocab_size=vocab, input_hidden_dim=hidden, emb_dim=width,
                                 inner_dim=width, n_predict=n_predict, top_k_tokens_per_head=[2] * n_predict,
                                 tie_weights=True, tie_lstm_embs=True, scale_input=True, **kwargs)  # fmt: skip
    return MLPSpeculatorPreTrainedModel(config).eval()


GREEDY_MODES = {  # options of both calls, and of the speculative call only
    "chain": ({}, {}),
    "tree": ({}, {"n_candidates": 3}),
    "hybrid": ({}, {"prompt_lookup_num_tokens": 2}),
    "static cache": ({"cache_implementation": "static"}, {}),
    "transformers' loop": ({"output_scores": True, "return_dict_in_generate": True}, {}),
}


@pytest.mark.parametrize("mode", list(GREEDY_MODES))
@pytest.mark.parametrize("rows", [1, 3])
def test_lstm_greedy_is_plain_greedy(mode, rows):
    common, drafting = GREEDY_MODES[mode]
    if rows > 1 and mode in ("static cache", "transformers' loop"):
        pytest.skip("one sequence only, as for an MLP speculator")
    verifier, speculator = make_verifier(), make_lstm_speculator()
    prompts = torch.cat([make_prompt(10, seed=s) for s in range(rows)])
    mask = torch.ones_like(prompts)
    mask[1:, :2] = 0  # ragged rows
    plain = verifier.generate(prompts, attention_mask=mask, max_new_tokens=20, do_sample=False, **common)
    output = verifier.generate(prompts, attention_mask=mask, max_new_tokens=20, do_sample=False,
                               assistant_model=speculator, **common, **drafting)  # fmt: skip
    if isinstance(plain, torch.Tensor):
        assert torch.equal(output, plain)
    else:
        assert torch.equal(output.sequences, plain.sequences)
    metrics = speculator.speculation_metrics
    assert metrics.num_draft_tokens > 0 and metrics.num_steps > 0


def sharp_lstm_pair():
    """test_sampling's sharp verifier with a sharp LSTM speculator over its 4 tokens."""
    verifier, _ = sharp_pair()
    speculator = make_lstm_speculator(vocab=4, hidden=32, width=16, seed=0)
    with torch.no_grad():
        speculator.speculator.head[0].weight.mul_(4)
    return verifier, speculator


@pytest.mark.parametrize("mode", list(MODES))
def test_lstm_sampling_is_plain_sampling_with_the_same_noise(mode):
    verifier, speculator = sharp_lstm_pair()
    accepted = 0
    for seed in range(3):
        input_ids, attention_mask, output = sampled(verifier, speculator, MODES[mode], seed)
        assert torch.equal(output, keyed_plain_sampling(verifier, input_ids, attention_mask, seed))
        accepted += speculator.speculation_metrics.num_accepted_tokens
    assert accepted > 0


@pytest.mark.cost_aware
@pytest.mark.parametrize("mode", ["batch 1", "batch 3, tree"])
def test_a_seed_gives_the_same_tokens_whatever_depths_the_controller_picks(mode, monkeypatch):
    """The controller choosing depths from timings that are random values: the same tokens under one seed."""
    jitter = random.Random(0)
    record = cost_model.CostModel.record_verify
    monkeypatch.setattr(cost_model.CostModel, "record_verify",
                        lambda self, length, tokens, _, *steady: record(self, length, tokens, jitter.random(),
                                                                         *steady))  # fmt: skip
    verifier, speculator = sharp_lstm_pair()
    calls = [sampled(verifier, speculator, MODES[mode], seed=1234, max_new_tokens=24)[2] for _ in range(4)]
    assert all(torch.equal(tokens, calls[0]) for tokens in calls)
    depths = speculator.speculation_metrics.steps_by_depth
    assert sum(count > 0 for count in depths) > 1  # the controller did pick different depths


def test_the_verifier_size_check_reads_input_hidden_dim():
    speculator = make_lstm_speculator(hidden=HIDDEN + 8)
    with pytest.raises(ValueError, match=f"input_hidden_dim is {HIDDEN + 8} but the model's hidden_size is {HIDDEN}"):
        make_verifier().generate(make_prompt(), max_new_tokens=4, assistant_model=speculator)


def test_an_lstm_with_a_reduced_draft_vocabulary_decodes_and_widens():
    reduced = make_lstm_speculator(draft_vocab_size=40)
    verifier, prompt = make_verifier(), make_prompt(10)
    plain = verifier.generate(prompt, max_new_tokens=16, do_sample=False)
    assert torch.equal(verifier.generate(prompt, max_new_tokens=16, do_sample=False, assistant_model=reduced), plain)
    full = reduced.expand_draft_vocab()
    heads = full.speculator
    assert heads.head[0].weight.shape == (VOCAB, WIDTH) and heads.head[2] is heads.head[0]
    hidden, ids = torch.randn(1, 3, HIDDEN), torch.randint(VOCAB, (1, 6))
    drafts = reduced.speculator.draft_vocab
    torch.testing.assert_close(full(hidden, ids).logits[..., drafts], reduced(hidden, ids).logits)
