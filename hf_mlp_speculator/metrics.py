"""Counters of one speculative `generate()` call, with vLLM's names for the derived rates."""

from dataclasses import dataclass, field


@dataclass
class SpeculationMetrics:
    """
    What the speculator achieved during one `generate()` call. After the call it is on the speculator as
    `speculator.speculation_metrics`.

    Only decode steps count: the prefill forward, which emits the first token and drafts nothing, is left out, as vLLM
    does. A step is one verifier forward that checked `k >= 0` drafts and emitted between 1 and `k + 1` tokens.
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

    def record_step(self, num_drafted: int, num_accepted: int, from_lookup: bool = False) -> None:
        """
        Counts one verifier step that checked `num_drafted` drafts and accepted the first `num_accepted`; the drafts
        came from prompt lookup when `from_lookup`. Per-head counts are the speculator's heads only.
        """
        self.num_steps += 1
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

        return SpeculationMetrics(
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
        )

    @property
    def draft_acceptance_rate(self) -> float:
        """Accepted drafts / drafted tokens."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def system_efficiency(self) -> float:
        """Emitted tokens / the most the steps could have emitted, i.e. emitted / (steps x (k + 1))."""
        return self.num_emitted_tokens / self.max_emitted_tokens if self.max_emitted_tokens else 0.0

    @property
    def mean_tokens_per_step(self) -> float:
        """Tokens emitted per verifier forward; plain decoding scores exactly 1."""
        return self.num_emitted_tokens / self.num_steps if self.num_steps else 0.0

    @property
    def head_acceptance_rates(self) -> list[float]:
        """For head i: the share of its drafts accepted, i.e. how often drafts 0..i were all right."""
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
        return (
            f"Speculative metrics: Draft acceptance rate: {self.draft_acceptance_rate:.3f}, "
            f"System efficiency: {self.system_efficiency:.3f}, "
            f"Number of speculative tokens: {len(self.head_draft_tokens)}, "
            f"Number of accepted tokens: {self.num_accepted_tokens}, "
            f"Number of draft tokens: {self.num_draft_tokens}, "
            f"Number of emitted tokens: {self.num_emitted_tokens}, "
            f"Mean tokens per step: {self.mean_tokens_per_step:.3f}, "
            f"Per-head acceptance rate: [{heads}]."
            f"{lookup}"
        )
