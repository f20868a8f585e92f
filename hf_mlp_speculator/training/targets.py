"""What a speculator learns from: the frozen base model's hidden states and next-token distributions, computed once.

The base model runs over each training sequence exactly once. At every position it leaves a `Targets` row: the hidden
state it drafts from, the token that followed, and the base's `top_k` most likely next tokens with their
log-probabilities (the soft labels of distillation). Training then runs epoch after epoch over these rows, and only the
speculator pays per step.

Two kinds of sequences give such rows:
- `continue_prompts`: the base model's own continuations of prompts (greedy or sampled), decoded in large batches, as
  in the reference's stage 2. The token after a state is the one the base emitted, as at inference.
- `teacher_force`: text from a corpus, in one parallel forward per batch (stage 1). The token after a state is the
  text's.

Rows are cached on disk by `TargetCache`, one file per batch of sequences, named after everything that determines
them (the base model's weights, the settings, the input token ids), so a rerun or a resumed run reuses them.
"""

import hashlib
import json
import os
import time
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from transformers import DynamicCache
from transformers.utils import logging

from ..generation.transformers_hooks import cache_kwargs
from ..utils.batching import left_padded
from .losses import IGNORE_INDEX, Batch
from .sharding import whole

logger = logging.get_logger(__name__)


@dataclass
class Targets:
    """
    Rows of several sequences, concatenated. Row `j` of a sequence that ends before row `end`:

    Args:
        states (`torch.Tensor` of shape `(rows, hidden_size)`, float16): the base model's last hidden state at row `j`.
        next_tokens (`torch.LongTensor` of shape `(rows,)`): the token that followed row `j`'s state.
        topk_ids (`torch.IntTensor` of shape `(rows, top_k)`): the base model's most likely tokens after row `j`.
        topk_logprobs (`torch.Tensor` of shape `(rows, top_k)`, float16): their log-probabilities.
        ends (`torch.LongTensor` of shape `(sequences,)`): where each sequence's rows end.

    Head `i` drafting from row `j` reads the token `next_tokens[j + i]` and learns the distribution of row `j + i + 1`
    (whose sampled or greedy token is `next_tokens[j + i + 1]`), as long as that row is in the same sequence.
    """

    states: torch.Tensor
    next_tokens: torch.LongTensor
    topk_ids: torch.IntTensor
    topk_logprobs: torch.Tensor
    ends: torch.LongTensor

    @classmethod
    def concatenate(cls, parts: list["Targets"]) -> "Targets":
        offsets = torch.tensor([0] + [len(p.next_tokens) for p in parts]).cumsum(0)
        return cls(
            states=torch.cat([p.states for p in parts]),
            next_tokens=torch.cat([p.next_tokens for p in parts]),
            topk_ids=torch.cat([p.topk_ids for p in parts]),
            topk_logprobs=torch.cat([p.topk_logprobs for p in parts]),
            ends=torch.cat([p.ends + offset for p, offset in zip(parts, offsets)]),
        )

    @classmethod
    def from_sequences(cls, states, next_tokens, topk_ids, topk_logprobs) -> "Targets":
        """From lists of per-sequence tensors `[T, E]`, `[T]`, `[T, top_k]` and `[T, top_k]`."""
        parts = [
            cls(s.to(torch.float16), t.long(), i.int(), lp.to(torch.float16), torch.tensor([len(t)]))
            for s, t, i, lp in zip(states, next_tokens, topk_ids, topk_logprobs)
        ]
        return cls.concatenate(parts)

    def __len__(self) -> int:
        return len(self.next_tokens)

    def draft_positions(self) -> torch.LongTensor:
        """The rows a head can learn from: every row but the last of its sequence (which no token follows)."""
        last = torch.zeros(len(self), dtype=torch.bool)
        last[self.ends - 1] = True
        return (~last).nonzero().squeeze(1)

    def batch(self, rows: torch.LongTensor, n_predict: int) -> Batch:
        """The training examples of `n_predict` heads drafting from `rows`."""
        ahead = rows[:, None] + torch.arange(n_predict + 1)  # the rows whose tokens head i reads and learns
        sequence_end = self.ends[torch.searchsorted(self.ends, rows, right=True)]
        inside = ahead < sequence_end[:, None]
        ahead = ahead.clamp(max=len(self) - 1)
        learned = ahead[:, 1:].T  # head i learns the distribution of row j + i + 1
        return Batch(
            states=self.states[rows].float(),
            input_ids=self.next_tokens[ahead] * inside,
            labels=torch.where(inside[:, 1:].T, self.next_tokens[learned], IGNORE_INDEX),
            soft_ids=self.topk_ids[learned].long(),
            soft_logprobs=torch.where(inside[:, 1:].T[..., None], self.topk_logprobs[learned].float(), -torch.inf),
        )

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def token_counts(self, vocab_size: int) -> torch.Tensor:
        """How often each token follows a state: what a draft vocabulary should cover."""
        return torch.bincount(self.next_tokens, minlength=vocab_size)


def end_of_sequence_ids(base, tokenizer) -> list[int]:
    """Every id that ends the base model's turn: its generation config's and its tokenizer's end-of-sequence ids."""
    eos = base.generation_config.eos_token_id
    return sorted({*([eos] if isinstance(eos, int) else eos or []), tokenizer.eos_token_id} - {None})


def top_logprobs(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `top_k` most likely tokens and their log-probabilities against the whole vocabulary, so that the soft labels
    carry the base model's real confidence (a logsumexp, not a softmax, over the vocabulary)."""
    values, ids = logits.float().topk(top_k, dim=-1)
    return ids, values - logits.float().logsumexp(dim=-1, keepdim=True)


def _new_token(logits: torch.Tensor, temperature: float, top_k: int, generator) -> torch.LongTensor:
    if temperature <= 0:
        return logits.argmax(dim=-1)
    if top_k:  # sampling from the top-k needs no softmax over the whole vocabulary
        values, ids = logits.topk(top_k, dim=-1)
        choice = torch.multinomial((values / temperature).softmax(dim=-1), 1, generator=generator)
        return ids.gather(1, choice).squeeze(1)
    return torch.multinomial((logits / temperature).softmax(dim=-1), 1, generator=generator).squeeze(1)


@torch.no_grad()
def continue_prompts(
    base,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_token_ids: list[int],
    pad_token_id: int,
    top_k: int,
    temperature: float = 0.0,
    sampling_top_k: int = 0,
    seed: int = 0,
    on_tokens=None,
) -> Targets:
    """
    The base model continues all `prompts` in one batch, left-padded, until each row emits an end-of-sequence token or
    `max_new_tokens`; finished rows leave the batch. One sequence of rows per prompt, from its last prompt position on.
    Greedy at temperature 0, else sampled (after `sampling_top_k`, if set) with a generator seeded by `seed`.
    `on_tokens(n)`, if given, hears of the `n` tokens of each decoding step (for a progress bar).
    """
    device = base.device
    generator = torch.Generator(device).manual_seed(seed)
    input_ids, mask = left_padded(prompts, pad_token_id, device)
    cache = DynamicCache(config=base.config)
    output = base(input_ids=input_ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                  use_cache=True, output_hidden_states=-1, logits_to_keep=1, **cache_kwargs(base, cache))  # fmt: skip
    positions = mask.sum(-1)
    rows = torch.arange(len(prompts), device=device)  # the prompt of each row still generating
    states, tokens, ids, logprobs = ([[] for _ in prompts] for _ in range(4))
    eos = torch.tensor(eos_token_ids, device=device)
    for step in range(max_new_tokens):
        state, step_logits = output.hidden_states[-1][:, -1], output.logits[:, -1].float()
        token = _new_token(step_logits, temperature, sampling_top_k, generator)
        step_ids, step_logprobs = top_logprobs(step_logits, top_k)
        if on_tokens is not None:
            on_tokens(len(rows))
        for row, prompt in enumerate(rows.tolist()):
            for kept, value in zip((states, tokens, ids, logprobs), (state, token, step_ids, step_logprobs)):
                kept[prompt].append(value[row])
        going = ~torch.isin(token, eos)
        if step == max_new_tokens - 1 or not going.any():
            break
        if not going.all():
            cache.batch_select_indices(going.nonzero().squeeze(1))
            rows, mask, positions, token = rows[going], mask[going], positions[going], token[going]
        mask = torch.cat([mask, mask.new_ones(len(rows), 1)], dim=1)
        output = base(input_ids=token[:, None], attention_mask=mask, position_ids=positions[:, None], use_cache=True,
                      output_hidden_states=-1, **cache_kwargs(base, cache))  # fmt: skip
        positions = positions + 1
    return Targets.from_sequences(
        *([torch.stack(row).cpu() for row in kept] for kept in (states, tokens, ids, logprobs))
    )


@torch.no_grad()
def teacher_force(base, sequences: torch.LongTensor, top_k: int) -> Targets:
    """The base model's states and next-token distributions along text `sequences [S, L]`, in one forward."""
    input_ids = sequences[:, :-1].to(base.device)
    output = base(input_ids=input_ids, use_cache=False, output_hidden_states=-1)
    ids, logprobs = top_logprobs(output.logits, top_k)
    return Targets.from_sequences(output.hidden_states[-1].cpu(), sequences[:, 1:], ids.cpu(), logprobs.cpu())


def fingerprint(base) -> str:
    """A digest of the base model's config and weights (a strided sample of every tensor, so retraining changes it)."""
    digest = hashlib.sha256(base.config.to_json_string(use_diff=False).encode())
    for name, tensor in sorted(base.state_dict().items()):
        flat = whole(tensor).detach().flatten()  # a sharded base's fingerprint is the unsharded one's
        digest.update(name.encode() + str(tuple(tensor.shape)).encode())
        digest.update(flat[:: max(1, flat.numel() // 4096)].float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


class TargetCache:
    """
    A folder of `Targets` files (and of the prompts the base model wrote), each named after what determines it.
    `get(key, build)` returns what is cached for `key` (a JSON-serialisable description: base fingerprint, settings,
    input token ids) or builds and stores it.
    Files are written under a temporary name and renamed into place, so a killed run never leaves a partial one.
    """

    def __init__(self, folder):
        self.folder = Path(folder)
        # A run killed while writing leaves its temporary file behind; those of live processes are being written.
        for tmp in self.folder.glob(".tmp-*"):
            if not _process_alive(int(tmp.name.split("-")[1])):
                tmp.unlink(missing_ok=True)

    def path(self, key) -> Path:
        name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
        return self.folder / f"{name}.pt"

    def get(self, key, build):
        """What `build()` returns for `key` (`Targets`, or plain lists and strings), and the seconds it took then."""
        path = self.path(key)
        if path.is_file():
            stored = torch.load(path, weights_only=True)
            value = Targets(**stored["targets"]) if "targets" in stored else stored["value"]
            return value, float(stored["seconds"])
        start = time.perf_counter()
        value = build()
        seconds = time.perf_counter() - start
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
        stored = {"targets": value.to_dict()} if isinstance(value, Targets) else {"value": value}
        torch.save({**stored, "seconds": seconds}, tmp)
        os.replace(tmp, path)
        return value, seconds


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True
