"""What drafts each speculative step, for either decoding loop.

A `Drafter` holds everything of a call that decides and records drafts: the speculator's heads (as many as
`num_assistant_tokens` allows), the confidence threshold, the cost-aware controller that sizes each step, prompt lookup
beside the heads (hybrid drafting), the timings of heads and verifier, and each row's metrics. The package's own loop
(`speculative_decoding`) and transformers' assisted decoding (`candidate_generator`) both ask it, each step, for a
plan (`start_step`) and for drafts (`draft`), time the verifier with it (`start_verify`, `stop_verify`) and hand it
what the verifier kept (`end_step`). Everything it keeps is on the host; it reads the device only to cut a chain by its
confidences (one read, after the heads).
"""

from dataclasses import dataclass

from .controller import SpeculationController, Step, acceptance_for
from .cost_model import Stopwatch, cost_model_for
from .drafting import Drafts, draft_chain, draft_tree
from .host_transfer import to_host
from .metrics import SpeculationMetrics
from .packed_linear import steady_forward
from .prompt_lookup import HybridDrafter, lookup_drafts, with_lookup


@dataclass
class DraftStep:
    """The host's record of a step: the controller's step and planned depth, which rows draft from prompt lookup (and
    what lookup proposed), and the timing of the verifier's forward."""

    step: Step
    planned: int
    from_lookup: list[bool]
    lookup: list[list[int]] | None = None
    timing: object = None
    steady: bool = True  # the verifier's forward ran as later ones will (see `packed_linear.steady_forward`)


class Drafter:
    """
    The drafting side of one `generate()` call over `rows` sequences. `kind` names the acceptance estimate the
    controller keeps for the process ("chain, greedy", "chain, sampled" or "tree"); `new_tokens(d)` is the verifier's
    new tokens per row at depth `d` (`d + 1` for a chain, the node count for a tree).
    """

    def __init__(self, verifier, speculator, generation_config, rows: int, kind: str, new_tokens=lambda d: d + 1):
        config = speculator.config
        self.verifier, self.speculator, self.heads = verifier, speculator, speculator.speculator
        self.num_heads = min(config.n_predict, generation_config.num_assistant_tokens or config.n_predict)
        # transformers' `assistant_confidence_threshold`, as the user set it (see `generation.assistant_setting`).
        self.threshold = generation_config.assistant_confidence_threshold or 0.0
        self.hybrid = HybridDrafter.for_call(rows, generation_config)
        self.controller = SpeculationController(
            lambda batch: cost_model_for(verifier, batch), acceptance_for(speculator, kind), self.num_heads,
            new_tokens, generation_config.num_assistant_tokens_schedule,
        )  # fmt: skip
        self.stopwatch = Stopwatch(verifier.device)
        self.metrics = [SpeculationMetrics(num_speculative_tokens=self.num_heads) for _ in range(rows)]

    @property
    def num_drafting_tokens(self) -> int:
        """The most drafts a step verifies per row."""
        return max(self.num_heads, self.hybrid.num_tokens if self.hybrid else 0)

    def start_step(self, cache_length: int, host_tokens, rows: list[int], room: list[int]) -> DraftStep:
        """
        Plans a step for `rows` (indices into `host_tokens`, each row's tokens on the host) on a cache of
        `cache_length` slots, row `i` having room for `room[i]` drafts: the controller's depth, and which rows draft
        from prompt lookup.
        """
        self.stopwatch.poll()
        planned = self.controller.start_step(cache_length, len(rows))
        step = DraftStep(self.controller.step, planned, [False] * len(rows))
        if self.hybrid is not None:  # on the host, before any head: rows that draft from lookup run none
            step.lookup, step.from_lookup = self.hybrid.propose(host_tokens, rows, room)
        return step

    def draft(self, step: DraftStep, hidden, last_tokens, limits, most: int, process=None, select=None,
              tree=None) -> Drafts:  # fmt: skip
        """
        This step's drafts for every row: a chain (or a `tree`, `(top_k_tokens_per_head, n_candidates)`) from the
        verifier's `hidden` states and each row's last token, at most `most` deep, row `b` at most `limits[b]` (no
        limit but `most` where None). `process` and `select` pick drafts as the verifier picks tokens (see
        `draft_chain`).
        """
        speculator_rows = [not lookup for lookup in step.from_lookup]
        if tree is not None:
            depth = min(step.planned, most)
        else:
            depth = min(self.controller.chain_depth(step.planned), most) if any(speculator_rows) else 0
        if self.hybrid is not None and not all(speculator_rows):
            use_lookup, lookup = lookup_drafts(step.lookup, step.from_lookup, last_tokens.device)
            limits = use_lookup.logical_not().long() * (depth if limits is None else limits)
        if depth:
            hidden = hidden.to(self.speculator.device, self.speculator.dtype)
        mark = self.stopwatch.start()
        if tree is not None:
            drafts = draft_tree(self.heads, hidden, last_tokens, limits, depth, *tree)
        else:
            drafts = draft_chain(self.heads, hidden, last_tokens, limits, depth, process, select, self.threshold)
        timing, controller_step = self.stopwatch.stop(mark), step.step
        if depth:
            record = self.controller.record_drafts
            self.stopwatch.report(timing, lambda seconds: record(controller_step, depth, seconds))
        if tree is None and depth > 1 and self.controller.cuts:
            drafts = drafts.cut(self.controller.chain_end(*to_host(drafts.confidences, drafts.limits)))
        if self.hybrid is not None and not all(speculator_rows):
            drafts = with_lookup(drafts, use_lookup, lookup)
        return drafts

    def start_verify(self):
        return self.stopwatch.start()

    def stop_verify(self, step: DraftStep, mark) -> None:
        step.timing, step.steady = self.stopwatch.stop(mark), steady_forward(self.verifier)

    def end_step(self, step: DraftStep, rows: list[int], drafted: list[int], accepted: list[int],
                 num_emitted: list[int], confidences, nonfinite: list[bool], nodes: int, verified=None,
                 emitted=None) -> None:  # fmt: skip
        """
        Records a verified step: row `rows[i]` (its index in the call) checked `drafted[i]` drafts (made with
        `confidences[i]`, or from lookup), the verifier accepted `accepted[i]` of them, and the row emitted
        `num_emitted[i]` tokens (fewer than `accepted[i] + 1` where it stopped, at an end-of-sequence token say); the
        verifier checked `nodes` tokens per row. Updates the metrics, the controller's acceptance and timings, and,
        from the drafts `verified[i]` and the tokens `emitted[i]`, the hybrid scores.
        """
        for row, count, tokens, lookup, broken in zip(rows, drafted, num_emitted, step.from_lookup, nonfinite):
            self.metrics[row].record_step(count, tokens - 1, from_lookup=lookup, nonfinite=broken)
        if confidences is not None:  # the speculator's rows only: the controller sizes its chains
            own = [i for i, lookup in enumerate(step.from_lookup) if not lookup]
            self.controller.acceptance.record([confidences[i] for i in own], [drafted[i] for i in own],
                                              [accepted[i] for i in own])  # fmt: skip
        if not any(step.from_lookup):  # lookup drafts may run deeper than the depths the controller weighs
            controller_step, depth, steady = step.step, max(drafted), step.steady
            self.stopwatch.report(step.timing, lambda s: self.controller.end_step(controller_step, depth, s, nodes,
                                                                                  steady))
        if self.hybrid is not None:
            self.hybrid.record(rows, step.lookup, step.from_lookup, verified, emitted)

    def finish(self) -> SpeculationMetrics:
        """Waits for the last timings; the call's metrics, all rows together."""
        self.stopwatch.poll(wait=True)
        total = sum(self.metrics, SpeculationMetrics(num_speculative_tokens=self.num_heads))
        self.controller.report_to(total)
        return total
