"""How many drafts each speculative step verifies: the depth that maximises the expected tokens per second.

Each step the controller weighs what a deeper draft is expected to bring (the acceptance it has observed per head,
sharpened by the speculator's confidence in each draft already made) against what it costs (the cost model's timings
of the verifier forward and the draft heads). Depth 0 is a plain decoding step, taken wherever drafts do not pay.

A chain's depth is chosen in two moves, so that a GPU never waits on the host between heads: before drafting,
`start_step` plans from the acceptance observed so far (0: a plain step); the heads then draft as deep as any chain
could pay (were every draft before a head kept), and `chain_end` reads all their confidences in one transfer and ends
the chain at the first head `j` where going on would not pay, judged from drafts `0 .. j - 1` alone. So whether a
draft is verified never depends on its own value, the verifier sees drafts drawn from exactly the distribution they
are divided by, and sampling stays exact. The plan counts every head drafted: on a CPU a head costs a few percent of a
verifier forward, which decides a close call.

Everything here runs on the host, in Python and numpy: timings arrive as floats, confidences as lists.
"""

import functools
import math
import time
from dataclasses import dataclass, field
from itertools import accumulate
from statistics import NormalDist

import numpy as np

from .cost_model import CostModel

# Acceptance is tracked per head and per bin of the speculator's confidence in its draft.
CONFIDENCE_BINS = 5
# Weight of the prior, which expects a draft to be accepted as often as the speculator's confidence in it says.
PRIOR_WEIGHT = 1.0
# Each observation of a head discounts its older ones by this factor (about the last 50 steps count).
DECAY = 0.98
# Share of the time spent decoding (per cost model, for the process: a short call alone never has room for one) that
# may go to steps the controller would not choose, to refresh its estimates: without them a head whose acceptance
# looked poor, or a depth timed on a slow spell (see `cost_model.HORIZON`), would never be tried again.
EXPLORATION_SHARE = 0.02


def token_moments(prefix, tail_acceptance: list[float], open_rows=None) -> tuple[np.ndarray, np.ndarray]:
    """
    The mean and variance of the tokens a step emits, per depth `d = j .. j + len(tail_acceptance)`, each summed over
    rows, when `prefix[r, l - 1]` is the probability that row `r`'s drafts `1 .. l` are all accepted (`l <= j`) and
    draft `l > j` is accepted with probability `tail_acceptance[l - j - 1]` once the drafts before it were. Rows not in
    `open_rows` draft no further (their chain ended at an unsure draft or at the length limit).
    """
    prefix = np.asarray(prefix, dtype=np.float64)
    rows, j = prefix.shape
    # A row keeps N = sum_l [drafts 1 .. l all kept] drafts: E[N] = sum_l q_l and E[N^2] = sum_l (2l - 1) q_l.
    first, second = prefix.sum(axis=1), prefix @ (2.0 * np.arange(1, j + 1) - 1)
    reach = prefix[:, -1].copy() if j else np.ones(rows)
    if open_rows is not None:
        reach = reach * np.asarray(open_rows, dtype=np.float64)
    means, variances = [rows + first.sum()], [(second - first**2).sum()]
    for depth, rate in enumerate(tail_acceptance, start=j + 1):
        reach = reach * rate
        first, second = first + reach, second + (2 * depth - 1) * reach
        means.append(rows + first.sum())
        variances.append((second - first**2).sum())
    return np.array(means), np.array(variances)


def expected_tokens(prefix, tail_acceptance: list[float], open_rows=None) -> np.ndarray:
    """The mean of `token_moments`: expected tokens a step emits per depth, summed over rows."""
    return token_moments(prefix, tail_acceptance, open_rows)[0]


def sure_moments(rows: int, kept: int, tail_acceptance: list[float]) -> tuple[list[float], list[float]]:
    """
    `token_moments` where every row's first `kept` drafts are sure to be kept and every chain is open, in plain
    Python: a step plans with it several times, and numpy's per-call cost is most of the work on such small arrays.
    """
    first, second, reach = float(kept), float(kept * kept), 1.0  # sum_l (2l - 1) over l = 1 .. kept is kept ** 2
    means, variances = [rows * (1 + first)], [0.0]
    for depth, rate in enumerate(tail_acceptance, start=kept + 1):
        reach *= rate
        first, second = first + reach, second + (2 * depth - 1) * reach
        means.append(rows * (1 + first))
        variances.append(rows * (second - first * first))
    return means, variances


@functools.lru_cache
def slowest_row_lag(rows: int) -> float:
    """The expected largest of `rows` standard normal draws (Blom's approximation)."""
    return NormalDist().inv_cdf((rows - 0.375) / (rows + 0.25))


def best_of(tokens, variances, step_costs, rows: int, remaining: int | None = None) -> int:
    """
    The index of the best of depths whose step emits `tokens` (with `variances`, summed over `rows` rows) and costs
    `step_costs` seconds: the most tokens per second, the shallowest of a tie (deeper costs memory for nothing).

    A batch's call ends with its slowest row. Rows that draft advance by different counts, and with `remaining` tokens
    left per row the slowest of `rows` falls about `z` standard deviations of a row's total behind the mean (`z` the
    expected largest of `rows` standard normal draws), so its tokens count at the mean rate slowed by that lag.
    Measured on 8 rows at 1.2 tokens per step and 64 new tokens: 61 steps where the mean rate says 55. A plain step
    has no lag.
    """
    if rows > 1 and remaining:
        # Per row, over n = remaining / mean steps, the slowest lags z * sqrt(n * variance) tokens, which take it
        # z * sqrt(variance / (remaining * mean)) of those n steps more; the rows' sums give the same ratio.
        z = slowest_row_lag(rows)
        tokens = [t / (1 + z * math.sqrt(max(float(v), 0.0) / (remaining * t))) for t, v in zip(tokens, variances)]
    rates = [float(t) / c if c > 0 else math.inf for t, c in zip(tokens, step_costs)]
    best = max(rates)
    return next(d for d, rate in enumerate(rates) if rate >= best * (1 - 1e-9))


def best_depth(prefix, tail_acceptance, step_costs, open_rows=None, remaining: int | None = None) -> int:
    """
    The depth `d >= j` (`j = prefix.shape[1]`, drafts already made) that maximises expected tokens /
    `step_costs[d - j]`, the seconds of a step that ends at depth `d`, with the rows' moments of `token_moments` (see
    `best_of`).
    """
    rows, made = np.shape(prefix)
    return made + best_of(*token_moments(prefix, tail_acceptance, open_rows), step_costs, rows, remaining)


class AcceptanceEstimate:
    """Running conditional acceptance per (head, confidence bin): draft `h` accepted given drafts `< h` were."""

    def __init__(self, num_heads: int):
        self.accepted = np.zeros((num_heads, CONFIDENCE_BINS))
        self.drafted = np.zeros((num_heads, CONFIDENCE_BINS))
        self.prior = (np.arange(CONFIDENCE_BINS) + 0.5) / CONFIDENCE_BINS

    @staticmethod
    def bins(confidence) -> np.ndarray:
        return np.clip((np.asarray(confidence, dtype=np.float64) * CONFIDENCE_BINS).astype(np.int64), 0,
                       CONFIDENCE_BINS - 1)  # fmt: skip

    @staticmethod
    def bin(confidence: float) -> int:
        """`bins` of one confidence, in plain Python: recording a step asks for a few, every step."""
        return min(max(int(confidence * CONFIDENCE_BINS), 0), CONFIDENCE_BINS - 1) if confidence == confidence else 0

    def given(self, head: int, confidence) -> np.ndarray:
        """Per row: probability that draft `head`, made with `confidence`, is accepted after its predecessors were."""
        b = self.bins(confidence)
        return (self.accepted[head, b] + PRIOR_WEIGHT * self.prior[b]) / (self.drafted[head, b] + PRIOR_WEIGHT)

    def means(self) -> list[float]:
        """
        Per head, the same before the draft is made: over the confidences seen so far (the prior's mean, 0.5, before
        any).
        """
        return ((self.accepted.sum(axis=1) + 0.5 * PRIOR_WEIGHT) / (self.drafted.sum(axis=1) + PRIOR_WEIGHT)).tolist()

    def prefix(self, confidences) -> np.ndarray:
        """`[r, l - 1]`: the chance that row `r`'s drafts `1 .. l`, made with `confidences[r, :l]`, are all kept."""
        confidences = np.asarray(confidences, dtype=np.float64).reshape(len(confidences), -1)
        columns = [self.given(head, confidences[:, head]) for head in range(confidences.shape[1])]
        if not columns:
            return np.ones((len(confidences), 0))
        return np.cumprod(np.stack(columns, axis=1), axis=1)

    def record(self, confidences, num_drafted, num_accepted) -> None:
        """Row `r` drafted `num_drafted[r]` tokens with `confidences[r]`, and the first `num_accepted[r]` were kept."""
        for row, (drafted, accepted) in enumerate(zip(num_drafted, num_accepted)):
            for head in range(min(int(drafted), int(accepted) + 1)):  # a head counts only where its predecessors held
                b = self.bin(confidences[row][head])
                self.accepted[head] *= DECAY
                self.drafted[head] *= DECAY
                self.drafted[head, b] += 1
                self.accepted[head, b] += float(head < accepted)


@dataclass
class StepPlan:
    """
    What a step's timings are recorded against (the cache length and cost model it ran at, and its forced depth), and
    what its plan read, once for the step: the acceptance means per head, the verifier's cost per depth (None while a
    depth has no timing to go on) and the cost of drafting `h` heads for each `h`.
    """

    cache_length: int
    cost_model: CostModel
    forced: int | None = None  # the depth of a timing or exploration step
    heads: int = 0  # the heads a chain of this step drafts (`chain_depth`), where more than its depth
    remaining: int | None = None  # the most tokens any row still has to emit
    means: list[float] = field(default_factory=list)
    verify: list[float] | None = None
    drafting: list[float] = field(default_factory=list)


class SpeculationController:
    """
    Chooses the depth of each step (see the module docstring) for one `generate()` call. `new_tokens(d)` is the
    verifier's new tokens per row at depth `d`: `d + 1` for a chain, the node count for a tree. `cap` is the most
    heads that may draft (`num_assistant_tokens`). Per step: `start_step` gives the planned depth (0: a plain step)
    and `chain_depth` how deep a chain drafts; `chain_end` (where `cuts`) ends the chain by its drafts' confidences;
    `record_drafts` and `end_step` record the timings of the heads and of the verifier's forward, whenever they
    arrive; and `acceptance.record` what the verifier kept.
    """

    def __init__(self, cost_models, acceptance: AcceptanceEstimate, cap: int, new_tokens=None,
                 fixed_depth: int | None = None):  # fmt: skip
        # `cost_models(rows)`: the cost model for a batch of `rows` (rows leave a batch as they finish).
        # `new_tokens` given: a tree's, drafted exactly as deep as planned; else chains, drafted as deep as may pay.
        self.chains = new_tokens is None
        self.cost_models, self.acceptance, self.cap = {}, acceptance, cap
        self.new_tokens = (lambda d: d + 1) if new_tokens is None else new_tokens
        self.cost_model_for = cost_models
        # A fixed depth (the "constant" schedule, or a pair's `FixedDepth` policy) drafts that many heads every step,
        # as vLLM's `num_speculative_tokens` does; None: cost-aware.
        self.fixed_depth = None if fixed_depth is None else min(fixed_depth, cap)
        self.step = None
        self.depth_counts = [0] * (cap + 1)
        self.verify_seconds = [0.0] * (cap + 1)
        self.draft_runs, self.draft_seconds = [0] * cap, [0.0] * cap
        self.step_start = None

    def step_costs(self, depth: int = 0) -> list[float] | None:
        """Seconds of this step ending at each depth `depth .. cap`; None while a depth has no timing to go on."""
        step = self.step
        if step.verify is None:
            return None
        return [v + (step.drafting[max(d, step.heads)] if d else 0.0) for d, v in enumerate(step.verify) if d >= depth]

    def start_step(self, cache_length: int, rows: int, remaining: int | None = None) -> int:
        """
        The depth planned for this step, for `rows` rows on a cache of `cache_length` tokens, the furthest from its end
        `remaining` tokens away; 0: no drafts.
        """
        now = time.perf_counter()
        if self.step_start is not None:  # the exploration share is kept for the process, per cost model
            self.step.cost_model.total_seconds += now - self.step_start
        self.step_start = now
        if rows not in self.cost_models:
            self.cost_models[rows] = self.cost_model_for(rows)
        cost_model = self.cost_models[rows]
        step = self.step = StepPlan(cache_length, cost_model, remaining=remaining)
        if self.fixed_depth is not None:
            step.forced = self.fixed_depth
            return self.fixed_depth
        step.means = self.acceptance.means()
        verify = [cost_model.verify_cost(cache_length, self.new_tokens(d)) for d in range(self.cap + 1)]
        step.verify = None if None in verify else verify
        step.drafting = list(accumulate((cost_model.draft_cost(h) for h in range(self.cap)), initial=0.0))
        plain = self.step_costs()  # a forced step drafts exactly its depth, so it costs what these say
        planned = 0
        if plain is not None:
            if self.chains:
                step.heads = self._reach(rows)
            planned = best_of(*sure_moments(rows, 0, step.means), self.step_costs(), rows, remaining)
        step.forced = self._forced_depth(planned, plain)
        return planned if step.forced is None else step.forced

    def chain_depth(self, planned: int) -> int:
        """How many heads a chain drafts this step: none for a plain step, else as deep as `chain_end` may keep."""
        if planned == 0:
            return 0
        return self.step.forced if self.step.forced is not None else max(planned, self.step.heads)

    def _reach(self, rows: int) -> int:
        """The deepest a chain may pay to go: past head `j` only where it would pay were drafts `< j` all kept."""
        step = self.step
        for j in range(1, self.cap):
            if best_of(*sure_moments(rows, j, step.means[j:]), self.step_costs(j), rows, step.remaining) == 0:
                return j
        return self.cap

    @property
    def cuts(self) -> bool:
        """Whether this step's chains end by their confidences (`chain_end`), which then need them on the host."""
        return self.step.forced is None

    def chain_end(self, confidences: list[list[float]], limits: list[int]) -> int:
        """
        Where this step's chains end: before the first head `j` that would not pay, judged from each row's
        `confidences` of drafts `0 .. j - 1` and whether its chain was still open (`limits[r] > j`).
        """
        depth = len(confidences[0]) if confidences else 0
        prefix = self.acceptance.prefix(confidences) if depth > 1 else None
        for j in range(1, depth):
            open_rows = [limit > j for limit in limits]
            if not any(open_rows):
                return j
            if best_depth(prefix[:, :j], self.step.means[j:], self.step_costs(j), open_rows, self.step.remaining) <= j:
                return j
        return depth

    def record_drafts(self, step: StepPlan, heads: int, seconds: float) -> None:
        """Records `heads` draft heads of `step` that ran back to back in `seconds`: heads have the same shape."""
        for head in range(heads):
            step.cost_model.record_draft(head, seconds / heads)
            self.draft_runs[head] += 1
            self.draft_seconds[head] += seconds / heads

    def end_step(self, step: "StepPlan", depth: int, verify_seconds: float, new_tokens: int | None = None,
                 steady: bool = True) -> None:  # fmt: skip
        """
        Records the verifier forward of `step` (what `start_step` left in `self.step`), which drafted `depth` heads
        (`new_tokens` per row, if unusual). On a GPU the timing arrives a step or so late. A forward that ran in a way
        later ones will not (on CPU, on a kind of weights that measured slower, see `weight_layouts`) is not `steady`:
        its timing stands in for the step's cost only until steady ones come.
        """
        step.cost_model.record_verify(step.cache_length, new_tokens or self.new_tokens(depth), verify_seconds, steady)
        self.depth_counts[depth] += 1
        self.verify_seconds[depth] += verify_seconds

    def report_to(self, metrics) -> None:
        """Puts this call's depth counts and measured costs on a `SpeculationMetrics`."""
        metrics.steps_by_depth, metrics.verify_seconds_by_depth = list(self.depth_counts), list(self.verify_seconds)
        metrics.draft_runs_by_head, metrics.draft_seconds_by_head = list(self.draft_runs), list(self.draft_seconds)

    def _forced_depth(self, planned: int, costs: list[float] | None) -> int | None:
        """
        A depth to run whatever the estimates, where the controller would plan `planned` and the depths cost `costs`
        drafting exactly as deep (None: nothing timed yet). First the shallowest depth never timed (twice: its first
        timing is left out, see `CostModel.record_verify`), while it could pay: a depth deeper than every timed one is
        costed as the deepest timed (costs never fall with depth), so timing stops at the first depth that would not
        pay even at that cost, and a later call times it only once the acceptance it sees says it could. A depth tried
        but not yet timed steadily (`CostModel.staleness`) is tried again whatever it seems to cost: its timings came
        from forwards that paid one-time costs or ran on a slower kind of weights (measured at batch 8 on CPU: 205 ms
        against 112 ms for a plain step, after which no step of 504 drafted). Then, within the exploration share, the
        depth other than `planned` tried longest ago.
        """
        cost_model, cache_length = self.step.cost_model, self.step.cache_length
        stale = {d: cost_model.staleness(cache_length, self.new_tokens(d)) for d in range(self.cap + 1)}
        never = [d for d, age in stale.items() if age == math.inf]
        retry = bool(never) and cost_model.was_tried(cache_length, self.new_tokens(never[0]))
        # No timings to weigh yet (steps that drafted from prompt lookup time nothing): time the shallowest depth.
        if never and (costs is None or never[0] <= planned or retry):
            target = never[0]
        elif costs is None:
            return None
        else:
            target = max((d for d in stale if d not in never and d != planned), key=stale.get, default=None)
            budget = EXPLORATION_SHARE * cost_model.total_seconds
            if target is None or cost_model.exploring_seconds + costs[target] > budget:
                return None
            cost_model.exploring_seconds += costs[target]  # the whole step: even a cheap depth may emit less
        cost_model.tried(cache_length, self.new_tokens(target))
        return target
