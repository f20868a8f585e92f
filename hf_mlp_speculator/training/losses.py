"""The speculator's training loss, distillation from the base model's distribution, and the acceptance it implies.

Head `i` learns, at every row of the targets, the base model's distribution over the token `i + 1` after the one it
reads. `soft` distillation is the cross-entropy against the base's top-k probabilities (all the information the base
gives about a position, where the hard label keeps one token of it); `hard` is the cross-entropy against the token that
followed; `mix` averages the two. A reduced draft vocabulary scores only its own tokens: the base's mass on other tokens
is unreachable, and a hard label outside it is not learned.

Losses are token means over the whole global batch (every position and head counts once, whatever the micro-batch and
process it lands in), so gradient accumulation and data parallelism compute exactly what one large batch would.
"""

from dataclasses import dataclass

import torch

LOSSES = ("soft", "hard", "mix")
IGNORE_INDEX = -100


@dataclass
class Batch:
    """
    Position-level training examples for `n` heads (`B` positions):

    Args:
        states (`torch.Tensor` of shape `(B, hidden_size)`): the base model's hidden state at each position.
        input_ids (`torch.LongTensor` of shape `(B, n + 1)`): column `i` is head `i`'s input token (the last column only
            pads to the speculator's `sequence_length + n_predict` layout).
        labels (`torch.LongTensor` of shape `(n, B)`): head `i`'s hard target, a base id; -100 where the sequence ended.
        soft_ids (`torch.LongTensor` of shape `(n, B, top_k)`): the base's most likely tokens there...
        soft_logprobs (`torch.Tensor` of shape `(n, B, top_k)`): ...and their log-probabilities.
    """

    states: torch.Tensor
    input_ids: torch.LongTensor
    labels: torch.LongTensor
    soft_ids: torch.LongTensor
    soft_logprobs: torch.Tensor

    def split(self, size: int) -> list["Batch"]:
        parts = zip(
            self.states.split(size), self.input_ids.split(size), self.labels.split(size, dim=1),
            self.soft_ids.split(size, dim=1), self.soft_logprobs.split(size, dim=1),
        )  # fmt: skip
        return [Batch(*part) for part in parts]

    def to(self, device) -> "Batch":
        return Batch(*(t.to(device) for t in (self.states, self.input_ids, self.labels, self.soft_ids,
                                              self.soft_logprobs)))  # fmt: skip


def draft_index(draft_vocab: torch.LongTensor | None, vocab_size: int, device=None) -> torch.LongTensor:
    """`index[base_id]`: the id's position in the draft vocabulary, or -100 outside it."""
    if draft_vocab is None:
        return torch.arange(vocab_size, device=device)
    index = torch.full((vocab_size,), IGNORE_INDEX, dtype=torch.long, device=device)
    index[draft_vocab.to(device)] = torch.arange(len(draft_vocab), device=device)
    return index


def token_losses(logits: torch.Tensor, batch: Batch, index: torch.LongTensor, loss: str) -> torch.Tensor:
    """
    `(n, B)` per-position losses of `logits [n, B, draft vocab]` (0 where the sequence ended). `index` maps base ids
    into the draft vocabulary (`draft_index`).
    """
    logprobs = logits.float().log_softmax(dim=-1)
    valid = batch.labels != IGNORE_INDEX
    labels = index[batch.labels.clamp(min=0)]
    hard = -logprobs.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1) * (labels != IGNORE_INDEX)
    if loss == "hard":
        return hard * valid
    soft_ids = index[batch.soft_ids]
    reachable = soft_ids != IGNORE_INDEX
    soft = -(batch.soft_logprobs.float().exp() * reachable * logprobs.gather(-1, soft_ids.clamp(min=0))).sum(-1)
    if loss == "soft":
        return soft * valid
    return 0.5 * (soft + hard) * valid


@torch.no_grad()
def acceptance_counts(logits: torch.Tensor, batch: Batch, draft_vocab: torch.LongTensor | None) -> torch.Tensor:
    """
    `[3, n]` counts for the metrics: head i's top-1 hits on the hard labels, the positions where heads 0..i were all
    right (head i's greedy draft accepted), and head i's positions.
    """
    predictions = logits.argmax(dim=-1)
    if draft_vocab is not None:
        predictions = draft_vocab[predictions]
    valid = batch.labels != IGNORE_INDEX
    hits = (predictions == batch.labels) & valid
    accepted = hits.long().cumprod(dim=0).bool()
    return torch.stack([hits.sum(1), accepted.sum(1), valid.sum(1)]).float()
