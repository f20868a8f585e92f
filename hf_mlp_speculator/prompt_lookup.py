"""Hybrid drafting: prompt lookup next to the speculator, one source per row and step.

`generate(ids, assistant_model=speculator, prompt_lookup_num_tokens=n)` drafts each step from two sources: the
continuation of the longest n-gram (at most `max_matching_ngram_size`, transformers' default 2) that ends the row and
occurs earlier in it, prompt and generated text alike, up to `n` tokens; and the speculator's chain. Copying, editing
and answering from a given text repeat long spans of the context, which lookup drafts far better than a small head;
on open text the speculator wins.

Each row's step verifies one of the two, the one whose drafts have lately matched what the verifier emitted for
longer. Both are scored every step, the one not verified on the tokens the verifier emitted anyway, so neither needs
exploration. The choice reads only earlier steps, never the verifier's view of this step's drafts, so greedy output
stays identical and sampling exact: a lookup draft is a deterministic proposal, whose draft distribution is one-hot.
"""

import torch

from .drafting import DraftTree, tree_from_candidates

# Weight of the latest step in a source's running score: a few steps are enough to follow the text from copied to
# free-form and back.
RECENT_WEIGHT = 0.5


def lookup_continuations(sequences, lengths, max_ngram_size: int, num_tokens: int) -> list[list[int]]:
    """
    For each row `sequences[b, :lengths[b]]`, the up to `num_tokens` tokens that follow the latest earlier occurrence
    of its last n tokens, for the largest `n <= max_ngram_size` that occurs; `[]` when none does. The latest
    occurrence is the one nearest the text being written, as when a copy advances through its source.
    """
    continuations = []
    for row, length in zip(sequences, lengths.tolist()):
        ids = row[:length]
        continuation = []
        for n in range(min(max_ngram_size, length - 1), 0, -1):
            # Windows that start before the suffix itself and leave at least one token after them.
            windows = ids[:-1].unfold(0, n, 1)
            starts = (windows == ids[-n:]).all(dim=1).nonzero()
            if len(starts):
                start = int(starts[-1]) + n
                continuation = ids[start : start + num_tokens].tolist()
                break
        continuations.append(continuation)
    return continuations


class HybridDrafter:
    """
    Swaps lookup drafts into a step's speculator chains where they should pay, and keeps per row (by its original
    index, as finished rows leave the batch) a running score of how many tokens each source's drafts matched of what
    the verifier emitted next.
    """

    def __init__(self, rows: int, num_tokens: int, max_ngram_size: int | None):
        self.num_tokens, self.max_ngram_size = num_tokens, max_ngram_size or 2  # transformers' default
        self.lookup_score = torch.zeros(rows)
        self.speculator_score = torch.zeros(rows)
        self.pending = None  # the last step's (rows, lookup drafts, speculator drafts, lengths before it)

    @classmethod
    def for_call(cls, rows: int, generation_config) -> "HybridDrafter | None":
        """The drafter a `generate()` call asks for with `prompt_lookup_num_tokens`, or None."""
        if not generation_config.prompt_lookup_num_tokens:
            return None
        return cls(rows, generation_config.prompt_lookup_num_tokens, generation_config.max_matching_ngram_size)

    def __call__(self, draft_speculator, sequences, lengths, rows, room) -> tuple[DraftTree, torch.BoolTensor]:
        """
        The step's chains for `rows` (original indices) of `sequences[:, :lengths]`, each at most `room[b]` drafts
        long, and which rows draft from lookup. `draft_speculator(skip)` returns the speculator's chains, with no
        drafts for the rows in `skip`: heads that only lookup rows would use are never run.
        """
        self._score(sequences, lengths)
        lookup = lookup_continuations(sequences[rows], lengths[rows], self.max_ngram_size, self.num_tokens)
        lookup = [continuation[:limit] for continuation, limit in zip(lookup, room.tolist())]
        found = torch.tensor([len(c) > 0 for c in lookup])
        use_lookup = found & self.prefers_lookup(rows.cpu())
        chain = draft_speculator(use_lookup)
        depths = chain.depths.amax(dim=1).tolist()
        # A row that drafts from lookup ran no head this step: its speculator score waits for the next one that does.
        speculator = [None if use else tokens[1 : depth + 1]
                      for tokens, depth, use in zip(chain.tokens.tolist(), depths, use_lookup.tolist())]  # fmt: skip
        self.pending = (rows.tolist(), lookup, speculator, lengths[rows].tolist())
        return hybrid_chain(chain, lookup, use_lookup), use_lookup

    def prefers_lookup(self, rows) -> torch.BoolTensor:
        return self.lookup_score[rows] > self.speculator_score[rows]

    def _score(self, sequences, lengths) -> None:
        if self.pending is None:
            return
        for row, lookup, speculator, before in zip(*self.pending):
            emitted = sequences[row, before : int(lengths[row])].tolist()
            if lookup:
                self.lookup_score[row] = _blend(self.lookup_score[row], _matched(lookup, emitted))
            if speculator is not None:
                self.speculator_score[row] = _blend(self.speculator_score[row], _matched(speculator, emitted))
        self.pending = None


def _matched(drafts: list[int], emitted: list[int]) -> int:
    """How many of `drafts` the verifier emitted, in order from the first (the token after them is its own)."""
    count = 0
    for draft, token in zip(drafts, emitted):
        if draft != token:
            break
        count += 1
    return count


def _blend(score, value: int):
    return (1 - RECENT_WEIGHT) * score + RECENT_WEIGHT * value


def hybrid_chain(speculator_chain: DraftTree, lookup: list[list[int]], use_lookup) -> DraftTree:
    """One chain per row: the lookup continuation where `use_lookup[b]`, else the speculator's drafts."""
    tokens, last_tokens = speculator_chain.tokens[:, 1:], speculator_chain.tokens[:, 0]
    lookup_rows = use_lookup.nonzero().squeeze(1).tolist()
    counts = speculator_chain.depths.amax(dim=1).clone()
    for row in lookup_rows:
        counts[row] = len(lookup[row])
    depth = int(counts.max())
    candidates = tokens.new_zeros(len(lookup), 1, depth)
    candidates[:, 0, : min(depth, tokens.shape[1])] = tokens[:, :depth]
    for row in lookup_rows:
        candidates[row, 0] = 0
        candidates[row, 0, : len(lookup[row])] = torch.tensor(lookup[row])
    chain = tree_from_candidates(candidates, last_tokens, counts)
    if speculator_chain.confidences is not None:  # the controller learns the speculator's acceptance from them
        width = min(depth, speculator_chain.confidences.shape[1])
        chain.confidences = speculator_chain.confidences.new_zeros(len(lookup), depth)
        chain.confidences[:, :width] = speculator_chain.confidences[:, :width]
    chain.nonfinite = speculator_chain.nonfinite
    return chain
