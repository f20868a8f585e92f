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

import numpy as np
import torch

from .drafts import Drafts

# Weight of the latest step in a source's running score: a few steps are enough to follow the text from copied to
# free-form and back.
RECENT_WEIGHT = 0.5


def lookup_continuation(ids: list[int], max_ngram_size: int, num_tokens: int) -> list[int]:
    """
    The up to `num_tokens` tokens that follow the latest earlier occurrence in `ids` of its last n tokens, for the
    largest `n <= max_ngram_size` that occurs; `[]` when none does. The latest occurrence is the one nearest the text
    being written, as when a copy advances through its source. On the host: the loop keeps every row's tokens there.
    """
    ids = np.asarray(ids)
    for n in range(min(max_ngram_size, len(ids) - 1), 0, -1):
        # Windows that start before the suffix itself and leave at least one token after them.
        windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)
        starts = np.flatnonzero((windows == ids[-n:]).all(axis=1))
        if len(starts):
            start = int(starts[-1]) + n
            return ids[start : start + num_tokens].tolist()
    return []


class HybridDrafter:
    """
    Chooses each row's source for a step, and keeps per row (by its original index, as finished rows leave the batch)
    a running score of how many tokens each source's drafts matched of what the verifier emitted next. All on the
    host, from the tokens the loop keeps there.
    """

    def __init__(self, rows: int, num_tokens: int, max_ngram_size: int | None):
        self.num_tokens, self.max_ngram_size = num_tokens, max_ngram_size or 2  # transformers' default
        self.lookup_score = [0.0] * rows
        self.speculator_score = [0.0] * rows

    @classmethod
    def for_call(cls, rows: int, generation_config) -> "HybridDrafter | None":
        """The drafter a `generate()` call asks for with `prompt_lookup_num_tokens`, or None."""
        if not generation_config.prompt_lookup_num_tokens:
            return None
        return cls(rows, generation_config.prompt_lookup_num_tokens, generation_config.max_matching_ngram_size)

    def propose(self, sequences: list[list[int]], rows: list[int], room: list[int]):
        """
        For `rows` (original indices) of `sequences`, each at most `room[i]` drafts long: each row's lookup
        continuation, and whether the row drafts from it this step (else from the speculator).
        """
        lookup = [lookup_continuation(sequences[row], self.max_ngram_size, min(self.num_tokens, limit))
                  for row, limit in zip(rows, room)]  # fmt: skip
        use_lookup = [bool(found) and prefers for found, prefers in zip(lookup, self.prefers_lookup(rows))]
        return lookup, use_lookup

    def prefers_lookup(self, rows: list[int]) -> list[bool]:
        return [self.lookup_score[row] > self.speculator_score[row] for row in rows]

    def record(self, rows, lookup, use_lookup, drafts, emitted) -> None:
        """
        Scores a step: row `rows[i]` verified `drafts[i]` (from lookup where `use_lookup[i]`, whose continuation was
        `lookup[i]`), and the verifier emitted `emitted[i]`. A row that drafted from lookup ran no head this step: its
        speculator score waits for the next one that does.
        """
        for row, found, use, verified, tokens in zip(rows, lookup, use_lookup, drafts, emitted):
            if found:
                self.lookup_score[row] = _blend(self.lookup_score[row], _matched(found, tokens))
            if not use:
                self.speculator_score[row] = _blend(self.speculator_score[row], _matched(verified, tokens))


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


def lookup_drafts(lookup: list[list[int]], use_lookup: list[bool], device):
    """
    The rows that draft from lookup and their continuations, on the device in one transfer: `(use, drafts)`, where
    `drafts[i, 0]` is row `i`'s count and `drafts[i, 1:]` its tokens.
    """
    width = max([0, *(len(found) for found, use in zip(lookup, use_lookup) if use)])
    host = [[int(use), *([len(found), *found, *[0] * (width - len(found))] if use else [0] * (width + 1))]
            for found, use in zip(lookup, use_lookup)]  # fmt: skip
    host = torch.tensor(host, device=device)
    return host[:, 0].bool(), host[:, 1:]


def with_lookup(speculator_chain: Drafts, use_lookup, lookup) -> Drafts:
    """One chain per row: the `lookup_drafts` where `use_lookup[i]`, else the speculator's drafts."""
    counts, tokens = lookup[:, 0], lookup[:, 1:]
    depth = max(speculator_chain.max_depth, tokens.shape[1])

    def widened(t):
        return torch.cat([t, t.new_zeros(len(t), depth - t.shape[1])], dim=1)

    drafts = torch.where(use_lookup[:, None], widened(tokens), widened(speculator_chain.tokens[:, 1:]))
    confidences = speculator_chain.confidences  # the controller learns the speculator's acceptance from them
    return Drafts(torch.cat([speculator_chain.tokens[:, :1], drafts], dim=1),
                  torch.where(use_lookup, counts, speculator_chain.limits), depth,
                  None if confidences is None else widened(confidences), speculator_chain.nonfinite)  # fmt: skip
