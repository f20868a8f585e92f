"""Drafts for transformers' assisted decoding loop, from an MLPSpeculator and the verifier's own hidden states."""

import torch
from transformers import GenerationConfig, LogitsProcessorList
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.utils import ModelOutput

from ..drafting.drafter import Drafter, StepRecord
from ..drafting.drafts import Drafts, HostDrafts
from ..models.modeling_mlp_speculator import MLPSpeculatorPreTrainedModel
from ..utils.host_transfer import to_host


class MLPSpeculatorCandidateGenerator(CandidateGenerator):
    """
    The way into transformers' own assisted decoding (`_assisted_decoding`), through the `requires_model_outputs`
    protocol. `generate(assistant_model=speculator)` runs the package's own loop (`speculative_decoding`) unless the
    call asks for what only transformers' loop gives: `speculative_sampling="rejection"`, or per-token scores,
    logits, attentions or hidden states in the output. Both loops draft with the same `Drafter`.

    Each round it reads the verifier's last hidden states from the previous forward and drafts as many tokens as the
    drafter plans (none: the round is a plain decoding step). The draft starts from the hidden state at the position
    that emitted the last token: after prefill the last prompt position; after a round that checked `k` drafts and
    accepted `m` of them, row `m` of the `k + 1` verified positions (the rows after it saw rejected drafts). The
    verifier's forward is timed from the end of `get_candidates` to `update_candidate_strategy`, which transformers
    calls right after it.

    Sampled rounds draw each draft from the speculator's logits after the same logits processors as the verifier's,
    and return those processed logits (one-hot for a prompt-lookup draft), so that transformers' rejection sampling
    divides by the distribution each draft was really drawn from and the output follows the verifier's distribution
    exactly.
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
        self.draft_scores = []  # the processed scores each draft of this round was sampled from
        self.logits_processor = logits_processor
        verifier = verifier if verifier is not None else speculator
        self.drafter = Drafter(verifier, speculator, generation_config, 1, picker=self,
                               logits_processor=logits_processor)  # fmt: skip
        self.drafter.finish()  # the call's metrics are on the speculator from the start
        # Ask the verifier for its last layer only, unless the user asked for all layers: replacing their request
        # would break the per-token split of `hidden_states` in the output.
        self.model_kwargs_overrides = {} if generation_config.output_hidden_states else {"output_hidden_states": -1}
        self.in_prefill = True
        self.step = self.verify_mark = self.drafts = None
        self.host_tokens = []

    @property
    def num_drafted(self) -> int:
        """Drafts of the round now being verified; 0 during prefill."""
        return self.drafts.limits[0] if self.drafts is not None else 0

    @property
    def num_drafting_tokens(self) -> int:
        """The most drafts a round holds; transformers 5.25's assisted decoding sizes its cache rollback by it."""
        return self.drafter.num_drafting_tokens

    def get_candidates(
        self,
        input_ids: torch.LongTensor,
        *,
        model_outputs: ModelOutput | None,
        is_first_iteration: bool,
        n_last_matches: int,
        **kwargs,
    ) -> tuple[torch.LongTensor, torch.FloatTensor | None]:
        # No defaults: a transformers that renamed one of these would otherwise leave it at its default here and draft
        # from the wrong row, silently; tests/test_pruning.py checks the rows themselves on every supported release.
        if is_first_iteration:
            # Nothing to draft from yet: let the prefill forward emit one token and give us its hidden state.
            self.in_prefill, self.drafts = True, None
            return input_ids, None
        last_hidden = model_outputs.hidden_states[-1]
        rejected = self.num_drafted - n_last_matches
        hidden = last_hidden[:, last_hidden.shape[1] - 1 - rejected]

        self.step = self.drafter.start_step(input_ids.shape[1] - 1, [0], [input_ids.shape[1]], [self.host_tokens])
        self.input_ids, self.draft_scores = input_ids, []
        chain = self.drafter.draft(self.step, hidden, input_ids[:, -1])
        self.drafts = HostDrafts([0], None, [False], None)  # a plain step: nothing to read
        if chain.num_nodes > 1:
            # One transfer. Nothing after an end-of-sequence draft could be emitted; ending the chain there also keeps
            # transformers before 5.18 lossless: its assisted decoding stops at one only when it comes last.
            self.drafts = Drafts.read(*to_host(*chain.to_read(tokens=True))).until_eos(self.drafter.eos_ids)
        self.verify_mark = self.drafter.start_verify()
        if not self.num_drafted:  # a plain step
            return input_ids, None
        candidates = chain.tokens[:, 1 : self.num_drafted + 1]
        logits = None  # greedy: transformers checks the drafts against its own argmax
        if self.drafter.sampled and self.step.from_lookup[0]:  # a deterministic proposal: q is one-hot
            logits = torch.full((1, self.num_drafted, self.speculator.config.vocab_size), float("-inf"),
                                device=candidates.device).scatter_(-1, candidates[..., None], 0.0)  # fmt: skip
        elif self.drafter.sampled:
            logits = torch.stack(self.draft_scores[: self.num_drafted], dim=1)
        return torch.cat([input_ids, candidates], dim=-1), logits

    def process_drafts(self, scores: torch.FloatTensor, drafts: list) -> torch.FloatTensor:
        """The logits processors, as the verifier will apply them after the drafts so far."""
        ids = self.input_ids if not drafts else torch.cat([self.input_ids, torch.stack(drafts, dim=1)], dim=1)
        return self.logits_processor(ids, scores)

    def select(self, scores: torch.FloatTensor, head: int) -> torch.LongTensor:
        """Picks draft `head` from processed scores as the verifier picks its tokens: a sample."""
        self.draft_scores.append(scores)
        return torch.multinomial(scores.softmax(dim=-1), num_samples=1).squeeze(1)

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, num_matches: int):
        if not self.in_prefill:
            self.drafter.stop_verify(self.step, self.verify_mark)
        emitted = []
        if self.drafter.hybrid is not None:  # lookup reads the text on the host: the one read of the device it adds
            emitted = input_ids[0, len(self.host_tokens) :].tolist()
            self.host_tokens += emitted
        if self.in_prefill:
            self.in_prefill = False
            return
        num_matches = int(num_matches)  # an int from transformers 5.18 or so on; a tensor, read here, before
        emitted = emitted or [0] * (num_matches + 1)  # only their count matters without lookup
        self.drafter.end_step(self.step, StepRecord([0], self.drafts, [num_matches], [emitted], self.num_drafted + 1))
        # transformers has read the verifier's output to count the matches: its forward is done, waiting costs nothing.
        self.drafter.finish()
