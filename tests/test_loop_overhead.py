"""What the decoding loop costs the host around the verifier's forward: operations dispatched per step.

On a GPU, HF eager decoding is bound by the host launching kernels: each tensor operation the loop adds around the
verifier's forward costs a launch (or a view's dispatch), whatever the model's size. So the loop's cost is counted here
as the aten operations it dispatches outside the verifier's forward, per verifier forward, against plain `generate()`'s
own. Counts, unlike times, are exact on any machine. `benchmarks/loop_overhead.py` times the same on a dispatch-bound
model.
"""

import pytest
import torch
from conftest import make_prompt, make_speculator, make_verifier
from torch.utils._python_dispatch import TorchDispatchMode

from hf_mlp_speculator import FixedDepth, SpeculationState


class OperationCount(TorchDispatchMode):
    """Counts the aten operations dispatched outside `model`'s forward (`outside`) and inside it (`inside`)."""

    def __init__(self, model):
        super().__init__()
        self.model, self.depth, self.outside, self.inside = model, 0, 0, 0

    def __enter__(self):
        self.hooks = [self.model.register_forward_pre_hook(lambda *args: self._enter_forward(1)),
                      self.model.register_forward_hook(lambda *args: self._enter_forward(-1))]  # fmt: skip
        return super().__enter__()

    def __exit__(self, *args):
        for hook in self.hooks:
            hook.remove()
        return super().__exit__(*args)

    def _enter_forward(self, change):
        self.depth += change

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.depth:
            self.inside += 1
        else:
            self.outside += 1
        return func(*args, **(kwargs or {}))


def operations_per_forward(depth: int | None, rows: int = 1, **kwargs) -> float:
    """Operations outside the verifier's forward per decode step of a greedy call (plain where `depth` is None)."""
    verifier, speculator = make_verifier(), make_speculator(n_predict=4)
    prompts = torch.cat([make_prompt(seed=row) for row in range(rows)])
    counts = []
    for new_tokens in (4, 36):
        options = dict(attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens, do_sample=False, **kwargs)
        if depth is not None:
            options.update(assistant_model=speculator, num_assistant_tokens=max(depth, 1),
                           num_assistant_tokens_schedule="constant" if depth else "heuristic")  # fmt: skip
        with OperationCount(verifier) as count:
            verifier.generate(prompts, **options)
        forwards = new_tokens - 1 if depth is None else sum(speculator.speculation_metrics.steps_by_depth)
        counts.append((count.outside, forwards))
    (a, fa), (b, fb) = counts
    return (b - a) / (fb - fa)


@pytest.mark.parametrize("rows", [1, 3])
def test_a_plain_step_costs_no_more_than_plain_generate(rows, monkeypatch):
    """A step that drafts nothing dispatches no more operations than a step of plain `generate()`."""
    monkeypatch.setattr(SpeculationState, "policy", FixedDepth(0))
    plain = operations_per_forward(None, rows)
    assert operations_per_forward(0, rows) <= plain, plain


@pytest.mark.parametrize("rows", [1, 3])
def test_a_drafting_step_costs_its_heads_and_little_more(rows):
    """
    A depth-4 chain step dispatches its heads' operations (20 each: projection, embedding, norm, activation, head,
    argmax and the draft's confidence), two views per layer of the model to crop rejected drafts from the cache (a
    random speculator's drafts are all rejected), and at most 25 more than a plain step: the verifier's inputs, the
    acceptance, the one read of the device.
    """
    plain, heads, crop = operations_per_forward(None, rows), 4 * 20, 2 * make_verifier().config.num_hidden_layers
    assert operations_per_forward(4, rows) <= plain + heads + crop + 25, plain
