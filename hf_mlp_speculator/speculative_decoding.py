"""The package's speculative decoding loop: one prompt or a batch, each row accepting its own number of drafts, chains
or trees, greedy or sampled.

`generate(assistant_model=speculator)` runs this loop (through `generate()`'s `custom_generate` slot, so that
`generate()` still prepares the inputs, cache, logits processors and stopping criteria) unless the call needs
transformers' own assisted decoding (see `generation.needs_transformers_loop`). A step reads the device once, after
the verifier: tensors stay on the device, and the host keeps each row's tokens. Sampling is keyed by position
(`position_noise`): every token, drafted or not, is the one plain decoding with the call's noise would emit, so
verification is the same greedy rule as for greedy decoding, trees included.

Design: one rectangular KV cache for the whole batch, realigned by the attention mask alone. Every round appends the
same slots to every row: its last emitted token and its drafts. The verifier then switches off, in the 2D attention
mask, the slots of the drafts each row rejected, and a row's positions count only the slots it kept. So every row
attends to exactly its own tokens at their true positions, using nothing but the `attention_mask` and `position_ids`
that every transformers decoder takes. Slots that every row rejected are cropped off the cache (one prompt drafting
a chain never keeps a masked slot, and runs without a mask at all), and rows that finish leave the batch. Once the
masked slots pass `COMPACT_SHARE` of the cache, each row's kept slots move together (`compact`): the cache holds
little more than the tokens, and later steps read no more than they need. Models whose sliding window counts cache
slots keep only the last ones, which cannot be moved together; with masked slots they could see fewer real tokens
than their window, so batches and trees are refused when the call could overflow it.

Trees use the same slots: all candidates' nodes are verified in one forward with a 4D mask in which each node sees
the cache and its own ancestors, at position `row position + depth`. Afterwards only the nodes on the longest
accepted path stay unmasked. This needs a model that accepts a custom 4D attention mask, as transformers' own
decoders do.

Greedy rows are token-identical to plain greedy `generate()` on the same batch. Compared with a prompt run alone, the
padding changes only the order of floating-point sums, as it does for plain batched `generate()`.
"""

import inspect
import math

import torch
from transformers import (
    DynamicCache,
    EosTokenCriteria,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    MaxLengthCriteria,
    MinPLogitsWarper,
    StopStringCriteria,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)
from transformers.generation.utils import GenerateDecoderOnlyOutput
from transformers.utils import logging

from .drafter import Drafter, DraftStep
from .drafting import Drafts
from .host_transfer import to_host
from .kv_cache import (
    cache_kind,
    cache_kwargs,
    can_gather_slots,
    drop_last_slots,
    every_slot_copy,
    gather_slots,
    holds_every_token,
    pop_prepared_cache,
)
from .position_noise import PositionNoise

# Processors that read nothing but the scores run once on all rows; any other runs once per distinct row length.
_SCORES_ONLY = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper, TypicalLogitsWarper,
                EpsilonLogitsWarper, EtaLogitsWarper)  # fmt: skip
_UNSUPPORTED_OUTPUTS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")
logger = logging.get_logger(__name__)

# Rejected drafts' slots are freed once they are more than this share of the cache (see `SpeculativeBatch.compact`).
COMPACT_SHARE = 0.05


def generate_speculatively(
    model,
    input_ids: torch.LongTensor,
    logits_processor,
    stopping_criteria,
    generation_config,
    *,
    speculator,
    streamer=None,
    n_candidates: int | None = None,
    top_k_tokens_per_head: list[int] | None = None,
    stop_string_criterion: StopStringCriteria | None = None,
    lookup_tokens: int | None = None,
    **model_kwargs,
):
    """
    The decoding loop behind `generate(input_ids, assistant_model=speculator)`, for one prompt or a batch, and behind
    `generate(..., assistant_model=speculator, n_candidates=..., top_k_tokens_per_head=...)` for trees (either
    argument turns trees on; the other comes from the speculator's config). Returns what `generate()` returns.
    `stop_string_criterion` is the one `generate()` could not build: it keeps the tokenizer from this loop;
    `lookup_tokens`, the call's `prompt_lookup_num_tokens`, turns on hybrid drafting (kept from `generate()`, which
    would take it for its own assisted decoding).
    """
    if stop_string_criterion is not None:
        stopping_criteria.append(stop_string_criterion)
    generation_config.prompt_lookup_num_tokens = lookup_tokens  # generate()'s own copy of the config
    config = speculator.config
    num_heads = min(config.n_predict, generation_config.num_assistant_tokens or config.n_predict)
    tree = None
    if n_candidates is not None or top_k_tokens_per_head is not None:
        tree = (list(top_k_tokens_per_head or config.top_k_tokens_per_head), n_candidates or config.n_candidates)
        _check_tree(*tree, num_heads)
    if generation_config.prompt_lookup_num_tokens and tree:
        raise ValueError(
            "prompt_lookup_num_tokens drafts chains next to the speculator's; it cannot join tree candidates "
            "(n_candidates / top_k_tokens_per_head). Drop one of the two."
        )
    requested = [name for name in _UNSUPPORTED_OUTPUTS if getattr(generation_config, name)]
    if requested:
        raise ValueError(
            f"{', '.join(requested)} cannot be returned by batched, tree or sampled speculative decoding: rows "
            "advance by different numbers of tokens per step. Generate one prompt at a time, greedily and without "
            "n_candidates, for them."
        )
    attention_mask = model_kwargs.get("attention_mask")
    num_nodes = max(num_heads * (tree[1] if tree else 1), generation_config.prompt_lookup_num_tokens or 0)
    cache, cached = _take_cache(model, model_kwargs, generation_config, input_ids, num_nodes, tree)
    batch = SpeculativeBatch(model, speculator, input_ids, attention_mask, cache, generation_config, logits_processor,
                             stopping_criteria, streamer, tree)  # fmt: skip
    batch.prefill(input_ids, cached)
    while batch.next_step():
        batch.step()
    return batch.finish()


class SpeculativeBatch:
    """
    The state of one call: every row's tokens (on the host as lists, and on the device only where logits processors or
    custom stopping criteria read them), the rows still generating (by their index in the call's batch), their
    attention mask over the cache slots, the KV cache, and what starts each row's next draft (its last token, the
    hidden state that emitted it, its next position).
    """

    def __init__(self, model, speculator, input_ids, attention_mask, cache, generation_config, logits_processor,
                 stopping_criteria, streamer, tree):  # fmt: skip
        self.model, self.speculator, self.cache = model, speculator, cache
        self.generation_config, self.logits_processor = generation_config, logits_processor
        self.stopping_criteria, self.streamer, self.tree = stopping_criteria, streamer, tree
        rows, prompt_length = input_ids.shape
        self.device = input_ids.device
        # Sampling keyed by position (see `position_noise`): the seed is drawn here, once, from torch's generator.
        self.noise = PositionNoise(speculator.config.vocab_size, self.device) if generation_config.do_sample else None
        if tree:  # a tree of depth d verifies its root and up to n_candidates nodes per depth
            n_predict = speculator.config.n_predict
            num_heads = min(n_predict, generation_config.num_assistant_tokens or n_predict)
            widths = [min(tree[1], math.prod(tree[0][:depth])) for depth in range(1, num_heads + 1)]
            new_tokens = lambda depth: 1 + sum(widths[:depth])  # noqa: E731
        else:
            new_tokens = lambda depth: depth + 1  # noqa: E731
        kind = "tree" if tree else ("chain, sampled" if self.noise else "chain, greedy")
        self.drafter = Drafter(model, speculator, generation_config, rows, kind, new_tokens)
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.long()
        pad, eos = generation_config.pad_token_id, generation_config.eos_token_id
        if pad is None:  # plain generate() pads with the first EOS id then
            pad = eos[0] if isinstance(eos, list) else eos
        self.pad = 0 if pad is None else int(pad)
        # Maximum length and end-of-sequence ids are checked on the host, from the tokens read each step; any other
        # stopping criterion (and any logits processor) reads the tokens on the device, kept there for them.
        simple = all(type(c) in (MaxLengthCriteria, EosTokenCriteria) for c in stopping_criteria)
        self.max_length = generation_config.max_length
        eos_ids = [c.eos_token_id for c in stopping_criteria if type(c) is EosTokenCriteria]
        self.host_tokens, self.slots, *eos_ids = to_host(input_ids, mask.sum(-1), *eos_ids)
        self.eos = {token for ids in eos_ids for token in ([ids] if isinstance(ids, int) else ids)}
        # The attention mask over the cache slots, held only while some row has a masked slot (padding, or a rejected
        # draft another row kept): without one the model need not build or check a mask.
        self.width = prompt_length  # cache slots, on the host
        self.mask = mask if min(self.slots) < self.width else None
        self.prompt_mask = mask
        self.sequences = None
        if logits_processor or not simple:
            # int64 whatever the prompt's integer type, as the tokens plain generate() appends are
            self.sequences = torch.full((rows, self.max_length), self.pad, device=self.device)
            self.sequences[:, :prompt_length] = input_ids
            self.lengths = torch.full((rows,), prompt_length, device=self.device)
        self.rows = torch.arange(rows, device=self.device)
        self.peak_slots = prompt_length
        self.host_rows, self.finished = list(range(rows)), [False] * rows
        takes_logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.forward_kwargs = dict(use_cache=True, output_hidden_states=-1, **cache_kwargs(model, cache))
        self.keep_logits = takes_logits_to_keep
        self.step_call = _compiled_call(model, cache, generation_config)
        self.streamed = prompt_length  # columns handed to the streamer
        if streamer is not None:
            streamer.put(input_ids.cpu())

    def host_lengths(self) -> list[int]:
        return [len(self.host_tokens[row]) for row in self.host_rows]

    def forward(self, input_ids, attention_mask, position_ids, logits_to_keep, prefill: bool = False):
        kwargs = {"logits_to_keep": logits_to_keep} if self.keep_logits else {}
        call = self.model if prefill else self.step_call
        return call(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                    **self.forward_kwargs, **kwargs)  # fmt: skip

    def prefill(self, input_ids, cached: int = 0) -> None:
        """
        The prompt, but for the `cached` tokens the cache already holds, emits the first token, and the hidden state
        that emitted it starts the first draft.
        """
        mask = self.prompt_mask
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        outputs = self.forward(input_ids[:, cached:], self.mask, positions[:, cached:], 1, prefill=True)
        tokens = self.select(self.process(outputs.logits[:, -1].float()))[:, None]
        self.hidden, self.last_tokens = outputs.hidden_states[-1][:, -1], tokens[:, 0]
        self.next_position = mask.sum(-1)
        del self.prompt_mask
        # Each row's room for drafts is `room_end - next_position`, on the device as well as on the host.
        self.room_end = self.next_position + self.max_length - 2 - input_ids.shape[1]  # after the token below
        self.emit(tokens, None, None)

    def next_step(self) -> bool:
        """Drops the rows that finished (one transfer to the device when some did); whether any row still generates."""
        if any(self.finished):
            keep = [i for i, done in enumerate(self.finished) if not done]
            if not keep:
                return False
            index = torch.tensor(keep, device=self.device)
            self.cache.batch_select_indices(index)
            self.rows, self.hidden = self.rows[index], self.hidden[index]
            self.mask = None if self.mask is None else self.mask[index]
            self.last_tokens, self.next_position = self.last_tokens[index], self.next_position[index]
            self.room_end = self.room_end[index]
            self.host_rows, self.finished = [self.host_rows[i] for i in keep], [False] * len(keep)
            self.slots = [self.slots[i] for i in keep]
        if self.noise is not None:
            self.noise.new_step()
        return True

    def step(self) -> None:
        """Drafts, verifies every row's drafts in one forward, and keeps what the verifier confirms."""
        drafts, step = self.draft()
        outputs = self.verify(drafts, step)
        if drafts.tree is None:
            new_tokens, accepted, kept = self.accept_chain(drafts, outputs)
            best = None  # a chain's last kept node is its last accepted draft
        else:
            new_tokens, accepted, best, kept = self.accept_tree(drafts, outputs)
        deepest = self.emit(new_tokens, accepted, drafts, step, best)
        # Keep the slots of the root and the accepted path; crop the slots that no row kept (the deepest kept slot of
        # a row is its last kept node: ancestors come first).
        self.peak_slots = max(self.peak_slots, self.width + drafts.num_nodes)
        width, self.width = self.width, self.width + deepest + 1
        if self.mask is None and min(self.slots) < self.width:  # this step left a row a masked slot
            self.mask = torch.ones((len(self.host_rows), width), dtype=torch.long, device=self.device)
        if self.mask is not None:
            self.mask = torch.cat([self.mask, kept[:, : deepest + 1].long()], dim=1)
        drop_last_slots(self.cache, drafts.num_nodes - 1 - deepest)
        self.compact()

    def draft(self) -> tuple[Drafts, DraftStep]:
        """This step's drafts for every row, as deep as the controller and each row's room allow."""
        room = [max(0, self.max_length - length - 1) for length in self.host_lengths()]
        step = self.drafter.start_step(self.width, self.host_tokens, self.host_rows, room)
        most = min(self.drafter.num_heads, max(room))  # a row's verifier forward adds one token of its own
        limits = None  # every row may draft `most`; rows near the maximum length may not
        if min(room) < most:
            limits = (self.room_end - self.next_position).clamp(min=0, max=most)
        drafts = self.drafter.draft(step, self.hidden, self.last_tokens, limits, most, self.process_drafts,
                                    self.select if self.noise else None, self.tree)  # fmt: skip
        return drafts, step

    def verify(self, drafts: Drafts, step: DraftStep):
        """Every row's drafts in one forward: each sees its row's kept cache slots and its own ancestors."""
        if drafts.tree is not None:
            self.ancestors = drafts.tree.ancestors()
            mask = self.mask if self.mask is not None else self.ancestors.new_ones((len(self.host_rows), self.width))
            attention = _tree_attention_mask(mask, self.ancestors, self.model.dtype)
            depths = drafts.tree.depths
        else:  # a chain is causal: the plain 2D mask, which every model takes, or none
            attention = None if self.mask is None else torch.cat([self.mask, torch.ones_like(drafts.tokens)], dim=1)
            depths = torch.arange(drafts.num_nodes, device=self.device)
        mark = self.drafter.start_verify()
        outputs = self.forward(drafts.tokens, attention, self.next_position[:, None] + depths, drafts.num_nodes)
        self.drafter.stop_verify(step, mark)
        return outputs

    def accept_chain(self, drafts: Drafts, outputs):
        """
        Each row keeps its drafts up to the first the verifier disagrees with, then the verifier's own next token. So
        the tokens emitted are the verifier's own choices at the first `accepted + 1` nodes. Returns the verifier's
        tokens, how many drafts each row accepted, and which of the step's cache slots each row keeps.
        """
        targets = self.targets(drafts, outputs.logits)
        hidden = outputs.hidden_states[-1]
        if drafts.num_nodes == 1:  # a plain step
            # A copy: a compiled forward's outputs may live in buffers that its next run overwrites (CUDA graphs).
            self.hidden, self.last_tokens = hidden[:, 0].clone(), targets[:, 0]
            self.next_position = self.next_position + 1
            return targets, None, torch.ones_like(targets)
        nodes = torch.arange(drafts.num_nodes, device=self.device)
        matched = (drafts.tokens[:, 1:] == targets[:, :-1]) & (nodes[:-1] < drafts.limits[:, None])
        accepted = matched.cumprod(dim=1).sum(dim=1)
        batch_rows = torch.arange(len(self.host_rows), device=self.device)
        self.hidden, self.last_tokens = hidden[batch_rows, accepted], targets[batch_rows, accepted]
        self.next_position = self.next_position + accepted + 1
        return targets, accepted, nodes <= accepted[:, None]

    def accept_tree(self, drafts: Drafts, outputs):
        """
        Each row keeps its longest path the verifier confirms, then the verifier's own next token. Returns each row's
        tokens (the path, then that token), how many drafts it accepted, and which cache slots it keeps.
        """
        paths = drafts.tree.paths(drafts.tokens, drafts.max_depth)
        best, next_tokens = _accept_greedy(drafts, self.targets(drafts, outputs.logits, paths))
        batch_rows = torch.arange(len(self.host_rows), device=self.device)
        accepted = drafts.tree.depths[batch_rows, best]
        new_tokens = torch.cat([paths[batch_rows, best], next_tokens[:, None]], dim=1)
        new_tokens[batch_rows, accepted] = next_tokens
        self.hidden, self.last_tokens = outputs.hidden_states[-1][batch_rows, best], next_tokens
        self.next_position = self.next_position + accepted + 1
        return new_tokens, accepted, best, self.ancestors[batch_rows, best]

    def emit(self, tokens, accepted, drafts: Drafts | None, step: DraftStep | None = None, best=None) -> int:
        """
        Appends each row's first `accepted + 1` of `tokens` (one token after prefill, where `drafts` is None), up to
        where it stops, reading the device once; then the host's side of the step: tokens, metrics, the controller's
        estimates, hybrid scores, the streamer. Returns the deepest node any row kept (`best`, for a tree).
        """
        counts = 1 if accepted is None else accepted + 1
        kept = finished = None
        if self.sequences is not None:  # the stopping criteria read the tokens on the device
            kept, finished = self.emit_on_device(tokens, counts if accepted is not None else None)
        step_values = [None] * 4 if drafts is None else [drafts.limits, drafts.confidences, drafts.nonfinite,
                                                          drafts.tokens if self.drafter.hybrid else None]  # fmt: skip
        tokens, accepted, kept, finished, best, limits, confidences, nonfinite, verified = to_host(
            tokens, accepted, kept, finished, best, *step_values
        )
        accepted = accepted or [0] * len(tokens)  # a plain step accepts nothing
        if drafts is not None and drafts.tree is not None:  # no single confidence: one bin holds each depth's rate
            confidences = [[0.5] * self.drafter.num_heads for _ in limits]
        emitted = []
        for i, (row, row_tokens) in enumerate(zip(self.host_rows, tokens)):
            row_tokens = row_tokens[: accepted[i] + 1 if kept is None else kept[i]]
            if kept is None:  # the end-of-sequence and maximum-length checks, on the host
                ends = [j for j, token in enumerate(row_tokens) if token in self.eos]
                row_tokens = row_tokens[: min(ends[0] + 1 if ends else len(row_tokens),
                                              self.max_length - len(self.host_tokens[row]))]  # fmt: skip
                self.finished[i] = bool(ends) or len(self.host_tokens[row]) + len(row_tokens) >= self.max_length
            else:
                self.finished[i] = bool(finished[i])
            self.host_tokens[row] += row_tokens
            emitted.append(row_tokens)
        if drafts is not None:
            self.slots = [slots + count + 1 for slots, count in zip(self.slots, accepted)]
            verified = verified and [row[1 : limit + 1] for row, limit in zip(verified, limits)]
            self.drafter.end_step(step, self.host_rows, limits, accepted, [len(row) for row in emitted], confidences,
                                  [bool(b) for b in nonfinite or [0] * len(limits)], drafts.num_nodes, verified,
                                  emitted)  # fmt: skip
        self.stream()
        return max(accepted if best is None else best)

    def emit_on_device(self, tokens, counts):
        """
        Writes up to `counts[i]` of `tokens[i]` (all of them where None) into each row's device copy, stopping a row
        where the stopping criteria say, without reading the device. Returns how many each row kept and whether it
        finished.
        """
        counts = torch.full_like(self.rows, tokens.shape[1]) if counts is None else counts
        kept = torch.zeros_like(counts)
        finished = torch.zeros_like(counts, dtype=torch.bool)
        ends, host_ends, last = self.lengths[self.rows], self.host_lengths(), self.sequences.shape[1] - 1
        for column in range(tokens.shape[1]):
            live = (column < counts) & ~finished
            where = (ends + column).clamp(max=last)  # rows not live write back what is there
            self.sequences[self.rows, where] = torch.where(live, tokens[:, column], self.sequences[self.rows, where])
            kept += live
            stop = _at_own_lengths(lambda ids, _: self.stopping_criteria(ids, None), self.sequences, self.rows,
                                   ends + column + 1, [min(end + column, last) + 1 for end in host_ends])  # fmt: skip
            finished |= live & stop.bool()
        self.lengths[self.rows] = ends + kept
        return kept, finished

    def compact(self) -> None:
        """
        Frees rejected drafts' slots once they pass `COMPACT_SHARE` of the cache: every row's kept slots move together,
        in order and left-padded, in every cache layer and in the mask. Positions stay as they were, so every row still
        sees exactly its own tokens; later steps read fewer slots. A sliding window keeps too few slots to move, and
        offloaded or indexed caches are left as they are.
        """
        width, most = self.width, max(self.slots)
        if self.mask is None or width - most <= COMPACT_SHARE * width or not can_gather_slots(self.cache):
            return
        # A stable sort puts each row's masked slots first and its kept ones last, both in order.
        order = torch.sort(self.mask, dim=1, stable=True).indices[:, width - most :]
        self.mask = self.mask.gather(1, order)
        gather_slots(self.cache, order)
        self.width = most
        if min(self.slots) == most:  # every row's slots are all kept: no mask needed
            self.mask = None

    def targets(self, drafts: Drafts, scores, paths=None) -> torch.LongTensor:
        """
        The verifier's token after each node, picked from its `scores` as plain decoding would: the logits processors
        see each node's row followed by the drafts on its path (`paths`, for a tree).
        """
        if self.logits_processor:
            host_depths = [drafts.node_depths(i) for i in range(len(self.host_rows))]
            scores = scores.float()
            if paths is None:  # a chain's node `q` follows drafts 1 .. q in every row
                scores = torch.stack([self.process(scores[:, q], drafts.tokens[:, 1 : q + 1])
                                      for q in range(drafts.num_nodes)], dim=1)  # fmt: skip
            else:
                scores = torch.stack([self.process(scores[:, node], paths[:, node], drafts.tree.depths[:, node],
                                                   [depths[node] for depths in host_depths])
                                      for node in range(drafts.num_nodes)], dim=1)  # fmt: skip
        if self.noise is None:
            return scores.argmax(dim=-1)
        rows = [row for row in self.host_rows for _ in range(drafts.num_nodes)]
        positions = [length + depth for i, length in enumerate(self.host_lengths()) for depth in drafts.node_depths(i)]
        return self.noise.sample(scores.flatten(0, 1), rows, positions).view(drafts.tokens.shape)

    def process_drafts(self, scores, drafts: list):
        """The logits processors on a draft's scores, each row followed by the drafts before it (a list)."""
        if not self.logits_processor:
            return scores
        return self.process(scores, torch.stack(drafts, dim=1) if drafts else None)

    def process(self, scores, extra=None, depths=None, host_depths=None):
        """
        The logits processors, row `i` seeing its own tokens followed by `extra[i, :depths[i]]` (all of `extra` when
        `depths` is None; `host_depths` is the same on the host).
        """
        if not self.logits_processor:
            return scores
        ids, ends, host_ends = self.sequences, self.lengths[self.rows], self.host_lengths()
        if extra is not None and extra.shape[1]:
            width = extra.shape[1]
            ids = torch.cat([self.sequences, self.sequences.new_zeros(len(ids), width)], dim=1)
            where = ends[:, None] + torch.arange(width, device=ends.device)
            ids[self.rows] = ids[self.rows].scatter(1, where, extra)
            ends = ends + (width if depths is None else depths)
            host_ends = [end + d for end, d in zip(host_ends, host_depths or [width] * len(host_ends))]
        for processor in self.logits_processor:
            if isinstance(processor, _SCORES_ONLY):
                scores = processor(ids[self.rows], scores)
            else:
                scores = _at_own_lengths(processor, ids, self.rows, ends, host_ends, scores)
        return scores

    def select(self, scores, depth: int = 0):
        """Each row's token `depth` places past its last emitted one, from processed `scores`, as the verifier does."""
        if self.noise is None:
            return scores.argmax(dim=-1)
        return self.noise.sample(scores, self.host_rows, [length + depth for length in self.host_lengths()])

    def stream(self) -> None:
        """
        Streams whole batches in their original row order, as plain `generate()` does: the columns that every row
        still generating has reached (rows that finished show padding), as one `(batch, columns)` chunk.
        """
        if self.streamer is None:
            return
        live = [len(self.host_tokens[row]) for row, done in zip(self.host_rows, self.finished) if not done]
        ready = min(live) if live else max(map(len, self.host_tokens))
        if ready > self.streamed:
            chunk = [(row + [self.pad] * ready)[self.streamed : ready] for row in self.host_tokens]
            self.streamer.put(torch.tensor(chunk))
            self.streamed = ready

    def finish(self):
        """What `generate()` returns; the call's metrics go on the speculator."""
        if self.streamer is not None:
            self.streamer.end()
        speculator = self.speculator
        speculator.speculation_metrics = self.drafter.finish()
        speculator.speculation_metrics_per_row = self.drafter.metrics
        speculator.speculation_metrics.cache_slots = self.peak_slots
        width = max(map(len, self.host_tokens))
        output = torch.tensor([row + [self.pad] * (width - len(row)) for row in self.host_tokens], device=self.device)
        if not self.generation_config.return_dict_in_generate:
            return output
        if len(self.host_tokens) > 1:  # rows' caches hold masked slots where they advanced apart: not one to reuse
            return GenerateDecoderOnlyOutput(sequences=output)
        # One sequence: the cache holds its tokens but the last, as plain generate() returns it, once the drafts kept
        # past an end-of-sequence token are dropped.
        drop_last_slots(self.cache, self.width - (width - 1))
        name = "cache" if "cache" in GenerateDecoderOnlyOutput.__dataclass_fields__ else "past_key_values"
        return GenerateDecoderOnlyOutput(sequences=output, **{name: self.cache})


def _accept_greedy(drafts: Drafts, targets: torch.LongTensor):
    """The deepest node whose path the verifier's token confirms all the way (first such node on ties)."""
    tree = drafts.tree
    rows = torch.arange(drafts.tokens.shape[0], device=targets.device)
    confirmed = tree.valid & (drafts.tokens == targets.gather(1, tree.parents))
    confirmed[:, 0] = True
    for node in range(1, drafts.num_nodes):  # a node counts only if its parent does
        confirmed[:, node] &= confirmed[rows, tree.parents[:, node]]
    best = torch.where(confirmed, tree.depths, -1).argmax(dim=-1)
    return best, targets[rows, best]


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


def _tree_attention_mask(mask, ancestors, dtype):
    """Additive 4D mask: each node sees the row's kept cache slots, itself and its ancestors."""
    nodes = ancestors.shape[1]
    allowed = torch.cat([mask.bool()[:, None].expand(-1, nodes, -1), ancestors], dim=-1)[:, None]
    return torch.zeros(allowed.shape, dtype=dtype, device=mask.device).masked_fill(~allowed, torch.finfo(dtype).min)


def _check_tree(top_k: list[int], n_candidates: int, num_heads: int) -> None:
    if len(top_k) < num_heads or any(k < 1 for k in top_k):
        raise ValueError(
            f"top_k_tokens_per_head={top_k} needs one positive branching factor for each of the {num_heads} heads "
            "that draft."
        )
    leaves = 1
    for k in top_k[:num_heads]:
        leaves *= k
    if not 1 <= n_candidates <= leaves:
        raise ValueError(
            f"n_candidates={n_candidates} must be between 1 and the {leaves} paths of the top_k_tokens_per_head="
            f"{top_k[:num_heads]} tree."
        )


def _compiled_call(model, cache, generation_config):
    """
    The verifier's forward for decoding steps: compiled where plain `generate()` would compile its own (a static cache
    on a GPU, or `compile_config` asking for it; transformers' `_valid_auto_compile_criteria`), else the model itself.
    Prefill runs uncompiled, as in plain `generate()`. A step verifies 1 to k + 1 tokens: one graph per count.
    """
    criteria = getattr(model, "_valid_auto_compile_criteria", None)
    if criteria is None or not criteria({"cache": cache, "past_key_values": cache}, generation_config):
        return model
    return model.get_compiled_call(generation_config.compile_config)


def _take_cache(model, model_kwargs, generation_config, input_ids, num_nodes, tree) -> tuple:
    """
    The cache `generate()` prepared (the user's, or one of `cache_implementation`), after checking that the loop can
    rewind it, and how many of the prompt's tokens it already holds (a prefix cache: a system prompt, a chat's earlier
    turns).
    """
    cache = pop_prepared_cache(model_kwargs)
    for name in ("attention_mask", "position_ids", "use_cache", "logits_to_keep", "cache_position"):
        model_kwargs.pop(name, None)
    if model_kwargs:
        raise ValueError(
            f"Batched, tree or sampled speculative decoding cannot pass {sorted(model_kwargs)} to the model. Drop "
            "them, or generate one prompt at a time, greedily and without n_candidates."
        )
    if cache is None:
        cache = DynamicCache(config=model.config)
    rows, prompt_length = input_ids.shape
    cached = int(cache.get_seq_length())  # read once: a static cache counts on the device
    if cached >= prompt_length:
        raise ValueError(
            f"The cache passed to generate() already holds {cached} tokens, and the prompt has {prompt_length}: a "
            "cache must hold a prefix of the prompt and leave at least its last token to compute. Pass a copy of the "
            "cache made before the prompt's last token (copy.deepcopy(prompt_cache)), or no cache."
        )
    kind, sliding, chain = cache_kind(cache), any(getattr(cache, "is_sliding", [])), rows == 1 and not tree
    if sliding and chain:
        # A sliding layer drops the slots that leave its window (a rejected draft's slot would push a real token out),
        # and cannot be rewound past what it dropped. One chain leaves no masked slot, so a cache that keeps every
        # slot, under the model's own sliding mask, sees exactly the window.
        if kind == "dynamic" and holds_every_token(cache):
            return (every_slot_copy(cache) if cached else DynamicCache()), cached
        if cached:
            logger.warning(
                f"This {type(cache).__name__}'s sliding-window layers already dropped tokens, which speculative "
                "decoding cannot rewind past rejected drafts: it computes the prompt again in a new DynamicCache "
                "(return_dict_in_generate=True returns it)."
            )
        elif kind is None:
            logger.warning(
                f"A {type(cache).__name__} with sliding-window layers cannot be rewound past rejected drafts: "
                "speculative decoding runs on a DynamicCache instead, as transformers' assisted decoding does."
            )
        return DynamicCache(), 0
    if kind is None:
        raise ValueError(
            f"Speculative decoding rewinds the cache past rejected drafts, which it can do to a DynamicCache or a "
            f"StaticCache without sliding-window layers, not to a {type(cache).__name__}"
            f"{' with sliding-window layers' * sliding}, in a batch, a tree or a sampled call. Drop "
            "cache_implementation / the cache argument, or generate one prompt at a time, greedily and without "
            "n_candidates."
        )
    if kind == "static" and not chain:
        raise ValueError(
            f"A static cache serves one sequence drafting chains, and this call has "
            f"{f'{rows} sequences' if rows > 1 else 'tree candidates'}: the rows' rejected drafts would take slots it "
            "cannot free. Drop cache_implementation / the cache argument (a DynamicCache serves batches and trees), "
            "or generate one prompt at a time without n_candidates."
        )
    window = getattr(model.config.get_text_config(), "sliding_window", None)
    worst_case = prompt_length + (generation_config.max_length - prompt_length) * (num_nodes + 1)
    if sliding and window and worst_case > window:
        raise ValueError(
            f"This model attends over a sliding window of {window} cache slots, and rejected drafts occupy slots: "
            f"this call could fill up to {worst_case} slots and silently see fewer real tokens than the model should. "
            "Lower max_new_tokens, or generate one prompt at a time without n_candidates."
        )
    return cache, cached
