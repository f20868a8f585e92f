"""Drafts for transformers' assisted decoding loop, from an MLPSpeculator and the verifier's own hidden states."""

import torch
from transformers import GenerationConfig, LogitsProcessorList
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.utils import ModelOutput

from .metrics import SpeculationMetrics
from .modeling_mlp_speculator import MLPSpeculatorPreTrainedModel


class MLPSpeculatorCandidateGenerator(CandidateGenerator):
    """
    Runs inside `_assisted_decoding` through the `requires_model_outputs` protocol: each round it reads the verifier's
    last hidden states from the previous forward and drafts up to `min(n_predict, num_assistant_tokens)` tokens, fewer
    when a draft falls below `assistant_confidence_threshold`.

    The draft starts from the hidden state at the position that emitted the last token. After prefill that is the last
    prompt position; after a round that checked `k` drafts and accepted `m` of them it is row `m` of the `k + 1`
    verified positions (the rows after it saw rejected drafts).

    With `do_sample=True`, drafts are sampled from the speculator's logits after the same logits processors as the
    verifier's, and those processed logits are returned, so that transformers' rejection sampling divides by the
    distribution each draft was really drawn from and the output follows the verifier's distribution exactly.
    """

    requires_model_outputs = True

    def __init__(
        self,
        speculator: MLPSpeculatorPreTrainedModel,
        generation_config: GenerationConfig,
        logits_processor: LogitsProcessorList | None = None,
    ):
        self.speculator = speculator
        self.do_sample = generation_config.do_sample
        self.logits_processor = logits_processor
        self.max_length = generation_config.max_length
        n_predict = speculator.config.n_predict
        self.num_heads = min(n_predict, generation_config.num_assistant_tokens or n_predict)
        # transformers' `assistant_confidence_threshold` (0.4 unless set), as its own assistants apply it: drafting
        # stops after a draft the speculator gave less than this probability, since the heads after it would rarely be
        # accepted and each costs a verified position. 0 drafts every head.
        self.confidence_threshold = generation_config.assistant_confidence_threshold or 0.0
        # Ask the verifier for its last layer only, unless the user asked for all layers: replacing their request
        # would break the per-token split of `hidden_states` in the output.
        self.model_kwargs_overrides = {} if generation_config.output_hidden_states else {"output_hidden_states": -1}
        self.metrics = SpeculationMetrics()
        self.num_drafted = 0  # drafts of the round now being verified; 0 during prefill
        self.in_prefill = True

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
        self.num_drafted = max(0, min(self.num_heads, self.max_length - input_ids.shape[1] - 1))
        if self.num_drafted == 0:
            return input_ids, None

        speculator = self.speculator.speculator
        state = speculator.input_state(hidden.to(self.speculator.device, self.speculator.dtype))
        token = input_ids[:, -1].to(self.speculator.device)
        candidate_ids, draft_logits = input_ids, []
        for head in range(self.num_drafted):
            state, logits = speculator.step(head, state, token)
            logits = logits.to(device=input_ids.device, dtype=torch.float32)
            if self.logits_processor:
                logits = self.logits_processor(candidate_ids, logits)
            token = self.select(logits)
            if self.do_sample:
                draft_logits.append(logits)
            candidate_ids = torch.cat([candidate_ids, token[:, None]], dim=-1)
            if head + 1 < self.num_drafted and logits.softmax(-1)[0, token[0]] < self.confidence_threshold:
                self.num_drafted = head + 1
                break
            token = token.to(self.speculator.device)
        return candidate_ids, torch.stack(draft_logits, dim=1) if self.do_sample else None

    def select(self, logits: torch.FloatTensor) -> torch.LongTensor:
        """Picks a draft from processed logits the way the verifier picks its tokens: argmax, or a sample."""
        if self.do_sample:
            return torch.multinomial(logits.softmax(dim=-1), num_samples=1).squeeze(1)
        return logits.argmax(dim=-1)

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, num_matches: int):
        if self.in_prefill:
            self.in_prefill = False
        else:
            self.metrics.record_step(self.num_drafted, int(num_matches))
