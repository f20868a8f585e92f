"""What drafts each speculative step, for either decoding loop: the one seam between the loops and drafting.

A `Drafter` holds everything of a call that decides and records drafts: the speculator's heads (as many as
`num_assistant_tokens` allows), the kind of drafts and the tree's shape, the confidence threshold, the cost-aware
controller that sizes each step from the pair's `SpeculationState`, prompt lookup beside the heads (hybrid drafting),
the timings of heads and verifier, and each row's metrics. The package's own loop (`speculative_decoding`) and
transformers' assisted decoding (`candidate_generator`) both use it the same way, each step:

    step = drafter.start_step(...)      # the plan: depth, each row's room, which rows draft from prompt lookup
    drafts = drafter.draft(step, ...)   # a chain or a tree, on the device
    mark = drafter.start_verify()       # the verifier's forward, timed
    drafter.stop_verify(step, mark)
    drafter.end_step(step, record)      # what the verifier kept (a `StepRecord`, on the host)
    drafter.finish()                    # the call's metrics, on the speculator

The loops keep only what differs between them: how they verify, accept and emit. Everything the drafter keeps is on
the host; it reads the device only to cut a chain by its confidences (one read, after the heads).
"""

from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from ..cpu.weight_layouts import steady_forward
from ..utils.devices import forward_device
from ..utils.host_transfer import to_host
from ..utils.rank_agreement import RankAgreement
from .controller import SpeculationController, StepPlan
from .drafts import DraftKind, Drafts, HostDrafts, TreeSpec, draft_chain, draft_tree
from .metrics import SpeculationMetrics
from .prompt_lookup import HybridDrafter, lookup_drafts, with_lookup
from .state import speculation_state
from .stopwatch import Stopwatch, Timing

# A tree has no single confidence per draft: the controller's acceptance then keeps one bin per depth.
TREE_CONFIDENCE = 0.5


class TokenPicker(Protocol):
    """How a loop picks a draft exactly as its verifier picks tokens (see `draft_chain`)."""

    def process_drafts(self, scores, drafts: list):
        """The logits processors on the scores that follow `drafts` (the drafts so far, a list of `(rows,)`)."""

    def select(self, scores, head: int):
        """A sampled draft for head `head` from processed `scores`."""


@dataclass
class DraftStep:
    """
    The host's record of one step: the controller's `plan` and planned depth, each row's `room` for drafts before the
    maximum length and the most any row drafts, which rows draft from prompt lookup (and what lookup proposed), and
    the timing of the verifier's forward (`steady`: it ran as later ones will, see `weight_layouts.steady_forward`).
    """

    plan: StepPlan
    planned: int
    room: list[int]
    most: int
    from_lookup: list[bool]
    lookup: list[list[int]] | None = None
    timing: Timing | None = None
    steady: bool = True


class StepRecord(NamedTuple):
    """
    What the verifier kept of a step, on the host, per row of the step: `rows` (each row's index in the call),
    `drafts` (what it verified), `accepted` (drafts accepted), `emitted` (the tokens the row emitted: fewer than
    `accepted + 1` where it stopped, at an end-of-sequence token say), and `nodes` (tokens verified per row).
    """

    rows: list[int]
    drafts: HostDrafts
    accepted: list[int]
    emitted: list[list[int]]
    nodes: int


def heads_for_call(config, generation_config) -> int:
    """The heads a call drafts with: the speculator's `n_predict`, or fewer where `num_assistant_tokens` says."""
    return min(config.n_predict, generation_config.num_assistant_tokens or config.n_predict)


def eos_token_ids(generation_config) -> set[int]:
    """The end-of-sequence ids of a call."""
    eos = generation_config.eos_token_id
    return set() if eos is None else {eos} if isinstance(eos, int) else set(eos)


@dataclass
class Drafter:
    """
    The drafting side of one `generate()` call over `rows` sequences: chains, or trees of shape `tree`, picked with
    `picker` where the call samples or has logits processors.
    """

    verifier: object
    speculator: object
    generation_config: object
    rows: int
    tree: TreeSpec | None = None
    picker: TokenPicker | None = None
    logits_processor: object = None
    metrics: list = field(init=False)

    def __post_init__(self):
        config, generation_config = self.speculator.config, self.generation_config
        self.heads = self.speculator.speculator
        self.num_heads = heads_for_call(config, generation_config)
        self.sampled = bool(generation_config.do_sample)
        chain = DraftKind.CHAIN_SAMPLED if self.sampled else DraftKind.CHAIN_GREEDY
        self.kind = DraftKind.TREE if self.tree else chain
        self.eos_ids = eos_token_ids(generation_config)
        self.max_length = generation_config.max_length
        # transformers' `assistant_confidence_threshold`, as the user set it (see `mixin.assistant_setting`).
        self.threshold = generation_config.assistant_confidence_threshold or 0.0
        self.hybrid = HybridDrafter.for_call(self.rows, generation_config)
        self.state = speculation_state(self.verifier, self.speculator)
        device, dtype = forward_device(self.verifier), next(self.verifier.parameters()).dtype
        # A call's "constant" schedule comes before the pair's policy: it is the more specific request.
        fixed = None if self.state.policy is None else self.state.policy.depth
        if generation_config.num_assistant_tokens_schedule == "constant" or (self.state.policy and fixed is None):
            fixed = self.num_heads
        self.controller = SpeculationController(
            lambda batch: self.state.cost_model_for(batch, device, dtype),
            self.state.acceptance_for(self.kind, config.n_predict), self.num_heads,
            self.tree.new_tokens if self.tree else None, fixed,
        )  # fmt: skip
        self.stopwatch = Stopwatch(device)
        self.agreement = RankAgreement.for_model(self.verifier)
        self.metrics = [SpeculationMetrics(num_speculative_tokens=self.num_heads) for _ in range(self.rows)]

    @property
    def num_drafting_tokens(self) -> int:
        """The most drafts a step verifies per row."""
        return max(self.num_heads, self.hybrid.num_tokens if self.hybrid else 0)

    @property
    def max_nodes(self) -> int:
        """The most tokens a step verifies per row, its last emitted token aside."""
        return max(self.num_heads * (self.tree.n_candidates if self.tree else 1), self.num_drafting_tokens)

    def start_step(self, cache_length: int, rows: list[int], lengths: list[int], host_tokens=None) -> DraftStep:
        """
        Plans a step for `rows` (each row's index in the call), `lengths[i]` tokens long, on a cache of `cache_length`
        slots: the controller's depth, each row's room, and which rows draft from prompt lookup (which reads each row's
        `host_tokens`, kept on the host by calls that draft from it).
        """
        self.stopwatch.poll()
        # Never draft a token the verifier could not emit: its forward also adds one token of its own.
        room = [max(0, self.max_length - length - 1) for length in lengths]
        planned = self.controller.start_step(cache_length, len(rows), max(room) + 1)
        step = DraftStep(self.controller.step, planned, room, min(self.num_heads, max(room)), [False] * len(rows))
        if self.hybrid is not None:  # on the host, before any head: rows that draft from lookup run none
            step.lookup, step.from_lookup = self.hybrid.propose(host_tokens, rows, room)
        return step

    def draft(self, step: DraftStep, hidden, last_tokens, limits=None) -> Drafts:
        """
        This step's drafts for every row, from the verifier's `hidden` states and each row's last token: at most
        `step.most` deep, row `b` at most `limits[b]` (a device tensor; None where every row has room for `most`).
        """
        speculator_rows = [not lookup for lookup in step.from_lookup]
        if self.tree is not None:
            depth = min(step.planned, step.most)
        else:
            depth = min(self.controller.chain_depth(step.planned), step.most) if any(speculator_rows) else 0
        (depth,) = self.agreement.decide([depth])
        if self.hybrid is not None and not all(speculator_rows):
            use_lookup, lookup = lookup_drafts(step.lookup, step.from_lookup, last_tokens.device)
            limits = use_lookup.logical_not().long() * (depth if limits is None else limits)
        if depth:
            hidden = hidden.to(self.speculator.device, self.speculator.dtype)
        mark = self.stopwatch.start()
        if self.tree is not None:
            drafts = draft_tree(self.heads, hidden, last_tokens, limits, depth, self.tree)
        else:
            process = self.picker.process_drafts if self.picker is not None and self.logits_processor else None
            select = self.picker.select if self.sampled else None
            drafts = draft_chain(self.heads, hidden, last_tokens, limits, depth, process, select, self.threshold)
        timing, plan = self.stopwatch.stop(mark), step.plan
        if depth:
            self.stopwatch.report(timing, lambda seconds: self.controller.record_drafts(plan, depth, seconds))
        if self.tree is None and depth > 1 and (self.controller.cuts or self.agreement.active):
            cuts = self.controller.cuts
            end = self.controller.chain_end(*to_host(drafts.confidences, drafts.limits)) if cuts else depth
            drafts = drafts.cut(*self.agreement.decide([end]))
        if self.hybrid is not None and not all(speculator_rows):
            drafts = with_lookup(drafts, use_lookup, lookup)
        return drafts

    def read_back(self, drafts: Drafts) -> tuple:
        """The tensors of `drafts` the host needs for `end_step` (see `Drafts.to_read`): read them with the step's
        own results, in one transfer."""
        return drafts.to_read(tokens=self.hybrid is not None)

    def start_verify(self):
        return self.stopwatch.start()

    def stop_verify(self, step: DraftStep, mark) -> None:
        step.timing, step.steady = self.stopwatch.stop(mark), steady_forward(self.verifier)

    def end_step(self, step: DraftStep, record: StepRecord) -> None:
        """Records a verified step: the metrics, the controller's acceptance and timings, and the hybrid scores."""
        drafts, accepted = record.drafts, record.accepted
        for row, count, tokens, lookup, broken in zip(record.rows, drafts.limits, record.emitted, step.from_lookup,
                                                      drafts.nonfinite):  # fmt: skip
            self.metrics[row].record_step(count, len(tokens) - 1, from_lookup=lookup, nonfinite=broken)
        confidences = drafts.confidences
        if self.tree is not None:
            confidences = [[TREE_CONFIDENCE] * self.num_heads for _ in drafts.limits]
        if confidences is not None:  # the speculator's rows only: the controller sizes its chains
            own = [i for i, lookup in enumerate(step.from_lookup) if not lookup]
            self.controller.acceptance.record([confidences[i] for i in own], [drafts.limits[i] for i in own],
                                              [accepted[i] for i in own])  # fmt: skip
        if not any(step.from_lookup):  # lookup drafts may run deeper than the depths the controller weighs
            plan, depth, steady, nodes = step.plan, max(drafts.limits), step.steady, record.nodes
            self.stopwatch.report(step.timing, lambda s: self.controller.end_step(plan, depth, s, nodes, steady))
        if self.hybrid is not None:
            verified = [drafts.drafts(i) for i in range(len(record.rows))]
            self.hybrid.record(record.rows, step.lookup, step.from_lookup, verified, record.emitted)

    def finish(self, **extra) -> SpeculationMetrics:
        """
        Waits for the last timings, and leaves the call's metrics on the speculator: `speculation_metrics` (all rows
        together, with `extra` fields) and `speculation_metrics_per_row`. Returns the first.
        """
        self.stopwatch.poll(wait=True)
        total = sum(self.metrics, SpeculationMetrics(num_speculative_tokens=self.num_heads))
        self.controller.report_to(total)
        for name, value in extra.items():
            setattr(total, name, value)
        self.speculator.speculation_metrics, self.speculator.speculation_metrics_per_row = total, self.metrics
        return total
