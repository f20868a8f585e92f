"""The metric arithmetic, and how a generate() call reports it."""

import logging

import pytest
from conftest import make_oracle, make_prompt, make_verifier
from transformers.utils import logging as hf_logging

from hf_mlp_speculator import SpeculationMetrics


def test_metric_arithmetic():
    metrics = SpeculationMetrics(num_speculative_tokens=3)
    for drafted, accepted in [(3, 3), (3, 0), (3, 1), (2, 2), (0, 0)]:
        metrics.record_step(drafted, accepted)
    assert (metrics.num_steps, metrics.num_draft_tokens, metrics.num_accepted_tokens) == (5, 11, 6)
    assert metrics.num_emitted_tokens == 11 and metrics.max_emitted_tokens == 16
    assert metrics.draft_acceptance_rate == pytest.approx(6 / 11)
    # vLLM's system efficiency divides by steps x (configured k + 1); the verified positions were 16.
    assert metrics.system_efficiency == pytest.approx(11 / (5 * 4))
    assert metrics.verified_efficiency == pytest.approx(11 / 16)
    assert metrics.mean_tokens_per_step == pytest.approx(11 / 5)
    assert metrics.head_draft_tokens == [4, 4, 3]
    assert metrics.head_accepted_tokens == [3, 2, 1]
    assert metrics.head_acceptance_rates == pytest.approx([3 / 4, 2 / 4, 1 / 3])


def test_empty_metrics_are_zero_not_nan():
    metrics = SpeculationMetrics()
    assert (metrics.draft_acceptance_rate, metrics.system_efficiency, metrics.mean_tokens_per_step) == (0, 0, 0)


def test_generate_leaves_metrics_on_the_speculator_and_logs_them(caplog):
    verifier, prompt = make_verifier(), make_prompt()
    speculator = make_oracle(verifier, prompt, 20, n_predict=3, wrong=lambda p, h: h == 2)
    hf_logging.set_verbosity_info()
    hf_logging.enable_propagation()
    try:
        with caplog.at_level(logging.INFO, logger="hf_mlp_speculator"):
            verifier.generate(prompt, max_new_tokens=20, do_sample=False, assistant_model=speculator)
    finally:
        hf_logging.disable_propagation()
        hf_logging.set_verbosity_warning()
    metrics = speculator.speculation_metrics
    # Heads 0 and 1 are always right and head 2 always wrong: every full step emits 3 tokens.
    assert metrics.num_emitted_tokens == 19
    assert metrics.head_acceptance_rates[:2] == [1.0, 1.0] and metrics.head_acceptance_rates[2] == 0.0
    assert metrics.mean_tokens_per_step == pytest.approx(19 / metrics.num_steps)
    logged = [r.getMessage() for r in caplog.records if r.name == "hf_mlp_speculator.generation.mixin"]
    assert logged == [str(metrics)]
    assert logged[0].startswith("Speculative metrics: Draft acceptance rate: ")
    assert "System efficiency: " in logged[0] and "Number of emitted tokens: 19" in logged[0]
    assert "Steps by drafts verified: [" in logged[0] and "Verify ms by k: [" in logged[0]


def test_each_call_starts_fresh_metrics():
    verifier, prompt = make_verifier(), make_prompt()
    speculator = make_oracle(verifier, prompt, 10)
    verifier.generate(prompt, max_new_tokens=10, do_sample=False, assistant_model=speculator)
    first = speculator.speculation_metrics
    verifier.generate(prompt, max_new_tokens=10, do_sample=False, assistant_model=speculator)
    assert speculator.speculation_metrics is not first
    again = speculator.speculation_metrics
    # The same tokens, drafts and depths; only the measured seconds differ between the calls.
    assert (again.num_steps, again.num_draft_tokens, again.num_accepted_tokens, again.steps_by_depth) == (
        first.num_steps, first.num_draft_tokens, first.num_accepted_tokens, first.steps_by_depth)
    assert sum(first.steps_by_depth) == first.num_steps
