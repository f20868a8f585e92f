"""Drafts for transformers' assisted decoding loop, from an MLPSpeculator and the verifier's own hidden states."""

import time

import torch
from transformers import GenerationConfig, LogitsProcessorList
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.utils import ModelOutput

from .controller import SpeculationController, acceptance_for
from .cost_model import cost_model_for, synchronize
from .drafting import draft_chain
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
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        device = verifier.device if verifier is not None else None
        self.eos_token_ids = torch.tensor(eos, dtype=torch.long, device=device)
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
        self.verify_start = 0.0
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

        last_hidden = model_outputs.hidden_states[-1]
        rejected = self.num_drafted - n_last_matches
        hidden = last_hidden[:, last_hidden.shape[1] - 1 - rejected]

        # Never draft a token the verifier could not emit: its forward also adds one token of its own.
        room = max(0, self.max_length - input_ids.shape[1] - 1)
        self.num_drafted, self.from_lookup = min(self.num_heads, room), False
        if self.controller.start_step(input_ids.shape[1] - 1, rows=1) == 0:
            self.num_drafted = 0  # the speculator's drafts would not pay; prompt lookup's still may
        if room == 0 or (self.num_drafted == 0 and self.hybrid is None):
            self.confidences, self.nonfinite = None, False
            return self._verify_from_now(input_ids)

        def process(scores, drafts):
            if not self.logits_processor:
                return scores
            return self.logits_processor(input_ids if drafts is None else torch.cat([input_ids, drafts], 1), scores)

        hidden = hidden.to(self.speculator.device, self.speculator.dtype)

        def speculator_chain(skip=None):
            limit = 0 if skip is not None and bool(skip[0]) else self.num_drafted
            return draft_chain(
                self.speculator.speculator, hidden, input_ids[:, -1], torch.tensor([limit], device=input_ids.device),
                process, self.select, self.confidence_threshold, self.controller.keep_drafting,
            )  # fmt: skip

        self.draft_scores = []
        if self.hybrid is None:
            chain = speculator_chain()
        else:
            length, rows = torch.tensor([input_ids.shape[1]]), torch.tensor([0])
            chain, from_lookup = self.hybrid(speculator_chain, input_ids, length, rows, torch.tensor([room]))
            self.from_lookup = bool(from_lookup[0])
        drafts = chain.tokens[:, 1:]
        # Nothing after an end-of-sequence draft could be emitted. Ending the chain there also keeps transformers
        # before 5.18 lossless: its assisted decoding stops at an end-of-sequence token only when it comes last.
        ends = torch.isin(drafts[0], self.eos_token_ids.to(drafts.device))
        if ends.any():
            drafts = drafts[:, : int(ends.nonzero()[0]) + 1]
        self.num_drafted = drafts.shape[1]  # fewer than asked if the chain stopped at an unsure draft
        self.confidences = None if chain.confidences is None else chain.confidences[:, : self.num_drafted]
        self.nonfinite = chain.nonfinite is not None and bool(chain.nonfinite[0])
        logits = None  # greedy, or a plain step: transformers checks the drafts against its own argmax
        if self.do_sample and self.num_drafted and self.from_lookup:  # a deterministic proposal: q is one-hot
            logits = torch.full((1, self.num_drafted, self.speculator.config.vocab_size), float("-inf"),
                                device=drafts.device).scatter_(-1, drafts[..., None], 0.0)  # fmt: skip
        elif self.do_sample and self.num_drafted:
            logits = torch.stack(self.draft_scores[: self.num_drafted], dim=1)
        return self._verify_from_now(torch.cat([input_ids, drafts], dim=-1), logits)

    def _verify_from_now(self, candidates, logits=None):
        synchronize(candidates.device)
        self.verify_start = time.perf_counter()
        return candidates, logits

    def select(self, scores: torch.FloatTensor, head: int) -> torch.LongTensor:
        """Picks draft `head` from processed scores as the verifier picks its tokens: argmax, or a sample."""
        if not self.do_sample:
            return scores.argmax(dim=-1)
        self.draft_scores.append(scores)
        return torch.multinomial(scores.softmax(dim=-1), num_samples=1).squeeze(1)

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, num_matches: int):
        if self.in_prefill:
            self.in_prefill = False
            return
        synchronize(input_ids.device)
        if self.from_lookup:  # the controller sizes the speculator's chains: lookup steps are not its to learn from
            self.metrics.record_step(self.num_drafted, int(num_matches), from_lookup=True, nonfinite=self.nonfinite)
            return
        self.controller.end_step(self.num_drafted, time.perf_counter() - self.verify_start)
        if self.num_drafted:
            self.controller.acceptance.record(self.confidences, [self.num_drafted], [int(num_matches)])
        self.metrics.record_step(self.num_drafted, int(num_matches), nonfinite=self.nonfinite)
        self.controller.report_to(self.metrics)
