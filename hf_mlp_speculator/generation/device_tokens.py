"""Each row's tokens on the device, for the logits processors and stopping criteria that read them.

The decoding loop checks the maximum length and end-of-sequence ids on the host, from the tokens it reads each step.
Any other stopping criterion, and every logits processor, reads the tokens on the device: there a `DeviceTokens`
keeps them, and calls each as plain `generate()` does, on the whole batch in its original order, once per distinct row
length, without reading the device.
"""

import torch
from transformers import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

# Processors that read nothing but the scores run once on all rows; any other runs once per distinct row length.
_SCORES_ONLY = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper, TypicalLogitsWarper,
                EpsilonLogitsWarper, EtaLogitsWarper)  # fmt: skip


class DeviceTokens:
    """
    `sequences` `(batch, max_length)`, each row's tokens padded with `pad`, and `lengths`, each row's length, for the
    rows of the call (the rows still generating are `rows`, by their index in the call; `host_ends` their lengths on
    the host).
    """

    def __init__(self, input_ids, max_length: int, pad: int, logits_processor, stopping_criteria):
        rows, prompt_length = input_ids.shape
        # int64 whatever the prompt's integer type, as the tokens plain generate() appends are
        self.sequences = torch.full((rows, max_length), pad, device=input_ids.device)
        self.sequences[:, :prompt_length] = input_ids
        self.lengths = torch.full((rows,), prompt_length, device=input_ids.device)
        self.logits_processor, self.stopping_criteria = logits_processor, stopping_criteria

    def append(self, tokens, counts, rows, host_ends: list[int]):
        """
        Writes up to `counts[i]` of `tokens[i]` (all of them where None) into each row's device copy, stopping a row
        where the stopping criteria say, without reading the device. Returns how many each row kept and whether it
        finished.
        """
        counts = torch.full_like(rows, tokens.shape[1]) if counts is None else counts
        kept = torch.zeros_like(counts)
        finished = torch.zeros_like(counts, dtype=torch.bool)
        ends, last = self.lengths[rows], self.sequences.shape[1] - 1
        for column in range(tokens.shape[1]):
            live = (column < counts) & ~finished
            where = (ends + column).clamp(max=last)  # rows not live write back what is there
            self.sequences[rows, where] = torch.where(live, tokens[:, column], self.sequences[rows, where])
            kept += live
            stop = _at_own_lengths(lambda ids, _: self.stopping_criteria(ids, None), self.sequences, rows,
                                   ends + column + 1, [min(end + column, last) + 1 for end in host_ends])  # fmt: skip
            finished |= live & stop.bool()
        self.lengths[rows] = ends + kept
        return kept, finished

    def process(self, scores, rows, host_ends: list[int], extra=None, depths=None, host_depths=None):
        """
        The logits processors, row `i` seeing its own tokens followed by `extra[i, :depths[i]]` (all of `extra` when
        `depths` is None; `host_depths` is the same on the host).
        """
        ids, ends = self.sequences, self.lengths[rows]
        if extra is not None and extra.shape[1]:
            width = extra.shape[1]
            ids = torch.cat([self.sequences, self.sequences.new_zeros(len(ids), width)], dim=1)
            where = ends[:, None] + torch.arange(width, device=ends.device)
            ids[rows] = ids[rows].scatter(1, where, extra)
            ends = ends + (width if depths is None else depths)
            host_ends = [end + d for end, d in zip(host_ends, host_depths or [width] * len(host_ends))]
        for processor in self.logits_processor:
            if isinstance(processor, _SCORES_ONLY):
                scores = processor(ids[rows], scores)
            else:
                scores = _at_own_lengths(processor, ids, rows, ends, host_ends, scores)
        return scores


def _at_own_lengths(fn, ids, rows, ends, host_ends: list[int], values=None):
    """
    `fn(ids[:, :end], values)` for each row of `rows` at its own length `ends[i]` (`host_ends[i]` on the host), called
    as plain `generate()` calls logits processors and stopping criteria: on the whole batch, in its original order
    (some keep per-row state, such as the repetition penalty's prompt padding), once per distinct length. `values`
    holds one entry per row of `rows`. Nothing is read from the device.
    """
    full = None if values is None else values.new_zeros((ids.shape[0], *values.shape[1:]))
    if full is not None:
        full[rows] = values
    out = None
    for end in sorted(set(host_ends)):
        result = fn(ids[:, :end], None if full is None else full.clone())[rows]
        hit = (ends == end).view(-1, *[1] * (result.dim() - 1))
        out = torch.where(hit, result, torch.zeros_like(result) if out is None else out)
    return out
