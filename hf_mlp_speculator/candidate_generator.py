"""Drafts for transformers' assisted decoding loop, from an MLPSpeculator and the verifier's own hidden states."""

import torch
from transformers import GenerationConfig, LogitsProcessorList
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.utils import ModelOutput

from .controller import SpeculationController, acceptance_for
from .cost_model import Stopwatch, cost_model_for
from .drafting import DraftTree, draft_chain
from .host_transfer import to_host
from .metrics import SpeculationMetrics
from .modeling_mlp_speculator import MLPSpeculatorPreTrainedModel
from .prompt_lookup import HybridDrafter


class MLPSpeculatorCandidateGenerator(CandidateGenerator):
    """
    Runs inside `_assisted_decoding` through the `requires_model_outputs` protocol: each round it reads the verifier's
    last hidden states from the previous forward and drafts up to `min(n_predict, num_assistant_tokens)` tokens: as
    many as the cost-aware controller expects to pay (none: the round is a plain decoding step), fewer when a draft
    falls below `assistant_confidence_threshold`. The verifier's forward is timed from the end of `get_candidates` to
    `update_candidate_strategy`, which transformers calls right after it.

    The draft starts from the hidden state at the position that emitted the last token. After prefill that is the last
    prompt position; after a round that checked `k` drafts and accepted `m` of them it is row `m` of the `k + 1`
    verified positions (the rows after it saw rejected drafts).

    Sampled calls run here only with `speculative_sampling="rejection"` (by default they run in
    `speculative_decoding`'s loop, keyed by position). Drafts are then sampled from the speculator's logits after the
    same logits processors as the verifier's, and those processed logits are returned (one-hot for a prompt-lookup
    draft), so that transformers' rejection sampling divides by the distribution each draft was really drawn from and
    the output follows the verifier's distribution exactly.
    """

    requires_model_outputs = True

    def __init__(
        self,
        speculator: MLPSpeculatorPreTrainedModel,
        generation_config: GenerationConfig,
        logits_processor: LogitsProcessorList | None = None,
        verifier=None,
    ):
        self.speculator = speculator
        self.do_sample = generation_config.do_sample
        self.draft_scores = []  # the processed scores each draft of this round was sampled from
        self.logits_processor = logits_processor
        self.max_length = generation_config.max_length
        eos = generation_config.eos_token_id
        self.eos_token_ids = set() if eos is None else {eos} if isinstance(eos, int) else set(eos)
        n_predict = speculator.config.n_predict
        self.num_heads = min(n_predict, generation_config.num_assistant_tokens or n_predict)
        # transformers' `assistant_confidence_threshold` (0.4 unless set); see `draft_chain`.
        self.confidence_threshold = generation_config.assistant_confidence_threshold or 0.0
        # Ask the verifier for its last layer only, unless the user asked for all layers: replacing their request
        # would break the per-token split of `hidden_states` in the output.
        self.model_kwargs_overrides = {} if generation_config.output_hidden_states else {"output_hidden_states": -1}
        self.metrics = SpeculationMetrics(num_speculative_tokens=self.num_heads)
        self.num_drafted = 0  # drafts of the round now being verified; 0 during prefill
        self.from_lookup = False  # whether they came from prompt lookup (hybrid drafting)
        self.in_prefill = True
        self.hybrid = HybridDrafter.for_call(1, generation_config)
        self.confidences = None  # of the drafts now being verified
        self.nonfinite = False  # whether their drafting stopped at non-finite speculator logits
        self.stopwatch = Stopwatch(verifier.device if verifier is not None else speculator.device)
        self.step = self.verify_mark = None
        self.host_tokens, self.drafts, self.lookup = [], [], None  # for hybrid drafting, which reads the text
        self.controller = SpeculationController(
            lambda rows: cost_model_for(verifier if verifier is not None else speculator, rows),
            acceptance_for(speculator, "chain, sampled" if self.do_sample else "chain, greedy"), self.num_heads,
            schedule=generation_config.num_assistant_tokens_schedule,
        )  # fmt: skip

    @property
    def num_drafting_tokens(self) -> int:
        """The most drafts a round holds; transformers 5.25's assisted decoding sizes its cache rollback by it."""
        return max(self.num_heads, self.hybrid.num_tokens if self.hybrid else 0)

    def get_candidates(
        self,
        input_ids: torch.LongTensor,
        model_outputs: ModelOutput | None = None,
        is_first_iteration: bool = False,
        n_last_matches: int = 0,
        **kwargs,
    ) -> tuple[torch.LongTensor, torch.FloatTensor | None]:
        if is_first_iteration:
            # Nothing to draft from yet: let the prefill forward emit one token and give us its hidden state.
            self.in_prefill, self.num_drafted = True, 0
            return input_ids, None
        self.stopwatch.poll()
        last_hidden = model_outputs.hidden_states[-1]
        rejected = self.num_drafted - n_last_matches
        hidden = last_hidden[:, last_hidden.shape[1] - 1 - rejected]

        # Never draft a token the verifier could not emit: its forward also adds one token of its own.
        room = max(0, self.max_length - input_ids.shape[1] - 1)
        planned = self.controller.start_step(input_ids.shape[1] - 1, rows=1)
        self.step, depth = self.controller.step, min(self.controller.chain_depth(planned), room)
        self.from_lookup, lookup = False, None
        if self.hybrid is not None and room:
            (lookup,), (self.from_lookup,) = self.hybrid.propose([self.host_tokens], [0], [room])
            if self.from_lookup:  # the speculator's drafts would not be verified
                depth = 0
        if depth == 0 and not self.from_lookup:  # a plain step: nothing to draft or read
            self.num_drafted, self.nonfinite, self.confidences, self.drafts, self.lookup = 0, False, None, [], lookup
            self.verify_mark = self.stopwatch.start()
            return input_ids, None
        self.draft_scores = []
        chain = self._draft(input_ids, hidden, depth)
        # One transfer: the drafts and what ends them (an unsure draft, non-finite logits, the controller, an EOS).
        tokens, limits, confidences, nonfinite = to_host(chain.tokens, chain.limits, chain.confidences,
                                                         chain.nonfinite)  # fmt: skip
        count = limits[0]
        if depth > 1 and self.controller.cuts:
            count = min(count, self.controller.chain_end(confidences, limits))
        drafts = tokens[0][1 : count + 1]
        if self.from_lookup:
            drafts = lookup
        # Nothing after an end-of-sequence draft could be emitted. Ending the chain there also keeps transformers
        # before 5.18 lossless: its assisted decoding stops at an end-of-sequence token only when it comes last.
        ends = [i for i, token in enumerate(drafts) if token in self.eos_token_ids]
        drafts = drafts[: ends[0] + 1] if ends else drafts
        self.drafts, self.lookup = drafts, lookup
        self.num_drafted, self.nonfinite = len(drafts), bool(nonfinite[0])
        self.confidences = None if confidences is None else [confidences[0][: self.num_drafted]]
        if self.from_lookup:
            candidates = torch.tensor([drafts], device=input_ids.device)
        else:
            candidates = chain.tokens[:, 1 : self.num_drafted + 1]
        logits = None  # greedy, or a plain step: transformers checks the drafts against its own argmax
        if self.do_sample and self.num_drafted and self.from_lookup:  # a deterministic proposal: q is one-hot
            logits = torch.full((1, self.num_drafted, self.speculator.config.vocab_size), float("-inf"),
                                device=candidates.device).scatter_(-1, candidates[..., None], 0.0)  # fmt: skip
        elif self.do_sample and self.num_drafted:
            logits = torch.stack(self.draft_scores[: self.num_drafted], dim=1)
        self.verify_mark = self.stopwatch.start()
        return torch.cat([input_ids, candidates], dim=-1), logits

    def _draft(self, input_ids, hidden, depth: int) -> DraftTree:
        """`depth` heads of the speculator's chain, timed; logits processors see the drafts as the verifier will."""

        def process(scores, drafts):
            if not self.logits_processor:
                return scores
            return self.logits_processor(input_ids if drafts is None else torch.cat([input_ids, drafts], 1), scores)

        mark = self.stopwatch.start()
        chain = draft_chain(
            self.speculator.speculator, hidden.to(self.speculator.device, self.speculator.dtype), input_ids[:, -1],
            torch.full((1,), depth, device=input_ids.device), depth, process, self.select, self.confidence_threshold,
        )  # fmt: skip
        timing, step = self.stopwatch.stop(mark), self.step
        if depth:
            self.stopwatch.report(timing, lambda seconds: self.controller.record_drafts(step, depth, seconds))
        return chain

    def select(self, scores: torch.FloatTensor, head: int) -> torch.LongTensor:
        """Picks draft `head` from processed scores as the verifier picks its tokens: argmax, or a sample."""
        if not self.do_sample:
            return scores.argmax(dim=-1)
        self.draft_scores.append(scores)
        return torch.multinomial(scores.softmax(dim=-1), num_samples=1).squeeze(1)

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, num_matches: int):
        timing = None if self.in_prefill else self.stopwatch.stop(self.verify_mark)
        if self.hybrid is not None:  # lookup reads the text on the host: the one read of the device it adds
            emitted = input_ids[0, len(self.host_tokens) :].tolist()
            self.host_tokens += emitted
            if not self.in_prefill:
                self.hybrid.record([0], [self.lookup or []], [self.from_lookup], [self.drafts], [emitted])
        if self.in_prefill:
            self.in_prefill = False
            return
        num_matches = int(num_matches)  # an int from transformers 5.18 or so on; a tensor, read here, before
        self.metrics.record_step(self.num_drafted, num_matches, from_lookup=self.from_lookup, nonfinite=self.nonfinite)
        if self.from_lookup:  # the controller sizes the speculator's chains: lookup steps are not its to learn from
            return
        step, depth = self.step, self.num_drafted
        self.stopwatch.report(timing, lambda seconds: self.controller.end_step(step, depth, seconds))
        if self.num_drafted:
            self.controller.acceptance.record(self.confidences, [self.num_drafted], [num_matches])
        # transformers has read the verifier's output to count the matches: its forward is done, waiting costs nothing.
        self.stopwatch.poll(wait=True)
        self.controller.report_to(self.metrics)
