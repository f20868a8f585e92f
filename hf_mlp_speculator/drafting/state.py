"""What speculative `generate()` learns about a verifier/speculator pair, kept for the pair's later calls.

A call measures as it decodes: how often each head's drafts are accepted (per kind of drafts: greedy chains, sampled
chains, trees), what a verifier forward and a draft head cost (per device, dtype and batch bucket of the verifier, with
the share of decoding time spent exploring), and, on CPU, which kind of weights each forward shape runs fastest on
(plain, transposed or packed, with the copies). A later call of the same pair starts from what the earlier ones
measured instead of measuring again: its first steps already draft as deep as pays.

All of it lives in the pair's `SpeculationState`, which the verifier holds, weakly keyed by the speculator: it goes
away with either model, and no module keeps any of it. The CPU weight choice belongs to the verifier alone (plain
decoding under `fast_cpu_decoding` shares it), so every pair of one verifier sees the same one. A copied or pickled
model starts with nothing learned. What a call keeps to itself: its metrics (on `speculator.speculation_metrics`), its
per-call counts of depths and timings, its sampling seed and prompt lookup's scores.

```python
>>> from hf_mlp_speculator import FixedDepth, speculation_state
>>> state = speculation_state(model, speculator)
>>> print(state.summary())    # what the pair measured so far
>>> state.reset()             # start over, as a new pair would
>>> state.policy = FixedDepth(3)  # every step drafts 3 heads, whatever the measurements say
```
"""

import weakref
from dataclasses import dataclass

from ..cpu.weight_layouts import CpuWeights, cpu_weights
from .controller import AcceptanceEstimate
from .cost_model import CostModel, batch_bucket
from .drafts import DraftKind


@dataclass(frozen=True)
class FixedDepth:
    """
    A depth policy: every step drafts `depth` heads (all the heads the call allows where None, none at 0), whatever
    the pair measured. The cost-aware controller (the default, `policy = None`) chooses each step's depth from the
    pair's measurements, which depend on the machine's timings; a fixed depth gives the same steps on every run, as
    tests and benchmarks of the decoding loop want. Output is the same either way.
    """

    depth: int | None = None

    def __post_init__(self):
        whole = isinstance(self.depth, int) and not isinstance(self.depth, bool)
        if self.depth is not None and (not whole or self.depth < 0):
            raise ValueError(f"FixedDepth({self.depth!r}): give a whole number of heads, 0 or more, or None for all.")


class SpeculationState:
    """
    Everything a verifier/speculator pair's calls learn and reuse (see the module docstring): `acceptance`
    (`DraftKind` -> `AcceptanceEstimate`), `cost_models` ((device, dtype, batch bucket) -> `CostModel`), the verifier's
    `cpu_weights`, and the depth `policy`. `speculation_state(verifier, speculator)` returns a pair's.
    """

    # The depth policy of every state that sets none of its own: None, the cost-aware controller, or a `FixedDepth`.
    policy: FixedDepth | None = None

    def __init__(self, cpu_weights: CpuWeights, names: tuple[str, str] = ("verifier", "speculator")):
        self.cpu_weights, self.names = cpu_weights, names
        self.acceptance: dict[DraftKind, AcceptanceEstimate] = {}
        self.cost_models: dict[tuple, CostModel] = {}

    def __deepcopy__(self, memo):
        return SpeculationState(CpuWeights(), self.names)

    def acceptance_for(self, kind: DraftKind, num_heads: int) -> AcceptanceEstimate:
        """The running acceptance estimate of `kind` of drafts."""
        if kind not in self.acceptance:
            self.acceptance[kind] = AcceptanceEstimate(num_heads)
        return self.acceptance[kind]

    def cost_model_for(self, batch_size: int, device, dtype) -> CostModel:
        """The cost model of the verifier on `device` in `dtype`, for batches of about `batch_size` rows."""
        key = (str(device), str(dtype), batch_bucket(batch_size))
        if key not in self.cost_models:
            self.cost_models[key] = CostModel()
        return self.cost_models[key]

    def reset(self) -> None:
        """Forgets everything measured (acceptance, costs, the verifier's CPU weight choice); keeps the policy."""
        self.acceptance.clear()
        self.cost_models.clear()
        self.cpu_weights.reset()

    def summary(self) -> str:
        """What the pair measured so far, one line per estimate."""
        verifier, speculator = self.names
        policy = "cost-aware"
        if self.policy is not None:
            policy = f"{'all' if self.policy.depth is None else self.policy.depth} heads every step"
        lines = [f"Speculation state of {verifier} with {speculator} (depth policy: {policy})"]
        for kind, estimate in self.acceptance.items():
            heads = ", ".join(f"{mean:.2f}" for mean in estimate.means())
            weight = estimate.drafted[0].sum()
            lines.append(f"  acceptance, {kind.value}: per head {heads} (head 0 weighs {weight:.0f} recent drafts)")
        for (device, dtype, bucket), cost_model in self.cost_models.items():
            costs = cost_model.summary()
            verify = ", ".join(f"{m}: {s * 1e3:.2f}" for m, s in costs["verify_seconds_by_new_tokens"].items())
            heads = ", ".join(f"{s * 1e3:.2f}" for s in costs["draft_seconds_by_head"].values())
            explored = f"{cost_model.exploring_seconds:.2f} of {cost_model.total_seconds:.2f} s"
            lines.append(f"  cost on {device} {dtype}, batch <= {bucket}: verify ms by new tokens {{{verify}}}; "
                         f"head ms [{heads}]; explored {explored}")
        for shape, fastest in self.cpu_weights.summary().items():
            chosen = self.cpu_weights.choice.chosen(shape) or "still trying each"
            kinds = ", ".join(f"{kind} {_ms(seconds)}" for kind, seconds in fastest.items())
            lines.append(f"  CPU weights, batch <= {shape[0]} x {shape[1]} tokens: runs {chosen}; best recent forward "
                         f"{kinds}")
        if len(lines) == 1:
            lines.append("  nothing measured yet")
        return "\n".join(lines)

    __repr__ = summary


def _ms(seconds: float | None) -> str:
    return "untimed" if seconds is None else f"{seconds * 1e3:.2f} ms"


class _PairStates(weakref.WeakKeyDictionary):
    """speculator -> `SpeculationState`, held by the verifier. A copied or pickled verifier starts with none."""

    def __deepcopy__(self, memo):
        return _PairStates()

    def __reduce__(self):
        return _PairStates, ()


def speculation_state(verifier, speculator) -> SpeculationState:
    """The `SpeculationState` of `verifier` drafting with `speculator`, made on first use; held by the verifier."""
    states = getattr(verifier, "_speculation_states", None)
    if states is None:
        states = verifier._speculation_states = _PairStates()
    if speculator not in states:
        names = (type(verifier).__name__, type(speculator).__name__)
        states[speculator] = SpeculationState(cpu_weights(verifier), names)
    return states[speculator]
