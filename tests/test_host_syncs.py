"""How often decoding makes a GPU wait for the host: reads of device values and tensors built from host values.

On CUDA each `.tolist()`, `.item()`, `.cpu()`, `int(t)` / `bool(t)` / `float(t)` / `t.__index__()` of a tensor, and each
`torch.tensor(..., device=...)`, waits for all queued work. On CPU nothing waits, but the same calls happen: counting
them here, per verifier forward, is the count a GPU would pay. Only calls made by this package count; transformers'
own loop (batch 1) makes its own, reported apart.
"""

import sys

import pytest
import torch
from conftest import make_prompt, make_speculator, make_verifier
from torch.overrides import TorchFunctionMode

from hf_mlp_speculator import FixedDepth, MLPSpeculatorCandidateGenerator, SpeculationState

READS = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"}
BUILDS = {"tensor", "as_tensor"}
PACKAGE = "hf_mlp_speculator"


class HostSyncs(TorchFunctionMode):
    """Counts, by `file:line`, the calls above made from this package's code (`ours`) and from elsewhere (`others`)."""

    def __init__(self):
        super().__init__()
        self.ours, self.others = {}, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in READS or (name in BUILDS and kwargs.get("device") is not None):
            caller = sys._getframe(1).f_code
            if f"/{PACKAGE}/" in caller.co_filename:
                where = f"{caller.co_filename.split(f'/{PACKAGE}/')[1]}:{caller.co_name} {name}"
                self.ours[where] = self.ours.get(where, 0) + 1
            else:
                self.others += 1
        return func(*args, **kwargs)


def transformers_hands_a_tensor() -> bool:
    """
    Whether this transformers' assisted decoding passes the number of accepted drafts to the candidate generator as a
    tensor (before 5.18 or so), which the generator must then read on the host each step: a sync of transformers'
    making, one per step at batch 1.
    """
    seen = []
    original = MLPSpeculatorCandidateGenerator.update_candidate_strategy

    def recording(self, input_ids, scores, num_matches):
        seen.append(isinstance(num_matches, torch.Tensor))
        return original(self, input_ids, scores, num_matches)

    MLPSpeculatorCandidateGenerator.update_candidate_strategy = recording
    try:
        verifier, prompt = make_verifier(), make_prompt()
        verifier.generate(prompt, max_new_tokens=3, assistant_model=make_speculator(n_predict=3), do_sample=False)
    finally:
        MLPSpeculatorCandidateGenerator.update_candidate_strategy = original
    return any(seen)


def count_syncs(rows: int, max_new_tokens: int = 30, **generate_kwargs):
    """(our syncs, verifier forwards, where they were, transformers' syncs) of one speculative `generate()` call."""
    verifier, speculator = make_verifier(), make_speculator(n_predict=3)
    prompts = torch.cat([make_prompt(seed=row) for row in range(rows)])
    forwards = []
    verifier.register_forward_hook(lambda *args: forwards.append(1))
    with HostSyncs() as syncs:
        verifier.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=max_new_tokens,
                          assistant_model=speculator, **generate_kwargs)  # fmt: skip
    return sum(syncs.ours.values()), len(forwards), syncs.ours, syncs.others


# Syncs per verifier forward, and per call (the prompt read once, the seed, rows leaving the batch as they finish).
CASES = {
    "batch 1, chain": (1, {}, 1),
    "batch 3, chain": (3, {}, 1),
    "batch 1, sampled": (1, {"do_sample": True}, 1),
    "batch 3, sampled": (3, {"do_sample": True}, 1),
    "batch 3, tree": (3, {"n_candidates": 3}, 3),  # merged on the host: its candidates back, its nodes out
    "batch 1, hybrid": (1, {"prompt_lookup_num_tokens": 3}, 3),  # the emitted text back, lookup drafts out
    "batch 3, hybrid": (3, {"prompt_lookup_num_tokens": 3}, 2),  # lookup drafts out
}
PER_CALL = 2


@pytest.mark.parametrize("case", list(CASES))
def test_syncs_per_step_within_budget(case):
    """Every step drafts all heads here (the tests' fixture): one read per step, after the verifier."""
    rows, kwargs, per_step = CASES[case]
    ours, forwards, where, _ = count_syncs(rows, **kwargs)
    assert forwards > 10
    if rows == 1 and "do_sample" not in kwargs and transformers_hands_a_tensor():  # transformers' loop
        per_step += 1
    assert ours <= per_step * forwards + PER_CALL + rows, where


@pytest.mark.parametrize("case", ["batch 1, chain", "batch 3, chain", "batch 1, sampled", "batch 3, tree"])
@pytest.mark.parametrize("depth", [0, 3])
def test_a_step_reads_the_device_at_most_four_times_transformers_own_reads_included(case, depth, monkeypatch):
    """
    Every read of a device value per verifier forward, whoever makes it (the model's forward, transformers'
    generation code, this package), on whatever transformers is installed: before 5.18 transformers' own assisted
    decoding read the device once per cache layer per step (71 times a step on a 32-layer model), which is why calls
    run in this package's loop by default.
    """
    if depth == 0:
        monkeypatch.setattr(SpeculationState, "policy", FixedDepth(0))
    rows, kwargs, _ = CASES[case]
    ours, forwards, where, others = count_syncs(rows, **kwargs)
    assert ours + others <= 4 * forwards + PER_CALL + rows, (where, others)


@pytest.mark.cost_aware
@pytest.mark.parametrize("rows", [1, 3])
def test_cost_aware_chains_read_their_confidences_once_per_step(rows):
    """The controller ends a chain by its drafts' confidences: at most one more read per step, never one per head."""
    torch.manual_seed(0)
    ours, forwards, where, _ = count_syncs(rows, max_new_tokens=40)
    per_step = 2 + (rows == 1 and transformers_hands_a_tensor())
    assert ours <= per_step * forwards + PER_CALL + rows, where


def test_no_device_wide_synchronize(monkeypatch):
    """Timings come from CUDA events read when ready, never from `torch.cuda.synchronize()`."""
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: calls.append(1))
    count_syncs(3)
    count_syncs(1)
    assert calls == []


def test_cuda_timings_are_read_when_the_device_has_passed_them(monkeypatch):
    """On CUDA the stopwatch records events and hands a timing over only once its end event has completed, in order;
    it waits for the device only when told to (at the end of a call)."""
    from hf_mlp_speculator.drafting.stopwatch import Stopwatch

    class FakeEvent:
        clock, done_until = 0.0, 0.0  # the device's time, and how far it has run
        waits = []

        def __init__(self, enable_timing):
            assert enable_timing

        def record(self, stream):
            assert stream == "stream of cuda"  # the model's device's, not the current device's
            FakeEvent.clock += 1.0
            self.at = FakeEvent.clock

        def query(self):
            return self.at <= FakeEvent.done_until

        def synchronize(self):
            if not self.query():
                FakeEvent.waits.append(self.at)
                FakeEvent.done_until = self.at

        def elapsed_time(self, end):
            return (end.at - self.at) * 1000  # milliseconds

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: f"stream of {device}")
    stopwatch, seen = Stopwatch("cuda"), []
    for _ in range(3):
        stopwatch.report(stopwatch.stop(stopwatch.start()), seen.append)
    assert seen == []  # the device has run none of it yet: nothing read, nothing waited for
    FakeEvent.done_until = 4.0  # the first two timings' work is done
    stopwatch.poll()
    assert seen == [1.0, 1.0] and FakeEvent.waits == []
    stopwatch.poll(wait=True)
    assert seen == [1.0, 1.0, 1.0] and FakeEvent.waits == [6.0]
