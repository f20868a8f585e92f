"""How many drafts each speculative step verifies: the depth that maximises the expected tokens per second.

Each step the controller weighs what a deeper draft is expected to bring (the acceptance it has observed per head,
sharpened by the speculator's confidence in each draft already made) against what it costs (the cost model's timings
of the verifier forward and the draft heads). Depth 0 is a plain decoding step, taken wherever drafts do not pay.

The choice is made head by head while drafting: before drafting head `j` it may use drafts `0 .. j - 1` and their
confidences, never draft `j` itself. So whether a draft is verified never depends on its own value, the verifier
sees drafts drawn from exactly the distribution they are divided by, and sampling stays exact.
"""

import math
import time
import weakref

import torch

# Acceptance is tracked per head and per bin of the speculator's confidence in its draft.
CONFIDENCE_BINS = 5
# Weight of the prior, which expects a draft to be accepted as often as the speculator's confidence in it says.
PRIOR_WEIGHT = 1.0
# Each observation of a head discounts its older ones by this factor (about the last 50 steps count).
DECAY = 0.98
# Share of the time a call may spend on steps the controller would not choose, to refresh its estimates: without
# them a head whose acceptance looked poor, or a depth timed on a slow spell, would never be tried again.
EXPLORATION_SHARE = 0.02


def expected_tokens(prefix: torch.Tensor, tail_acceptance: list[float], open_rows=None) -> torch.Tensor:
    """
    Expected tokens a step emits, per depth `d = j .. j + len(tail_acceptance)`, summed over rows, when
    `prefix[r, l - 1]` is the probability that row `r`'s drafts `1 .. l` are all accepted (`l <= j`) and draft `l > j`
    is accepted with probability `tail_acceptance[l - j - 1]` once the drafts before it were. Rows not in `open_rows`
    draft no further (their chain ended at an unsure draft or at the length limit).
    """
    rows, j = prefix.shape
    reach = prefix[:, -1].clone() if j else torch.ones(rows, dtype=prefix.dtype)
    if open_rows is not None:
        reach = reach * open_rows.to(reach.dtype)
    out = [rows + prefix.sum()]
    for rate in tail_acceptance:
        reach = reach * rate
        out.append(out[-1] + reach.sum())
    return torch.stack(out)


def best_depth(prefix, tail_acceptance, step_costs, open_rows=None) -> int:
    """
    The depth `d >= j` (`j = prefix.shape[1]`, drafts already made) that maximises expected tokens /
    `step_costs[d - j]`, the seconds of a step that ends at depth `d`. The shallowest wins a tie: deeper costs memory
    for nothing.
    """
    tokens = expected_tokens(prefix, tail_acceptance, open_rows)
    rates = [float(t) / c if c > 0 else math.inf for t, c in zip(tokens, step_costs)]
    best = max(rates)
    return prefix.shape[1] + next(d for d, rate in enumerate(rates) if rate >= best * (1 - 1e-9))


class AcceptanceEstimate:
    """Running conditional acceptance per (head, confidence bin): draft `h` accepted given drafts `< h` were."""

    def __init__(self, num_heads: int):
        self.accepted = torch.zeros(num_heads, CONFIDENCE_BINS, dtype=torch.float64)
        self.drafted = torch.zeros(num_heads, CONFIDENCE_BINS, dtype=torch.float64)
        self.prior = (torch.arange(CONFIDENCE_BINS, dtype=torch.float64) + 0.5) / CONFIDENCE_BINS

    @staticmethod
    def bins(confidence: torch.Tensor) -> torch.LongTensor:
        return (confidence.double() * CONFIDENCE_BINS).long().clamp(0, CONFIDENCE_BINS - 1)

    def given(self, head: int, confidence: torch.Tensor) -> torch.Tensor:
        """Per row: probability that draft `head`, made with `confidence`, is accepted after its predecessors were."""
        b = self.bins(confidence.cpu())
        return (self.accepted[head, b] + PRIOR_WEIGHT * self.prior[b]) / (self.drafted[head, b] + PRIOR_WEIGHT)

    def mean(self, head: int) -> float:
        """The same before the draft is made: over the confidences seen so far (the prior's mean, 0.5, before any)."""
        return float((self.accepted[head].sum() + 0.5 * PRIOR_WEIGHT) / (self.drafted[head].sum() + PRIOR_WEIGHT))

    def prefix(self, confidences: torch.Tensor) -> torch.Tensor:
        """`[r, l - 1]`: the chance that row `r`'s drafts `1 .. l`, made with `confidences[r, :l]`, are all kept."""
        columns = [self.given(head, confidences[:, head]) for head in range(confidences.shape[1])]
        if not columns:
            return torch.ones(len(confidences), 0, dtype=torch.float64)
        return torch.stack(columns, dim=1).cumprod(dim=1)

    def record(self, confidences: torch.Tensor, num_drafted, num_accepted) -> None:
        """Row `r` drafted `num_drafted[r]` tokens with `confidences[r]`, and the first `num_accepted[r]` were kept."""
        confidences = confidences.cpu()
        for row, (drafted, accepted) in enumerate(zip(num_drafted, num_accepted)):
            for head in range(min(int(drafted), int(accepted) + 1)):  # a head counts only where its predecessors held
                b = int(self.bins(confidences[row, head]))
                self.accepted[head] *= DECAY
                self.drafted[head] *= DECAY
                self.drafted[head, b] += 1
                self.accepted[head, b] += float(head < accepted)


_ACCEPTANCE = weakref.WeakKeyDictionary()  # speculator -> {kind: AcceptanceEstimate}, kept across calls


def acceptance_for(speculator, kind: str) -> AcceptanceEstimate:
    """The process's running estimate of `speculator` for `kind` of drafts (chain or tree, greedy or sampled)."""
    estimates = _ACCEPTANCE.setdefault(speculator, {})
    if kind not in estimates:
        estimates[kind] = AcceptanceEstimate(speculator.config.n_predict)
    return estimates[kind]


class SpeculationController:
    """
    Chooses the depth of each step (see the module docstring) for one `generate()` call. `new_tokens(d)` is the
    verifier's new tokens per row at depth `d`: `d + 1` for a chain, the node count for a tree. `cap` is the most
    heads that may draft (`num_assistant_tokens`). Per step: `start_step` gives the planned depth (0: a plain step);
    a chain then asks `keep_drafting` after each head, with the confidences of its drafts; `end_step` records the
    verifier's forward, and `acceptance.record` what it kept.
    """

    def __init__(self, cost_models, acceptance: AcceptanceEstimate, cap: int, new_tokens=lambda d: d + 1,
                 schedule: str | None = None):  # fmt: skip
        # `cost_models(rows)`: the cost model for a batch of `rows` (rows leave a batch as they finish).
        self.cost_models, self.acceptance, self.cap, self.new_tokens = cost_models, acceptance, cap, new_tokens
        # transformers' `num_assistant_tokens_schedule`: "constant" drafts `cap` heads every step, as vLLM's
        # `num_speculative_tokens` does; any other (None, "heuristic", "heuristic_transient") is cost-aware.
        self.constant = schedule == "constant"
        self.cost_model = None
        self.depth_counts = [0] * (cap + 1)
        self.verify_seconds = [0.0] * (cap + 1)
        self.draft_runs, self.draft_seconds = [0] * cap, [0.0] * cap
        self.exploring_seconds = self.total_seconds = 0.0
        self.forced = None  # the depth of a timing or exploration step
        self.step_start = self.head_start = 0.0
        self.cache_length = 0

    def step_costs(self, depth: int = 0) -> list[float] | None:
        """Seconds of a step ending at each depth `depth .. cap`; None while a depth has no timing to go on."""
        depths = range(depth, self.cap + 1)
        verify = [self.cost_model.verify_cost(self.cache_length, self.new_tokens(d)) for d in depths]
        if any(v is None for v in verify):
            return None
        drafting = [sum(self.cost_model.draft_cost(h) for h in range(d)) for d in depths]
        return [v + c for v, c in zip(verify, drafting)]

    def start_step(self, cache_length: int, rows: int) -> int:
        """The depth planned for this step, for `rows` rows on a cache of `cache_length` tokens; 0: no drafts."""
        self.cache_length, self.step_start = cache_length, time.perf_counter()
        self.cost_model = self.cost_models(rows)
        self.forced = self.cap if self.constant else self._forced_depth()
        self.head_start = time.perf_counter()
        if self.forced is not None:
            return self.forced
        prefix = torch.ones(rows, 0, dtype=torch.float64)
        return best_depth(prefix, [self.acceptance.mean(h) for h in range(self.cap)], self.step_costs())

    def keep_drafting(self, confidences: torch.Tensor, open_rows: torch.Tensor) -> bool:
        """
        After head `j - 1` drafted (`j = confidences.shape[1]`): whether head `j` should draft too, given each row's
        draft confidences so far and which rows may still draft.
        """
        now = time.perf_counter()
        depth = confidences.shape[1]
        self.cost_model.record_draft(depth - 1, now - self.head_start)
        self.draft_runs[depth - 1] += 1
        self.draft_seconds[depth - 1] += now - self.head_start
        self.head_start = now
        if depth >= self.cap or not open_rows.any():
            return False
        if self.forced is not None:
            return depth < self.forced
        tail = [self.acceptance.mean(h) for h in range(depth, self.cap)]
        prefix = self.acceptance.prefix(confidences)
        return best_depth(prefix, tail, self.step_costs(depth), open_rows.cpu()) > depth

    def end_step(self, depth: int, verify_seconds: float, new_tokens: int | None = None) -> None:
        """Records the verifier forward of a step that drafted `depth` heads (`new_tokens` per row, if unusual)."""
        self.cost_model.record_verify(self.cache_length, new_tokens or self.new_tokens(depth), verify_seconds)
        self.depth_counts[depth] += 1
        self.verify_seconds[depth] += verify_seconds
        self.total_seconds += time.perf_counter() - self.step_start
        if self.forced is not None and (costs := self.step_costs()) is not None:
            self.exploring_seconds += costs[depth]  # the whole step counts: even a cheap depth may emit less

    def report_to(self, metrics) -> None:
        """Puts this call's depth counts and measured costs on a `SpeculationMetrics`."""
        metrics.steps_by_depth, metrics.verify_seconds_by_depth = list(self.depth_counts), list(self.verify_seconds)
        metrics.draft_runs_by_head, metrics.draft_seconds_by_head = list(self.draft_runs), list(self.draft_seconds)

    def _forced_depth(self) -> int | None:
        """A depth to run whatever the estimates: first each depth never tried, then within the exploration share."""
        stale = {d: self.cost_model.staleness(self.cache_length, self.new_tokens(d)) for d in range(self.cap + 1)}
        never = [d for d, age in stale.items() if age == math.inf]
        costs = self.step_costs()
        target = never[0] if never else max(stale, key=stale.get)
        if never or self.exploring_seconds + costs[target] <= EXPLORATION_SHARE * self.total_seconds:
            self.cost_model.tried(self.cache_length, self.new_tokens(target))
            return target
        return None
