"""The transposed and packed layouts compute what nn.Linear computes, speculative greedy output stays identical, each
forward runs on the kind of weights that measured fastest on this machine, and a torch whose private ops are missing,
fail or compute wrongly decodes without the packed weights."""

import logging
import time
from types import SimpleNamespace

import pytest
import torch
from conftest import HIDDEN, VOCAB, make_oracle, make_prompt, make_speculator, make_verifier
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from hf_mlp_speculator import fast_cpu_decoding
from hf_mlp_speculator.cpu import weight_layouts
from hf_mlp_speculator.cpu.weight_layouts import (
    EXPLORE_EVERY,
    LAYOUTS,
    TRIALS,
    PackedLinear,
    TransposedLinear,
    WeightChoice,
    adaptive_weights,
    fixed_layout,
)
from hf_mlp_speculator.generation import mixin as generation

CLASS_NAMES = {kind: layout.__name__ for kind, (layout, _) in LAYOUTS.items()}


def plain_again(model) -> bool:
    """Every linear of `model` is a plain `nn.Linear` again, holding no copy."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    return all(type(m) is nn.Linear and not {"packed_weight", "transposed_weight"} & vars(m).keys() for m in linears)


@pytest.mark.parametrize("kind", ["transposed", "packed"])
def test_each_layout_computes_what_nn_linear_computes_for_every_row_count(kind):
    torch.manual_seed(0)
    linear = nn.Linear(64, 96)
    reference = nn.Linear(64, 96)
    reference.load_state_dict(linear.state_dict())
    with fixed_layout(nn.Sequential(linear), kind):
        assert type(linear) is LAYOUTS[kind][0]
        for shape in [(1, 64), (1, 1, 64), (1, 5, 64), (3, 8, 64)]:
            x = torch.randn(shape)
            torch.testing.assert_close(linear(x), reference(x), rtol=1e-5, atol=1e-5)
    assert type(linear) is nn.Linear and not hasattr(linear, LAYOUTS[kind][1])


@pytest.mark.parametrize("kind", ["transposed", "packed"])
def test_a_model_in_another_layout_keeps_its_parameters_and_ties(kind):
    """The copies leave the parameters in place (state_dict, tied weights) and compute the same logits as before."""
    verifier = LlamaForCausalLM(LlamaConfig(**{**make_verifier().config.to_dict(), "tie_word_embeddings": True}))
    verifier, speculator = verifier.eval(), make_speculator(tie_weights=True)
    tokens, hidden = torch.randint(0, VOCAB, (2, 7)), torch.randn(2, 4, HIDDEN)

    def logits():
        with torch.no_grad():
            return verifier(tokens).logits, speculator(hidden, tokens).logits

    expected, states = logits(), [dict(model.state_dict()) for model in (verifier, speculator)]
    with fixed_layout(verifier, kind), fixed_layout(speculator, kind):
        assert all(type(m) is LAYOUTS[kind][0] for m in (*verifier.modules(), *speculator.modules())
                   if isinstance(m, nn.Linear))  # fmt: skip
        assert verifier.lm_head.weight is verifier.model.embed_tokens.weight
        heads = speculator.speculator
        assert all(head.weight is heads.head[0].weight for head in heads.head)
        assert all(proj.weight is heads.proj[1].weight for proj in heads.proj[2:])
        for model, state in zip((verifier, speculator), states):
            assert model.state_dict().keys() == state.keys()
            assert all(model.state_dict()[key].data_ptr() == value.data_ptr() for key, value in state.items())
        torch.testing.assert_close(logits(), expected, rtol=1e-5, atol=1e-5)
    assert plain_again(verifier) and plain_again(speculator)


def slower(layout, seconds: float, monkeypatch):
    """A machine on which `layout` (a linear class) takes `seconds` longer per call."""
    forward = layout.forward

    def slow(self, input):
        time.sleep(seconds)
        return forward(self, input)

    monkeypatch.setattr(layout, "forward", slow)


def weights_of_each_forward(verifier) -> list[str]:
    """The class of `lm_head` in each forward of `verifier` from now on: the kind of weights the forward ran on."""
    kinds = []

    def record(module, args, kwargs, output):
        if kwargs.get("use_cache"):  # decoding, not the check that packed and plain weights agree
            kinds.append(type(module.lm_head).__name__)

    verifier.register_forward_hook(record, with_kwargs=True)
    return kinds


@pytest.mark.parametrize("wins", list(LAYOUTS))
@pytest.mark.parametrize("speculative", [False, True])
def test_each_forward_runs_on_the_weights_that_measured_fastest(monkeypatch, wins, speculative):
    """
    On a machine where one kind of weights wins (simulated: each linear of the other two kinds sleeps; a Xeon with AMX
    runs plain fastest, a Xeon without it transposed, some CPUs packed), decoding runs on it: once a shape's first
    forwards tried all three, all but one forward in EXPLORE_EVERY run the fastest. The same for speculative
    `generate()` (each step verifies 4 tokens here) and for plain decoding inside `fast_cpu_decoding`; greedy output
    identical.
    """
    monkeypatch.setattr(generation, "adaptive_weights", adaptive_weights)  # conftest turns it off
    for kind, (layout, _) in LAYOUTS.items():
        if kind != wins:
            slower(layout, 0.002, monkeypatch)
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
    steps = [kind for tokens, kind in forwards if tokens == (4 if speculative else 1)]
    trials = len(LAYOUTS) * (TRIALS + 1)
    assert set(steps[:trials]) == set(CLASS_NAMES.values())  # all tried
    later = steps[trials:]
    assert len(later) > 40 and later.count(CLASS_NAMES[wins]) >= len(later) * (1 - 1 / EXPLORE_EVERY) - 1, forwards
    assert plain_again(verifier)


def test_the_weights_are_compared_side_by_side_through_a_slow_spell():
    """
    Packed weights 25% slower than plain (an AMX Xeon), transposed ones 40%, one lucky packed trial, and a slow spell
    of the machine that slows every forward by 30% for 60 forwards: the plain weights run throughout, but for the
    trials and one forward in EXPLORE_EVERY, which tries the other two by turns. (Each kind's best recent time read
    apart ran 16 forwards in a row on the packed weights, twice.)
    """
    choice, shape, chosen, lucky = WeightChoice(), (1, 1), [], True
    slowdown = {"plain": 1.0, "transposed": 1.4, "packed": 1.25}
    for forward in range(1, 401):
        kind = choice.choose(shape)
        spell = 1.3 if 200 <= forward < 260 else 1.0
        seconds = spell * slowdown[kind]
        if kind == "packed" and forward > 3 and lucky:  # a quiet moment during the packed weights' first trial
            seconds, lucky = 0.9, False
        choice.record(shape, kind, seconds)
        chosen.append(kind)
    trials = len(LAYOUTS) * (TRIALS + 1)
    after_trials = chosen[trials:]
    explored = [chosen[forward - 1] for forward in range(trials + 1, 401) if forward % EXPLORE_EVERY == 0]
    assert [kind for kind in after_trials if kind != "plain"] == explored
    assert set(explored) == {"transposed", "packed"}
    # The lucky trial is still packed's fastest recent forward: read apart, it would have won.
    assert choice.summary()[shape] == {"plain": 1.0, "transposed": 1.4, "packed": 0.9}


REAL_OPS = weight_layouts.OPS


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
def test_a_missing_failing_or_wrong_op_leaves_the_packed_weights_out(monkeypatch, caplog, ops, logged):
    """Whatever a torch release does to the private ops, speculative generate() decodes without the packed weights,
    on the plain and transposed ones."""
    monkeypatch.setattr(weight_layouts, "OPS", ops)
    monkeypatch.setattr(generation, "adaptive_weights", adaptive_weights)  # conftest turns it off
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
    lines = [r.getMessage() for r in caplog.records if r.name == "hf_mlp_speculator.cpu.weight_layouts"]
    assert len(lines) == 1 and logged in lines[0], lines
    assert set(forwards) == {"Linear", "TransposedLinear"}  # no decoding forward ran on a packed weight
    assert plain_again(verifier)


def test_the_probe_accepts_the_real_op():
    verifier = make_verifier()
    assert weight_layouts.packed_matches_plain(verifier)
    assert not weight_layouts.packed_matches_plain(make_verifier().to(torch.bfloat16))  # not a model for packing


def test_fast_cpu_decoding_for_plain_generate(monkeypatch):
    """The public fast path: identical greedy output, the model as it was afterwards, never a stale copy."""
    monkeypatch.setattr(WeightChoice, "choose", lambda self, shape: "packed")  # as where packing is fastest
    verifier, prompt = make_verifier(), make_prompt()
    expected = verifier.generate(prompt, max_new_tokens=16, do_sample=False)
    pointers = {key: value.data_ptr() for key, value in verifier.state_dict().items()}
    kinds = weights_of_each_forward(verifier)
    with fast_cpu_decoding(verifier) as model:
        assert model is verifier
        assert torch.equal(verifier.generate(prompt, max_new_tokens=16, do_sample=False), expected)
    assert set(kinds) == {"PackedLinear"}
    assert plain_again(verifier)
    assert {key: value.data_ptr() for key, value in verifier.state_dict().items()} == pointers
    with torch.no_grad():
        verifier.model.layers[0].mlp.down_proj.weight.mul_(3)  # changed between two uses
    expected = verifier.generate(prompt, max_new_tokens=16, do_sample=False)
    with fast_cpu_decoding(verifier):
        assert torch.equal(verifier.generate(prompt, max_new_tokens=16, do_sample=False), expected)

    monkeypatch.setattr(weight_layouts, "OPS", None)  # a torch without the ops: the two other kinds
    monkeypatch.setattr(WeightChoice, "choose", lambda self, shape: "transposed")  # as where transposed is fastest
    other = make_verifier(seed=3)
    assert weight_layouts.cpu_weights(other).choice is None
    expected = other.generate(prompt, max_new_tokens=4, do_sample=False)
    kinds = weights_of_each_forward(other)
    with fast_cpu_decoding(other):
        assert torch.equal(other.generate(prompt, max_new_tokens=4, do_sample=False), expected)
    assert set(kinds) == {"TransposedLinear"}
    assert weight_layouts.cpu_weights(other).choice.kinds == ("plain", "transposed")
    assert plain_again(other)


def test_nested_and_moved_models(monkeypatch):
    """Speculative `generate()` inside `fast_cpu_decoding` (the outer context chooses), and a model moved to another
    dtype after a packed call (checked again: float64 is no model for packing)."""
    monkeypatch.setattr(generation, "adaptive_weights", adaptive_weights)  # conftest turns it off
    verifier, prompt, speculator = make_verifier(), make_prompt(), make_speculator()
    expected = verifier.generate(prompt, max_new_tokens=6, do_sample=False)
    with fast_cpu_decoding(verifier):
        assert torch.equal(verifier.generate(prompt, max_new_tokens=6, do_sample=False, assistant_model=speculator),
                           expected)  # fmt: skip
        assert torch.equal(verifier.generate(prompt, max_new_tokens=6, do_sample=False), expected)
    assert plain_again(verifier)
    verifier.to(torch.float64)
    verifier.generate(prompt, max_new_tokens=6, do_sample=False, assistant_model=speculator.to(torch.float64))
    assert plain_again(verifier)


@pytest.mark.parametrize("copies", [0, 1, 2])
def test_kinds_whose_copies_would_not_fit_in_memory_are_left_out(monkeypatch, caplog, copies):
    """Each kind but plain keeps a copy of the linear weights: with room for fewer copies (within half the memory
    available), the later kinds are left out, said on one INFO line, and greedy output stays identical."""
    monkeypatch.setattr(generation, "adaptive_weights", adaptive_weights)  # conftest turns it off
    verifier, prompt, speculator = make_verifier(), make_prompt(), make_speculator()
    weights = {id(m.weight): m.weight for m in verifier.modules() if type(m) is nn.Linear}.values()
    size = sum(w.numel() * w.element_size() for w in weights)
    monkeypatch.setattr(weight_layouts, "available_memory", lambda: 2 * copies * size + 1)
    expected = verifier.generate(prompt, max_new_tokens=12, do_sample=False)
    kinds = weights_of_each_forward(verifier)
    with caplog.at_level(logging.INFO, logger="hf_mlp_speculator"):
        output = verifier.generate(prompt, max_new_tokens=12, do_sample=False, assistant_model=speculator)
    assert torch.equal(output, expected)
    allowed = ("plain", "transposed", "packed")[: copies + 1]
    assert weight_layouts.cpu_weights(verifier).choice.kinds == allowed
    assert set(kinds) == {CLASS_NAMES[kind] for kind in allowed}
    lines = [r.getMessage() for r in caplog.records if r.name == "hf_mlp_speculator.cpu.weight_layouts"]
    if copies < 2:
        left_out = " and ".join(("transposed", "packed")[copies:])
        assert len(lines) == 1, lines
        assert lines[0].startswith(f"Not using the {left_out} weights: a copy of the linear weights takes"), lines
    else:
        assert not lines
    assert plain_again(verifier)


def test_a_single_kind_never_explores_and_the_probe_waits_for_memory(monkeypatch):
    """With room for no copy, only the plain weights: their choice is never asked to explore another kind (which would
    find none), no hook runs, and the packed weights are not even probed (the probe would make their copies)."""
    choice = WeightChoice(("plain",))
    assert {choice.choose((1, 1)) for _ in range(3 * EXPLORE_EVERY)} == {"plain"}
    monkeypatch.setattr(generation, "adaptive_weights", adaptive_weights)  # conftest turns it off
    monkeypatch.setattr(weight_layouts, "available_memory", lambda: 0)
    monkeypatch.setattr(weight_layouts, "packed_matches_plain", lambda model: pytest.fail("probed"))
    verifier, prompt, speculator = make_verifier(), make_prompt(), make_speculator()
    expected = verifier.generate(prompt, max_new_tokens=2 * EXPLORE_EVERY, do_sample=False)
    output = verifier.generate(prompt, max_new_tokens=2 * EXPLORE_EVERY, do_sample=False, assistant_model=speculator)
    assert torch.equal(output, expected)
    weights = weight_layouts.cpu_weights(verifier)
    assert weights.choice.kinds == ("plain",) and not weights.copies and weights.summary() == {}
    assert plain_again(verifier)


def test_packed_copies_of_a_model_they_disagree_with_are_freed(monkeypatch):
    def disagrees(model):  # as the probe does, it makes the packed copies first
        weight_layouts.cpu_weights(model).copy(model.lm_head.weight, "packed")
        return False

    monkeypatch.setattr(weight_layouts, "packed_matches_plain", disagrees)
    verifier = make_verifier()
    with adaptive_weights(verifier):
        verifier(make_prompt())
    copies = weight_layouts.cpu_weights(verifier).copies
    assert copies and {kind for kind, _ in copies} == {"transposed"}
