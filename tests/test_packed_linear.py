"""Packed oneDNN linears compute what nn.Linear computes, speculative greedy output stays identical, each forward runs
on the kind of weights that measured faster on this machine, and a torch whose private ops are missing, fail or
compute wrongly decodes on the plain weights."""

import logging
import time
from types import SimpleNamespace

import pytest
import torch
from conftest import HIDDEN, VOCAB, make_oracle, make_prompt, make_speculator, make_verifier
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from hf_mlp_speculator import fast_cpu_decoding
from hf_mlp_speculator.cpu import packed_linear
from hf_mlp_speculator.cpu.packed_linear import (
    EXPLORE_EVERY,
    TRIALS,
    PackedLinear,
    PackingChoice,
    adaptive_packing,
    packed_weights,
)
from hf_mlp_speculator.generation import mixin as generation


def test_packed_linear_matches_nn_linear_for_every_row_count():
    torch.manual_seed(0)
    linear = nn.Linear(64, 96)
    reference = nn.Linear(64, 96)
    reference.load_state_dict(linear.state_dict())
    with packed_weights(nn.Sequential(linear)):
        assert isinstance(linear, PackedLinear)
        for shape in [(1, 64), (1, 1, 64), (1, 5, 64), (3, 8, 64)]:
            x = torch.randn(shape)
            torch.testing.assert_close(linear(x), reference(x), rtol=1e-5, atol=1e-5)


def test_packed_model_keeps_its_parameters_and_ties():
    """Packing leaves the parameters in place (state_dict, tied weights) and computes the same logits as before."""
    verifier = LlamaForCausalLM(LlamaConfig(**{**make_verifier().config.to_dict(), "tie_word_embeddings": True}))
    verifier, speculator = verifier.eval(), make_speculator(tie_weights=True)
    tokens, hidden = torch.randint(0, VOCAB, (2, 7)), torch.randn(2, 4, HIDDEN)

    def logits():
        with torch.no_grad():
            return verifier(tokens).logits, speculator(hidden, tokens).logits

    expected, states = logits(), [dict(model.state_dict()) for model in (verifier, speculator)]
    with packed_weights(verifier), packed_weights(speculator):
        assert all(isinstance(m, PackedLinear) for m in (*verifier.modules(), *speculator.modules())
                   if isinstance(m, nn.Linear))  # fmt: skip
        assert verifier.lm_head.weight is verifier.model.embed_tokens.weight
        heads = speculator.speculator
        assert all(head.weight is heads.head[0].weight for head in heads.head)
        assert all(proj.weight is heads.proj[1].weight for proj in heads.proj[2:])
        for model, state in zip((verifier, speculator), states):
            assert model.state_dict().keys() == state.keys()
            assert all(model.state_dict()[key].data_ptr() == value.data_ptr() for key, value in state.items())
        torch.testing.assert_close(logits(), expected, rtol=1e-5, atol=1e-5)
    assert not any(isinstance(m, PackedLinear) for m in verifier.modules())
    assert not hasattr(verifier.lm_head, "packed_weight")


def slower(kind, seconds: float, monkeypatch):
    """A machine on which `kind` of linear (packed or plain) takes `seconds` longer per call."""
    forward = kind.forward

    def slow(self, input):
        time.sleep(seconds)
        return forward(self, input)

    monkeypatch.setattr(kind, "forward", slow)


def weights_of_each_forward(verifier) -> list[str]:
    """The class of `lm_head` in each forward of `verifier` from now on: the kind of weights the forward ran on."""
    kinds = []

    def record(module, args, kwargs, output):
        if kwargs.get("use_cache"):  # decoding, not the check that packed and plain weights agree
            kinds.append(type(module.lm_head).__name__)

    verifier.register_forward_hook(record, with_kwargs=True)
    return kinds


@pytest.mark.parametrize("loses", ["packed", "plain"])
@pytest.mark.parametrize("speculative", [False, True])
def test_each_forward_runs_on_the_weights_that_measured_faster(monkeypatch, loses, speculative):
    """
    On a machine where packed weights lose (a Xeon with AMX, simulated: each packed linear sleeps), decoding runs on
    the plain ones, and where they win (each plain linear sleeps), on the packed ones: once a shape's first forwards
    tried both, all but one forward in EXPLORE_EVERY run the faster kind. The same for speculative `generate()` (each
    step verifies 4 tokens here) and for plain decoding inside `fast_cpu_decoding`; greedy output identical.
    """
    monkeypatch.setattr(generation, "adaptive_packing", adaptive_packing)  # conftest turns it off
    slower(PackedLinear if loses == "packed" else nn.Linear, 0.002, monkeypatch)
    verifier, prompt, speculator = make_verifier(), make_prompt(), make_speculator()
    expected = verifier.generate(prompt, max_new_tokens=60, do_sample=False)
    forwards = []  # (new tokens per row, kind of weights) of each forward
    def record(module, args, kwargs, output):
        tokens = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        forwards.append((tokens.shape[1], type(module.lm_head).__name__))

    verifier.register_forward_hook(record, with_kwargs=True)
    if speculative:
        output = verifier.generate(prompt, max_new_tokens=60, do_sample=False, assistant_model=speculator)
    else:
        with fast_cpu_decoding(verifier):
            output = verifier.generate(prompt, max_new_tokens=60, do_sample=False)
    assert torch.equal(output, expected)
    faster = "Linear" if loses == "packed" else "PackedLinear"
    steps = [kind for tokens, kind in forwards if tokens == (4 if speculative else 1)]
    assert set(steps[: 2 * TRIALS + 2]) == {"Linear", "PackedLinear"}  # both tried
    later = steps[2 * TRIALS + 2 :]
    assert len(later) > 40 and later.count(faster) >= len(later) * (1 - 1 / EXPLORE_EVERY) - 1, forwards
    assert not any(isinstance(m, PackedLinear) for m in verifier.modules())


def test_the_weights_are_compared_side_by_side_through_a_slow_spell():
    """
    Packed weights 25% slower than plain (an AMX Xeon), one lucky packed trial, and a slow spell of the machine that
    slows every forward by 30% for 60 forwards: the plain weights run throughout, but for the trials and one forward
    in EXPLORE_EVERY. (Each kind's best recent time read apart ran 16 forwards in a row on the packed weights, twice.)
    """
    choice, shape, chosen, lucky = PackingChoice(), (1, 1), [], True
    for forward in range(1, 401):
        packed = choice.choose(shape)
        spell = 1.3 if 200 <= forward < 260 else 1.0
        seconds = spell * (1.25 if packed else 1.0)
        if packed and forward > 2 and lucky:  # a quiet moment during the packed weights' first counted trial
            seconds, lucky = 0.9, False
        choice.record(shape, packed, seconds)
        chosen.append(packed)
    after_trials = chosen[2 * TRIALS + 2 :]
    explorations = sum(1 for forward in range(2 * TRIALS + 3, 401) if forward % EXPLORE_EVERY == 0)
    assert sum(after_trials) == explorations


REAL_OPS = packed_linear.OPS


def raising(*args):
    raise RuntimeError("oneDNN refuses this weight")


def off_by_a_thousandth(*args):
    return REAL_OPS._linear_pointwise(*args) * 1.001


@pytest.mark.parametrize(
    "ops,logged",
    [
        (None, "has no oneDNN packed-linear ops"),
        (SimpleNamespace(_reorder_linear_weight=raising, _linear_pointwise=raising), "failed here (RuntimeError"),
        (SimpleNamespace(_reorder_linear_weight=REAL_OPS._reorder_linear_weight, _linear_pointwise=raising),
         "failed here (RuntimeError: oneDNN refuses this weight)"),
        (SimpleNamespace(_reorder_linear_weight=REAL_OPS._reorder_linear_weight,
                         _linear_pointwise=off_by_a_thousandth), "disagree with the plain ones"),
    ],
    ids=["op missing", "packing raises", "op raises", "op wrong"],
)  # fmt: skip
def test_a_missing_failing_or_wrong_op_falls_back_to_plain_weights(monkeypatch, caplog, ops, logged):
    """Whatever a torch release does to the private ops, speculative generate() decodes on the plain weights."""
    monkeypatch.setattr(packed_linear, "OPS", ops)
    monkeypatch.setattr(generation, "adaptive_packing", adaptive_packing)  # conftest turns it off
    verifier, prompt = make_verifier(), make_prompt()
    speculator = make_oracle(verifier, prompt, 20, wrong=lambda p, h: (p + h) % 3 == 2)
    expected = verifier.generate(prompt, max_new_tokens=20, do_sample=False)
    forwards = []  # the class of lm_head in each decoding forward (the agreement check runs without a cache)

    def record(module, args, kwargs, output):
        if kwargs.get("use_cache"):
            forwards.append(type(module.lm_head).__name__)

    verifier.register_forward_hook(record, with_kwargs=True)
    with caplog.at_level(logging.INFO, logger="hf_mlp_speculator"):
        output = verifier.generate(prompt, max_new_tokens=20, do_sample=False, assistant_model=speculator)
    assert torch.equal(output, expected)
    assert speculator.speculation_metrics.num_accepted_tokens > 0
    lines = [r.getMessage() for r in caplog.records if r.name == "hf_mlp_speculator.cpu.packed_linear"]
    assert len(lines) == 1 and logged in lines[0] and "decoding on the plain weights" in lines[0], lines
    assert set(forwards) == {"Linear"}  # no decoding forward ran on a packed weight
    assert not any(isinstance(m, PackedLinear) for m in verifier.modules())


def test_the_probe_accepts_the_real_op():
    verifier = make_verifier()
    assert packed_linear.packed_matches_plain(verifier)
    assert not packed_linear.packed_matches_plain(make_verifier().to(torch.bfloat16))  # not a model for packing


def test_fast_cpu_decoding_for_plain_generate(monkeypatch):
    """The public fast path: identical greedy output, the model as it was afterwards, never a stale copy."""
    monkeypatch.setattr(packed_linear.PackingChoice, "choose", lambda self, shape: True)  # as where packing is faster
    verifier, prompt = make_verifier(), make_prompt()
    expected = verifier.generate(prompt, max_new_tokens=16, do_sample=False)
    pointers = {key: value.data_ptr() for key, value in verifier.state_dict().items()}
    kinds = weights_of_each_forward(verifier)
    with fast_cpu_decoding(verifier) as model:
        assert model is verifier
        assert torch.equal(verifier.generate(prompt, max_new_tokens=16, do_sample=False), expected)
    assert set(kinds) == {"PackedLinear"}
    assert not any(isinstance(m, PackedLinear) for m in verifier.modules())
    assert {key: value.data_ptr() for key, value in verifier.state_dict().items()} == pointers
    with torch.no_grad():
        verifier.model.layers[0].mlp.down_proj.weight.mul_(3)  # changed between two uses
    expected = verifier.generate(prompt, max_new_tokens=16, do_sample=False)
    with fast_cpu_decoding(verifier):
        assert torch.equal(verifier.generate(prompt, max_new_tokens=16, do_sample=False), expected)

    monkeypatch.setattr(packed_linear, "OPS", None)  # a torch without the ops: nothing changes
    other = make_verifier(seed=3)
    kinds = weights_of_each_forward(other)
    with fast_cpu_decoding(other):
        other.generate(prompt, max_new_tokens=4, do_sample=False)
    assert set(kinds) == {"Linear"}


def test_nested_and_moved_models(monkeypatch):
    """Speculative `generate()` inside `fast_cpu_decoding` (the outer context chooses), and a model moved to another
    dtype after a packed call (checked again: float64 is no model for packing)."""
    monkeypatch.setattr(generation, "adaptive_packing", adaptive_packing)  # conftest turns it off
    verifier, prompt, speculator = make_verifier(), make_prompt(), make_speculator()
    expected = verifier.generate(prompt, max_new_tokens=6, do_sample=False)
    with fast_cpu_decoding(verifier):
        assert torch.equal(verifier.generate(prompt, max_new_tokens=6, do_sample=False, assistant_model=speculator),
                           expected)  # fmt: skip
        assert torch.equal(verifier.generate(prompt, max_new_tokens=6, do_sample=False), expected)
    assert not any(isinstance(m, PackedLinear) for m in verifier.modules())
    verifier.to(torch.float64)
    verifier.generate(prompt, max_new_tokens=6, do_sample=False, assistant_model=speculator.to(torch.float64))
    assert not any(isinstance(m, PackedLinear) for m in verifier.modules())
