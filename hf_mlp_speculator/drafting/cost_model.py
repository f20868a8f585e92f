"""What a verifier forward and a draft head cost, measured online from the steps that speculative decoding runs.

Whether a draft pays depends on the hardware: on a CPU a verifier forward over `k + 1` new tokens may cost nearly
`k + 1` plain steps, on a GPU about one. So nothing here is assumed: every verifier forward and every draft head of a
call is timed, and the controller (`controller.py`) reads the medians of the recent timings. Only ratios between
these costs decide anything, so a uniformly slow spell of a shared machine changes no choice, as long as the costs
compared were timed in the same spell: a cost is read from its recent timings only (`HORIZON`), and the controller
re-times the depths it is not choosing (see `controller.py`).

A pair's `SpeculationState` keeps one cost model per (device, dtype, batch bucket) of the verifier: a later call at the
same batch size starts with what the earlier ones measured.
"""

import math
import statistics
from collections import defaultdict, deque

from ..cpu.weight_layouts import LAYOUTS, TRIALS

# Recent timings kept per measured quantity: enough for a stable median, few enough to follow a change of load.
WINDOW = 16
# Timings of one `m` taken more than this many verify timings before its latest one are from another spell of the
# machine than the costs they would be compared with (measured on a shared 2-core CPU: a plain step timed at 86 ms in a
# slow spell, then 60 ms for the rest of the run, kept the controller drafting at a loss while it drafted): left out.
HORIZON = 2 * WINDOW
# The fewest timings a cost is read from, however old (a median of three ignores one outlier).
FEWEST = 3
# Steps that may be forced to verify an `m` until a steady timing of it comes back: on CPU a new forward shape first
# runs a trial of every kind of weights, and only the forwards after those are steady (see `weight_layouts`). With
# the earlier 4, depth 1 at batch 8 was never timed steadily, and no later step drafted at a depth that
# verified in 1.09 plain steps.
UNTIMED_TRIES = len(LAYOUTS) * (TRIALS + 1) + 1


def batch_bucket(batch_size: int) -> int:
    """Batch sizes share a cost model up to the next power of two: costs change slowly with the batch."""
    return 1 << max(0, int(batch_size) - 1).bit_length()


def cache_bucket(cache_length: int) -> int:
    """Cache lengths share timings up to doubling from 256 on: attention grows with the cache, the rest does not."""
    return max(0, int(cache_length) // 256).bit_length()


class CostModel:
    """
    Median seconds of a verifier forward per (cache bucket, new tokens per row `m`) and of each draft head. A forward
    with an `m` that was never timed is interpolated linearly between the nearest timed ones (flat past the largest),
    from the nearest cache bucket that has timings; `None` when nothing was timed yet. Costs never fall with `m`.
    """

    def __init__(self):
        self.verify = defaultdict(lambda: deque(maxlen=WINDOW))  # (cache bucket, m) -> (timing number, seconds)
        # The same of forwards that ran in a way later ones will not (see `record_verify`), used only where `verify`
        # has none.
        self.unsteady = defaultdict(lambda: deque(maxlen=WINDOW))
        self.draft = defaultdict(lambda: deque(maxlen=WINDOW))  # head -> seconds
        self.last_tried = {}  # (cache bucket, m) -> how many verify timings had been recorded when it was last tried
        self.first_seen = set()  # (cache bucket, m) and ("draft", head) whose first timing came (and was left out)
        self.tries = {}  # (cache bucket, m) -> steps forced to verify it
        self.num_timings = 0
        # Seconds of decoding steps timed with this model, and of those the controller forced (see `controller`).
        self.total_seconds = self.exploring_seconds = 0.0
        self.medians = {}  # what `timed_new_tokens` and `draft_cost` computed since the last timing: asked every step

    def record_verify(self, cache_length: int, new_tokens: int, seconds: float, steady: bool = True) -> None:
        """
        A verify timing. The first of each (cache bucket, m) is not kept: it pays one-time costs (kernels chosen for a
        new shape, on any device), which would make that `m` look dearer than it is for long. A forward that is not
        `steady` ran in a way later ones will not (on CPU, on the kind of weights that measured slower, while
        `weight_layouts` tries each): its timing stands in only until steady ones come.
        """
        key = (cache_bucket(cache_length), int(new_tokens))
        if key in self.first_seen:
            (self.verify if steady else self.unsteady)[key].append((self.num_timings, seconds))
            self.medians.clear()
        self.first_seen.add(key)
        self.num_timings += 1
        self.last_tried[key] = self.num_timings

    def tried(self, cache_length: int, new_tokens: int) -> None:
        """Notes that a step was meant to verify `new_tokens` per row: it may end shallower (an unsure draft)."""
        key = (cache_bucket(cache_length), int(new_tokens))
        self.last_tried[key] = self.num_timings
        self.tries[key] = self.tries.get(key, 0) + 1

    def record_draft(self, head: int, seconds: float) -> None:
        """
        A head's timing. Its first is left out, as a forward's is (`record_verify`): on the default pair on CPU a
        process's first run of head 0 took 23.7 ms against 1.1 ms after, and kept it made drafting look so dear that no
        later step drafted, so the head was never timed again.
        """
        if ("draft", head) in self.first_seen:
            self.draft[head].append(seconds)
            self.medians.clear()
        self.first_seen.add(("draft", head))

    def timed_new_tokens(self, cache_length: int) -> dict[int, float]:
        """{m: median seconds} for the cache bucket of `cache_length`, else for the nearest bucket with timings."""
        key = ("verify", cache_bucket(cache_length))
        if key not in self.medians:
            timed = {k: _recent(t) for k, t in self.unsteady.items() if t}
            timed |= {k: _recent(t) for k, t in self.verify.items() if t}
            buckets = sorted({bucket for bucket, _ in timed}, key=lambda b: abs(b - key[1]))
            self.medians[key] = {m: statistics.median(times) for (bucket, m), times in timed.items()
                                 if bucket == buckets[0]} if buckets else {}  # fmt: skip
        return self.medians[key]

    def verify_cost(self, cache_length: int, new_tokens: int) -> float | None:
        timed = self.timed_new_tokens(cache_length)
        if not timed:
            return None
        below = [m for m in timed if m < new_tokens]
        above = [m for m in timed if m > new_tokens]
        if new_tokens in timed:
            value = timed[new_tokens]
        elif not above:
            value = timed[max(below)]
        elif not below:
            value = timed[min(above)]
        else:
            low, high = max(below), min(above)
            value = timed[low] + (new_tokens - low) / (high - low) * (timed[high] - timed[low])
        # A forward over more tokens does at least the work of one over fewer: a timing that says otherwise caught a
        # quiet spell of the machine, and believing it would make drafting look cheaper than a plain step.
        return max([value, *(timed[m] for m in below)])

    def draft_cost(self, head: int) -> float:
        """A head never timed costs what the nearest timed one does (heads have the same shape); 0 before any."""
        if not self.draft:
            return 0.0
        key = ("draft", head)
        if key not in self.medians:
            self.medians[key] = statistics.median(self.draft[min(self.draft, key=lambda h: abs(h - head))])
        return self.medians[key]

    def was_tried(self, cache_length: int, new_tokens: int) -> bool:
        """Whether any step verified (or was forced to verify) this `m` in this cache bucket."""
        return (cache_bucket(cache_length), int(new_tokens)) in self.last_tried

    def staleness(self, cache_length: int, new_tokens: int) -> float:
        """
        How many verify timings ago a step last tried this `m` in this cache bucket: `inf` if never, or while no steady
        timing came back from fewer than `UNTIMED_TRIES` tries (its first timing is left out, and on CPU the first
        forwards of a shape may run on a slower kind of weights while `weight_layouts` tries each).
        """
        key = (cache_bucket(cache_length), int(new_tokens))
        if key not in self.last_tried or (not self.verify.get(key) and self.tries.get(key, 0) < UNTIMED_TRIES):
            return math.inf
        return self.num_timings - self.last_tried[key]

    def summary(self) -> dict:
        """{"verify_seconds_by_new_tokens": {m: s}, "draft_seconds_by_head": {h: s}} over all cache buckets."""
        by_m = defaultdict(list)
        for (_, m), times in self.verify.items():
            by_m[m] += _recent(times)
        return {
            "verify_seconds_by_new_tokens": {m: statistics.median(t) for m, t in sorted(by_m.items())},
            "draft_seconds_by_head": {h: statistics.median(t) for h, t in sorted(self.draft.items())},
        }


def _recent(timings) -> list[float]:
    """
    The seconds of `timings` ((timing number, seconds), oldest first) taken within `HORIZON` of the latest, or the
    latest `FEWEST` where fewer are: a depth the controller seldom runs is re-timed seldom, and one timing alone, on a
    slow moment, would keep it from being chosen until its next.
    """
    latest = timings[-1][0]
    recent = [seconds for number, seconds in timings if number > latest - HORIZON]
    return recent if len(recent) >= FEWEST else [seconds for _, seconds in list(timings)[-FEWEST:]]
