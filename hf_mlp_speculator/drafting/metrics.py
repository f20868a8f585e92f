"""Counters of one speculative `generate()` call, with vLLM's names for the derived rates."""

from dataclasses import dataclass, field


@dataclass
class SpeculationMetrics:
    """
    What the speculator achieved during one `generate()` call. After the call it is on the speculator as
    `speculator.speculation_metrics`.

    Only decode steps count: the prefill forward, which emits the first token and drafts nothing, is left out, as vLLM
    does. A step is one verifier forward that checked `k >= 0` drafts and emitted between 1 and `k + 1` tokens. In a
    batch, the token counters add up the rows, and the cost counters count verifier forwards.

    The cost-aware controller's record: `steps_by_depth[k]` verifier forwards checked `k` drafts (0: a plain decoding
    step), taking `verify_seconds_by_depth[k]` seconds in all; draft head `h` ran `draft_runs_by_head[h]` times in
    `draft_seconds_by_head[h]` seconds. `mean_verify_seconds` and `mean_draft_seconds` divide them.
    """

    num_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0
    # Sum over steps of (k + 1): what the steps could have emitted had every draft been accepted.
    max_emitted_tokens: int = 0
    # Per head i: how many steps drafted with head i, and in how many of those drafts 0..i were all accepted.
    head_draft_tokens: list[int] = field(default_factory=list)
    head_accepted_tokens: list[int] = field(default_factory=list)
    # Of the drafts above, those that prompt lookup proposed (hybrid drafting); the rest are the speculator's.
    num_lookup_draft_tokens: int = 0
    num_lookup_accepted_tokens: int = 0
    # Steps in which the speculator's logits were not finite (NaN or inf), so that drafting stopped early.
    num_nonfinite_steps: int = 0
    # The configured lookahead k: min(n_predict, num_assistant_tokens).
    num_speculative_tokens: int = 0
    steps_by_depth: list[int] = field(default_factory=list)
    verify_seconds_by_depth: list[float] = field(default_factory=list)
    draft_runs_by_head: list[int] = field(default_factory=list)
    draft_seconds_by_head: list[float] = field(default_factory=list)
    # The most slots per row the KV cache held (batched, tree and sampled decoding, where rows share one rectangular
    # cache; 0 where transformers' one-sequence loop holds exactly the sequence).
    cache_slots: int = 0

    def record_step(self, num_drafted: int, num_accepted: int, from_lookup: bool = False, nonfinite: bool = False):
        """
        Counts one verifier step that checked `num_drafted` drafts and accepted the first `num_accepted`; the drafts
        came from prompt lookup when `from_lookup`; drafting stopped at non-finite speculator logits when `nonfinite`.
        Per-head counts are the speculator's heads only.
        """
        self.num_steps += 1
        self.num_nonfinite_steps += int(nonfinite)
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        self.num_emitted_tokens += num_accepted + 1
        self.max_emitted_tokens += num_drafted + 1
        if from_lookup:
            self.num_lookup_draft_tokens += num_drafted
            self.num_lookup_accepted_tokens += num_accepted
            return
        missing = num_drafted - len(self.head_draft_tokens)
        if missing > 0:
            self.head_draft_tokens += [0] * missing
            self.head_accepted_tokens += [0] * missing
        for head in range(num_drafted):
            self.head_draft_tokens[head] += 1
            self.head_accepted_tokens[head] += int(head < num_accepted)

    def __add__(self, other: "SpeculationMetrics") -> "SpeculationMetrics":
        """The counters of two calls added up, as if they had been one call."""
        heads = max(len(self.head_draft_tokens), len(other.head_draft_tokens))

        def padded(counts):
            return counts + [0] * (heads - len(counts))

        def added(a, b):
            width = max(len(a), len(b))
            return [x + y for x, y in zip(a + [0] * (width - len(a)), b + [0] * (width - len(b)))]

        return SpeculationMetrics(
            num_speculative_tokens=max(self.num_speculative_tokens, other.num_speculative_tokens),
            steps_by_depth=added(self.steps_by_depth, other.steps_by_depth),
            verify_seconds_by_depth=added(self.verify_seconds_by_depth, other.verify_seconds_by_depth),
            draft_runs_by_head=added(self.draft_runs_by_head, other.draft_runs_by_head),
            draft_seconds_by_head=added(self.draft_seconds_by_head, other.draft_seconds_by_head),
            num_steps=self.num_steps + other.num_steps,
            num_draft_tokens=self.num_draft_tokens + other.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens + other.num_accepted_tokens,
            num_emitted_tokens=self.num_emitted_tokens + other.num_emitted_tokens,
            max_emitted_tokens=self.max_emitted_tokens + other.max_emitted_tokens,
            head_draft_tokens=[a + b for a, b in zip(padded(self.head_draft_tokens), padded(other.head_draft_tokens))],
            head_accepted_tokens=[
                a + b for a, b in zip(padded(self.head_accepted_tokens), padded(other.head_accepted_tokens))
            ],
            num_lookup_draft_tokens=self.num_lookup_draft_tokens + other.num_lookup_draft_tokens,
            num_lookup_accepted_tokens=self.num_lookup_accepted_tokens + other.num_lookup_accepted_tokens,
            num_nonfinite_steps=self.num_nonfinite_steps + other.num_nonfinite_steps,
            cache_slots=max(self.cache_slots, other.cache_slots),
        )

    @property
    def draft_acceptance_rate(self) -> float:
        """Accepted drafts / drafted tokens."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def system_efficiency(self) -> float:
        """vLLM's figure: emitted tokens / (steps x (k + 1)), k the configured lookahead (`num_speculative_tokens`)."""
        possible = self.num_steps * (self.num_speculative_tokens + 1)
        return self.num_emitted_tokens / possible if possible else 0.0

    @property
    def verified_efficiency(self) -> float:
        """Emitted tokens / the positions the verifier checked, i.e. emitted / sum over steps of (drafts made + 1)."""
        return self.num_emitted_tokens / self.max_emitted_tokens if self.max_emitted_tokens else 0.0

    @property
    def mean_verify_seconds(self) -> dict[int, float]:
        """{k: mean seconds of a verifier forward that checked k drafts}, for the k that ran."""
        return {k: s / n for k, (n, s) in enumerate(zip(self.steps_by_depth, self.verify_seconds_by_depth)) if n}

    @property
    def mean_draft_seconds(self) -> list[float]:
        """Mean seconds of each draft head's step."""
        return [s / n if n else 0.0 for n, s in zip(self.draft_runs_by_head, self.draft_seconds_by_head)]

    @property
    def mean_tokens_per_step(self) -> float:
        """Tokens emitted per verifier forward; plain decoding scores exactly 1."""
        return self.num_emitted_tokens / self.num_steps if self.num_steps else 0.0

    @property
    def head_acceptance_rates(self) -> list[float]:
        """
        For head i: accepted drafts of head i / drafts head i made (`head_accepted_tokens[i] / head_draft_tokens[i]`),
        i.e. of the steps that drafted with head i, the share in which drafts 0..i were all right. The denominator
        counts only the steps that drafted that deep, so it is not conditional on the earlier drafts being accepted.
        """
        return [a / d if d else 0.0 for a, d in zip(self.head_accepted_tokens, self.head_draft_tokens)]

    @property
    def lookup_acceptance_rate(self) -> float:
        """Accepted / drafted tokens of the drafts prompt lookup proposed."""
        return self.num_lookup_accepted_tokens / self.num_lookup_draft_tokens if self.num_lookup_draft_tokens else 0.0

    @property
    def speculator_acceptance_rate(self) -> float:
        """Accepted / drafted tokens of the drafts the speculator proposed."""
        drafted = self.num_draft_tokens - self.num_lookup_draft_tokens
        return (self.num_accepted_tokens - self.num_lookup_accepted_tokens) / drafted if drafted else 0.0

    def __str__(self) -> str:
        heads = ", ".join(f"{rate:.3f}" for rate in self.head_acceptance_rates)
        lookup = (
            f" Prompt lookup: {self.num_lookup_accepted_tokens} of {self.num_lookup_draft_tokens} drafts accepted; "
            f"speculator: {self.num_accepted_tokens - self.num_lookup_accepted_tokens} of "
            f"{self.num_draft_tokens - self.num_lookup_draft_tokens}."
        ) * bool(self.num_lookup_draft_tokens)
        depths = ", ".join(f"k={k}: {n}" for k, n in enumerate(self.steps_by_depth) if n)
        verify = ", ".join(f"k={k}: {s * 1000:.1f}" for k, s in self.mean_verify_seconds.items())
        draft = ", ".join(f"{s * 1000:.2f}" for s in self.mean_draft_seconds)
        return (
            f"Speculative metrics: Draft acceptance rate: {self.draft_acceptance_rate:.3f}, "
            f"System efficiency: {self.system_efficiency:.3f}, "
            f"Verified efficiency: {self.verified_efficiency:.3f}, "
            f"Number of speculative tokens: {self.num_speculative_tokens}, "
            f"Number of accepted tokens: {self.num_accepted_tokens}, "
            f"Number of draft tokens: {self.num_draft_tokens}, "
            f"Number of emitted tokens: {self.num_emitted_tokens}, "
            f"Mean tokens per step: {self.mean_tokens_per_step:.3f}, "
            f"Per-head acceptance rate: [{heads}], "
            f"Steps by drafts verified: [{depths}], "
            f"Verify ms by k: [{verify}], "
            f"Draft ms by head: [{draft}]."
            f"{lookup}"
        )
