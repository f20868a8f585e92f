"""The cost-aware controller's choices, the cost model, and lossless decoding with both in charge."""

import contextlib
import copy
import functools
import gc
import time
import weakref
from statistics import NormalDist

import pytest
import torch
from conftest import make_oracle, make_prompt, make_speculator, make_verifier
from torch import nn
from transformers import GPT2LMHeadModel, LlamaForCausalLM

from hf_mlp_speculator import speculation_state
from hf_mlp_speculator.cpu.weight_layouts import (
    PackedLinear,
    WeightChoice,
    adaptive_weights,
    cpu_weights,
    fixed_layout,
)
from hf_mlp_speculator.drafting.controller import (
    AcceptanceEstimate,
    SpeculationController,
    best_depth,
    expected_tokens,
    sure_moments,
    token_moments,
)
from hf_mlp_speculator.drafting.cost_model import CostModel, batch_bucket, cache_bucket
from hf_mlp_speculator.generation import mixin as generation

pytestmark = pytest.mark.cost_aware


def filled_cost_model(verify, draft=0.0, cache_length=100):
    """A cost model that timed `verify[m - 1]` seconds for m = 1.. new tokens, and `draft` per head."""
    costs = CostModel()
    for m, seconds in enumerate(verify, start=1):
        costs.record_verify(cache_length, m, 100.0)  # each m's first timing pays one-time costs: left out
        costs.record_verify(cache_length, m, seconds)
    for head in range(len(verify) - 1):
        costs.record_draft(head, 100.0)  # so are each head's
        costs.record_draft(head, draft)
    return costs


def controller_with(costs, acceptance, cap):
    return SpeculationController(lambda rows: costs, acceptance, cap)  # no time spent yet: no exploration budget


def test_picks_a_plain_step_where_drafts_never_pay():
    # Verifying k + 1 tokens costs k + 1 steps (a CPU without the fast path): no acceptance below 1 can pay for it.
    costs = filled_cost_model([0.1 * m for m in range(1, 5)], draft=0.001)
    acceptance = AcceptanceEstimate(3)
    confidences = torch.full((40, 3), 0.9, dtype=torch.float64)
    acceptance.record(confidences, [3] * 40, [1] * 40)  # head 0 always right, head 1 always wrong
    controller = controller_with(costs, acceptance, cap=3)
    assert controller.start_step(cache_length=100, rows=1) == 0
    assert best_depth(torch.ones(1, 0, dtype=torch.float64), [0.99, 0.99, 0.99], [0.1, 0.2, 0.3, 0.4]) == 0


def test_picks_the_known_optimum_of_a_cost_and_acceptance_table():
    acceptance, verify = [0.9, 0.8, 0.5, 0.1], [1.0, 1.1, 1.2, 1.6, 2.0]
    # By hand: expected tokens 1, 1.9, 2.62, 2.98, 3.016 per step, over the costs: 1, 1.73, 2.18, 1.86, 1.51.
    assert best_depth(torch.ones(1, 0, dtype=torch.float64), acceptance, verify) == 2
    tokens = expected_tokens(torch.ones(1, 0, dtype=torch.float64), acceptance)
    assert tokens.tolist() == pytest.approx([1, 1.9, 2.62, 2.98, 3.016])
    # Two rows share one forward; a row whose chain ended adds no further tokens.
    prefix = torch.tensor([[0.9], [0.9]], dtype=torch.float64)
    assert expected_tokens(prefix, [0.5], torch.tensor([True, False])).tolist() == pytest.approx([3.8, 4.25])
    # Cheap verification (a GPU): every head pays.
    assert best_depth(torch.ones(1, 0, dtype=torch.float64), acceptance, [1.0, 1.01, 1.02, 1.03, 1.04]) == 4


def test_controller_follows_the_confidence_of_the_drafts_made():
    costs = filled_cost_model([1.0, 1.1, 1.2, 1.3])
    acceptance = AcceptanceEstimate(3)
    for confidence, accepted in ((0.95, 1), (0.05, 0)):  # confident drafts are kept, unsure ones rejected
        acceptance.record(torch.full((60, 3), confidence, dtype=torch.float64), [3] * 60, [3 * accepted] * 60)
    controller = controller_with(costs, acceptance, cap=3)
    assert controller.start_step(cache_length=100, rows=1) >= 1
    # A chain goes on past a confident draft and ends after an unsure one; a row whose chain ended weighs nothing.
    assert controller.chain_end([[0.97, 0.02, 0.97]], [3]) == 2
    assert controller.chain_end([[0.97, 0.97, 0.97]], [3]) == 3
    assert controller.chain_end([[0.97, 0.97, 0.97]], [1]) == 1


def test_token_moments_match_an_enumeration_of_outcomes():
    # One row, drafts kept with probability 0.9 then 0.5: N = 0, 1, 2 kept drafts with probability 0.1, 0.45, 0.45.
    means, variances = token_moments(torch.ones(1, 0, dtype=torch.float64), [0.9, 0.5])
    assert means.tolist() == pytest.approx([1.0, 1.9, 2.35])
    assert variances.tolist() == pytest.approx([0.0, 0.9 * 0.1, (0.45 + 4 * 0.45) - 1.35**2])
    # Drafts already made (the prefix) count the same as ones still to come.
    made, _ = token_moments(torch.tensor([[0.9]], dtype=torch.float64), [0.5])
    assert made.tolist() == pytest.approx([1.9, 2.35])
    # The planner's shortcut, where the drafts made are all sure, gives the same moments summed over the rows.
    for rows, kept, tail in ((1, 0, [0.9, 0.5]), (8, 2, [0.7, 0.3, 0.05]), (32, 3, [])):
        means, variances = token_moments(torch.ones(rows, kept, dtype=torch.float64), tail)
        assert sure_moments(rows, kept, tail) == (pytest.approx(means.tolist()), pytest.approx(variances.tolist()))


def test_a_batch_counts_its_tokens_at_its_slowest_rows_pace():
    # Drafting one head kept 20% of the time, at 1.15x a plain step: one row gains 1.2 / 1.15. Eight rows with 64
    # tokens left lag: the slowest falls z = 1.42 standard deviations (0.4 * sqrt(64 / 1.2) tokens) behind the mean.
    costs, none = [1.0, 1.15], torch.ones(1, 0, dtype=torch.float64)
    assert best_depth(none, [0.2], costs, remaining=64) == 1
    assert best_depth(torch.ones(8, 0, dtype=torch.float64), [0.2], costs) == 1
    z = NormalDist().inv_cdf((8 - 0.375) / (8 + 0.25))
    assert 1.2 / (1 + z * (0.16 / (64 * 1.2)) ** 0.5) < 1.15  # by hand: 1.127 tokens per step
    assert best_depth(torch.ones(8, 0, dtype=torch.float64), [0.2], costs, remaining=64) == 0
    assert best_depth(torch.ones(8, 0, dtype=torch.float64), [0.2], costs, remaining=4096) == 1  # a long call


def test_a_chain_drafts_no_head_that_could_not_pay():
    # Head 0 is nearly always kept, the heads after it almost never: even were drafts before them kept, verifying
    # them costs more than they bring, so a chain drafts one head, not all three (each head's time counts).
    costs = filled_cost_model([1.0, 1.1, 1.2, 1.3], draft=0.01)
    acceptance = AcceptanceEstimate(3)
    confidences = torch.full((60, 3), 0.5, dtype=torch.float64)
    acceptance.record(confidences, [3] * 60, [1] * 60)
    controller = controller_with(costs, acceptance, cap=3)
    planned = controller.start_step(cache_length=100, rows=1)
    assert planned == 1 and controller.chain_depth(planned) == 1
    assert controller.step_costs() == pytest.approx([1.0, 1.11, 1.22, 1.33])


def test_cost_model_recovers_a_synthetic_cost_curve():
    costs = CostModel()
    curve = {m: 0.050 + 0.010 * m for m in (1, 2, 3, 5)}  # m = 4 never timed
    for repeat in range(9):
        for m, seconds in curve.items():
            # A slow spell now and then (a shared machine): the median ignores it.
            costs.record_verify(300, m, seconds * (5 if repeat % 4 == 0 else 1))
    for head, seconds in enumerate([0.004, 0.002]):
        for repeat in range(4):
            costs.record_draft(head, 0.5 if repeat == 0 else seconds)  # a head's first run pays one-time costs
    assert [costs.verify_cost(300, m) for m in (1, 2, 3, 5)] == pytest.approx(list(curve.values()))
    assert costs.verify_cost(300, 4) == pytest.approx(0.090)  # between the timed neighbours
    assert costs.verify_cost(300, 8) == pytest.approx(0.100)  # flat past the largest timed
    assert costs.verify_cost(5000, 2) == pytest.approx(0.070)  # from the nearest timed cache length
    assert (costs.draft_cost(0), costs.draft_cost(1), costs.draft_cost(3)) == pytest.approx((0.004, 0.002, 0.002))
    costs.record_draft(3, 0.5)  # left out: head 3 still costs what its nearest timed neighbour does
    assert costs.draft_cost(3) == pytest.approx(0.002)
    costs.record_draft(3, 0.003)
    assert costs.draft_cost(3) == pytest.approx(0.003)
    assert CostModel().verify_cost(300, 1) is None
    # A larger m timed cheaper than a smaller one (a quiet spell) costs at least as much as the smaller one.
    for m, seconds in ((1, 0.2), (3, 0.1)):
        costs.record_verify(10, m, 9.0)  # the first timing of a shape pays one-time costs: left out
        costs.record_verify(10, m, seconds)
    assert (costs.verify_cost(10, 1), costs.verify_cost(10, 3)) == (0.2, 0.2)
    assert (batch_bucket(1), batch_bucket(5), batch_bucket(8), cache_bucket(100), cache_bucket(600)) == (1, 8, 8, 0, 2)


def run_controller(controller, steps: int, seconds_of_depth) -> list[int]:
    """Runs `steps` steps of `controller` on a fake clock where a step of depth d takes `seconds_of_depth(d)`."""
    fake, chosen, original = {"now": 0.0}, [], time.perf_counter
    try:
        time.perf_counter = lambda: fake["now"]
        for _ in range(steps):
            depth = controller.start_step(cache_length=50, rows=1)
            fake["now"] += seconds_of_depth(depth)
            controller.end_step(controller.step, depth, seconds_of_depth(depth))
            chosen.append(depth)
    finally:
        time.perf_counter = original
    return chosen


def test_depths_are_timed_shallowest_first_while_one_could_pay_then_exploration_stays_within_its_share():
    costs = CostModel()
    controller = SpeculationController(lambda rows: costs, AcceptanceEstimate(2), cap=2)
    chosen = run_controller(controller, 400, lambda depth: 1.0 + depth)  # 1 s per token: only plain steps pay
    # Never-timed depths first, twice each: their first timings pay one-time costs and are left out. Depth 1 could pay
    # while only a plain step was timed (its prior: 1.5 tokens at a plain step's cost); depth 2 cannot at depth 1's
    # cost (1.75 tokens in 2 s), so it is never timed (a batch of 32 on a CPU spent 13 of 63 steps timing every depth).
    assert chosen[:4] == [0, 0, 1, 1] and 2 not in chosen
    explored = [d for d in chosen[4:] if d]  # exploration steps that drafted; each cost 1 + d seconds
    assert explored and sum(1.0 + d for d in explored) <= 0.02 * sum(1.0 + d for d in chosen)
    # Where verification is cheap (a GPU), each depth could pay at the deepest timed one's cost: all are timed.
    costs = CostModel()
    controller = SpeculationController(lambda rows: costs, AcceptanceEstimate(2), cap=2)
    assert run_controller(controller, 6, lambda depth: 1.0 + 0.01 * depth) == [0, 0, 1, 1, 2, 2]


def test_a_depth_left_untimed_is_timed_once_acceptance_says_it_could_pay():
    costs, acceptance = CostModel(), AcceptanceEstimate(2)
    controller = SpeculationController(lambda rows: costs, acceptance, cap=2)
    # Under the prior (each head kept half the time), depth 2 would bring 1.75 tokens for at least depth 1's 1.8 s.
    assert run_controller(controller, 8, lambda depth: 1.0 + 0.8 * depth) == [0, 0, 1, 1, 0, 0, 0, 0]
    # Both heads turn out nearly always right: depth 2 could now pay (2.9 tokens for at least 1.8 s).
    acceptance.record(torch.full((60, 2), 0.9, dtype=torch.float64), [2] * 60, [2] * 60)
    assert run_controller(controller, 2, lambda depth: 1.0 + 0.8 * depth) == [2, 2]


def test_a_depth_timed_only_on_trial_weights_is_tried_until_a_steady_timing_comes():
    # Measured at batch 8 on CPU: a depth's kept timings came only from the forwards that try both kinds of weights
    # on a new shape (205 ms against 112 ms for a plain step); they said it could not pay, so no step of 504 drafted.
    costs, acceptance = CostModel(), AcceptanceEstimate(1)
    acceptance.record([[0.95]] * 60, [1] * 60, [1] * 60)  # head 0 nearly always kept: 1.9 tokens a step
    controller = SpeculationController(lambda rows: costs, acceptance, cap=1)
    chosen = []
    for _ in range(12):
        depth = controller.start_step(cache_length=50, rows=1)
        trial = depth == 1 and chosen.count(1) < 2  # depth 1's first two forwards: one-time costs, trial weights
        controller.end_step(controller.step, depth, 2.0 if trial else 1.0 + 0.1 * depth, steady=not trial)
        chosen.append(depth)
    assert chosen == [0, 0] + [1] * 10  # before: [0, 0, 1, 1] then plain steps for good


def test_a_plain_step_timed_in_a_slow_spell_is_soon_timed_again():
    # Measured on a shared 2-core CPU at batch 8: the plain step's timings came from a slow spell (86 ms), the drafting
    # depths' from the quiet rest of the run (60 ms for a plain step), and the controller went on drafting at a loss.
    costs, acceptance = CostModel(), AcceptanceEstimate(2)
    acceptance.record(torch.full((50, 2), 0.5, dtype=torch.float64), [1] * 50, [0] * 10 + [1] * 40)  # head 0: 0.8
    true_cost = {0: 1.0, 1: 1.9, 2: 2.8}  # a drafting step loses: 1.8 tokens in 1.9 s
    for m, seconds in ((1, 2.4), (2, true_cost[1]), (3, true_cost[2])):  # m = 1 timed in the slow spell
        for _ in range(4):
            costs.record_verify(50, m, seconds)
    controller = SpeculationController(lambda rows: costs, acceptance, cap=2)
    chosen = run_controller(controller, 300, true_cost.get)
    assert chosen[0] > 0  # the stale timing makes drafting look better
    # A re-timing replaces timings older than `HORIZON` once three fresh ones (a median that ignores one outlier) are
    # in: the controller turns to plain steps after two re-timings of the plain step (before, it took five of sixteen).
    switch = "".join(map(str, chosen)).index("0" * 10)
    assert switch < 150
    # From there on, expected tokens per second (head 0 kept 86% of the time, head 1 half as often) within 2% of
    # plain decoding's 1 token per second: the depths not chosen are re-timed within the exploration share.
    tokens = {0: 1.0, 1: 1.86, 2: 1.86 + 0.86 * 0.5}
    later = chosen[switch:]
    assert sum(tokens[d] for d in later) / sum(true_cost[d] for d in later) >= 0.98
    assert costs.verify_cost(50, 1) == true_cost[0]


@pytest.fixture
def clock(monkeypatch):
    """`time.perf_counter` moved only by verifier forwards: `clock.forward(m)` seconds for m new tokens."""
    state = type("Clock", (), {"now": 0.0, "forward": staticmethod(lambda m: 1.0 + 0.1 * m)})()
    for cls in (LlamaForCausalLM, GPT2LMHeadModel):
        forward = cls.forward

        @functools.wraps(forward)
        def timed(self, *args, _forward=forward, **kwargs):
            state.now += state.forward((args[0] if args else kwargs["input_ids"]).shape[1])
            return _forward(self, *args, **kwargs)

        monkeypatch.setattr(cls, "forward", timed)
    monkeypatch.setattr(time, "perf_counter", lambda: state.now)
    # Under a clock that forwards alone move, every kind of weights times the same: no choice (tested apart).
    monkeypatch.setattr(generation, "adaptive_weights", contextlib.nullcontext)
    return state


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("rows", [1, 3])
def test_greedy_identical_with_the_controller_choosing(arch, rows, clock):
    verifier = make_verifier(arch)
    prompt = torch.cat([make_prompt(seed=2 + row) for row in range(rows)])
    mask = torch.ones_like(prompt)
    mask[1:, :3] = 0  # left padding on all rows but the first
    speculator = make_oracle(verifier, prompt, 30, wrong=lambda row, position, head: (row + position + head) % 4 == 3,
                             attention_mask=mask)  # fmt: skip
    kwargs = dict(attention_mask=mask, max_new_tokens=30, do_sample=False)
    expected = verifier.generate(prompt, **kwargs)
    for _ in range(2):  # the second call starts from the first one's timings and acceptance
        assert torch.equal(verifier.generate(prompt, assistant_model=speculator, **kwargs), expected)
    metrics = speculator.speculation_metrics
    # Cheap verification and mostly right drafts: the controller drafts, yet not always to full depth.
    assert sum(metrics.steps_by_depth[1:]) > metrics.steps_by_depth[0] and metrics.num_accepted_tokens > 0
    assert sum(metrics.steps_by_depth) == metrics.num_steps if rows == 1 else True


def test_controller_takes_plain_steps_for_a_random_speculator_on_an_expensive_verifier(clock):
    clock.forward = lambda m: float(m)  # k + 1 tokens cost k + 1 steps
    verifier, prompt = make_verifier(), make_prompt()
    speculator = make_speculator()
    expected = verifier.generate(prompt, max_new_tokens=40, do_sample=False)
    assert torch.equal(verifier.generate(prompt, max_new_tokens=40, do_sample=False, assistant_model=speculator),
                       expected)  # fmt: skip
    steps = speculator.speculation_metrics.steps_by_depth
    assert steps[0] >= 0.8 * sum(steps)


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("k", [1, 3])
def test_the_constant_schedule_drafts_k_every_step(rows, k, clock):
    """transformers' `num_assistant_tokens_schedule="constant"`, as vLLM's `num_speculative_tokens`: where the
    controller would take plain steps (random drafts, a verifier whose cost grows with every token), every step drafts
    k heads, fewer only in the last steps, where max_length leaves no room."""
    clock.forward = lambda m: float(m)
    verifier, prompt = make_verifier(), torch.cat([make_prompt(seed=2 + row) for row in range(rows)])
    speculator = make_speculator()
    kwargs = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=30, do_sample=False)
    expected = verifier.generate(prompt, **kwargs)
    output = verifier.generate(prompt, assistant_model=speculator, num_assistant_tokens=k,
                               num_assistant_tokens_schedule="constant", **kwargs)  # fmt: skip
    assert torch.equal(output, expected)
    steps = speculator.speculation_metrics.steps_by_depth
    assert len(steps) == k + 1 and steps[k] >= sum(steps) - k > 0


def test_sampling_stays_exact_under_the_constant_schedule():
    from test_sampling import SAMPLES, chi_square_p_value, exact_distribution, sample_counts, sharp_pair

    verifier, speculator = sharp_pair()
    counts, drafted, accepted = sample_counts(verifier, speculator, num_assistant_tokens_schedule="constant")
    assert 0 < accepted < drafted
    assert chi_square_p_value(counts, exact_distribution(verifier), SAMPLES) > 1e-3


def test_packed_weights_leave_the_model_as_it_was_and_never_go_stale():
    verifier = make_verifier()
    tokens = torch.randint(0, 96, (2, 7))
    with torch.no_grad():
        with fixed_layout(verifier, "packed"):
            assert all(type(m) is PackedLinear for m in verifier.modules() if isinstance(m, nn.Linear))
            first = verifier(tokens).logits
        assert not any(isinstance(m, PackedLinear) for m in verifier.modules())
        assert not any(hasattr(m, "packed_weight") for m in verifier.modules())
        torch.testing.assert_close(first, verifier(tokens).logits, rtol=1e-5, atol=1e-5)
        # New weights by load_state_dict (an in-place copy), then by an in-place edit: the packed copies follow.
        verifier.load_state_dict(make_verifier(seed=5).state_dict())
        verifier.model.layers[0].mlp.up_proj.weight.mul_(2)
        expected = verifier(tokens).logits
        with fixed_layout(verifier, "packed"):
            torch.testing.assert_close(verifier(tokens).logits, expected, rtol=1e-5, atol=1e-5)
    verifier.to(torch.bfloat16)  # a plain model again: any dtype change works
    assert next(verifier.parameters()).dtype == torch.bfloat16
    with adaptive_weights(verifier):  # bf16: not a model for packing
        verifier(tokens)
        assert not any(isinstance(m, PackedLinear) for m in verifier.modules())


def test_speculative_generate_with_packing_is_identical_and_unpacks(monkeypatch):
    verifier, prompt = make_verifier(), make_prompt()
    speculator = make_oracle(verifier, prompt, 20, wrong=lambda p, h: (p + h) % 3 == 2)
    expected = verifier.generate(prompt, max_new_tokens=20, do_sample=False)

    monkeypatch.setattr(generation, "adaptive_weights", adaptive_weights)  # conftest turns it off
    monkeypatch.setattr(WeightChoice, "choose", lambda self, shape: "packed")  # as where packing measured fastest
    seen = []
    forward = LlamaForCausalLM.forward

    def spy(self, *args, **kwargs):
        if kwargs.get("use_cache"):  # decoding, not the check that packed and plain weights agree
            seen.append(type(self.lm_head) is PackedLinear)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(LlamaForCausalLM, "forward", spy)
    output = verifier.generate(prompt, max_new_tokens=20, do_sample=False, assistant_model=speculator)
    assert torch.equal(output, expected) and seen and all(seen)
    assert not any(isinstance(m, PackedLinear) for m in verifier.modules())


def test_sampling_stays_exact_while_the_controller_varies_the_depth(clock):
    """Depths chosen from the confidences of earlier drafts leave the sampled distribution on the verifier's."""
    from test_sampling import SAMPLES, chi_square_p_value, exact_distribution, sample_counts, sharp_pair

    verifier, speculator = sharp_pair()
    counts, drafted, accepted = sample_counts(verifier, speculator)
    steps = speculator.speculation_metrics.steps_by_depth
    assert 0 < accepted < drafted and sum(1 for n in steps if n) >= 2  # drafts kept and rejected, at several depths
    assert chi_square_p_value(counts, exact_distribution(verifier), SAMPLES) > 1e-3


def test_measurements_belong_to_their_pair_and_die_with_it():
    """Kept by the verifier per speculator object, not per address: CPython reuses a freed model's id, and a new pair
    must not start from another's timings (a stale cost model once made a later test's controller never draft)."""
    verifier, speculator = make_verifier(), make_speculator()
    state = speculation_state(verifier, speculator)
    for seconds in (9.0, 5.0):  # the first timing of a shape is left out
        state.cost_model_for(1, "cpu", torch.float32).record_verify(10, 2, seconds)
    with adaptive_weights(verifier):
        verifier(torch.tensor([[1, 2]]))
    assert speculation_state(verifier, speculator) is state
    assert state.cost_model_for(1, "cpu", torch.float32).summary()["verify_seconds_by_new_tokens"] == {2: 5.0}
    assert not speculation_state(make_verifier(), speculator).cost_models  # another verifier
    assert not speculation_state(verifier, make_speculator()).cost_models  # another speculator
    assert state.cpu_weights.summary() and not cpu_weights(make_verifier()).summary()
    assert speculation_state(verifier, make_speculator()).cpu_weights is state.cpu_weights  # the verifier's own
    copied = copy.deepcopy(verifier)  # a copy may go to another device: it starts with nothing learned
    assert not speculation_state(copied, speculator).cost_models and not cpu_weights(copied).summary()
    state_ref, weights_ref = weakref.ref(state), weakref.ref(state.cpu_weights)
    del verifier, state, copied
    gc.collect()
    assert state_ref() is None and weights_ref() is None


def test_a_cost_model_without_timings_times_a_depth():
    """Steps that drafted from prompt lookup time nothing: a batch whose every step had a lookup row reaches the
    controller with every depth tried and none timed. It times one instead of failing."""
    costs = CostModel()
    for m in range(1, 4):
        costs.tried(100, m)
    controller = SpeculationController(lambda rows: costs, AcceptanceEstimate(2), cap=2)
    assert controller.start_step(cache_length=100, rows=2) in (0, 1, 2)
