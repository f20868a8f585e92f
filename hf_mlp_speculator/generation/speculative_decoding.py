"""The package's speculative decoding loop: one prompt or a batch, each row accepting its own number of drafts, chains
or trees, greedy or sampled.

`generate(assistant_model=speculator)` runs this loop (through `generate()`'s `custom_generate` slot, so that
`generate()` still prepares the inputs, cache, logits processors and stopping criteria) unless the call needs
transformers' own assisted decoding (see `mixin.needs_transformers_loop`). A step reads the device once, after
the verifier: tensors stay on the device, and the host keeps each row's tokens. Sampling is keyed by position
(`position_noise`): every token, drafted or not, is the one plain decoding with the call's noise would emit, so
verification is the same greedy rule as for greedy decoding, trees included.

Design: one rectangular KV cache for the whole batch, realigned by the attention mask alone (`cache_slots`): every
row attends to exactly its own tokens at their true positions, using nothing but the `attention_mask` and
`position_ids` that every transformers decoder takes, and rows that finish leave the batch. Models whose sliding window
counts cache slots keep only the last ones, which cannot be moved together; with masked slots they could see fewer
real tokens than their window, so batches and trees are refused when the call could overflow it (`cache_policy`).

Trees use the same slots: all candidates' nodes are verified in one forward with a 4D mask in which each node sees
the cache and its own ancestors, at position `row position + depth`. Afterwards only the nodes on the longest
accepted path stay unmasked. This needs a model that accepts a custom 4D attention mask, as transformers' own
decoders do.

Greedy rows are token-identical to plain greedy `generate()` on the same batch. Compared with a prompt run alone, the
padding changes only the order of floating-point sums, as it does for plain batched `generate()`.
"""

import inspect
from typing import NamedTuple

import torch
from transformers import (
    EosTokenCriteria,
    MaxLengthCriteria,
    StopStringCriteria,
)
from transformers.generation.utils import GenerateDecoderOnlyOutput
from transformers.utils import logging

from ..drafting.drafter import Drafter, DraftStep, StepRecord, heads_for_call
from ..drafting.drafts import Drafts, HostDrafts, TreeSpec
from ..utils.host_transfer import to_host
from .cache_policy import take_cache
from .cache_slots import CacheSlots
from .device_tokens import DeviceTokens
from .position_noise import PositionNoise
from .transformers_hooks import (
    GENERATE_OUTPUT_CACHE,
    cache_kwargs,
    compiled_call,
    drop_last_slots,
    select_rows,
)

_UNSUPPORTED_OUTPUTS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")
logger = logging.get_logger(__name__)



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
    tree = TreeSpec.for_call(config, heads_for_call(config, generation_config), n_candidates, top_k_tokens_per_head)
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
    rows = input_ids.shape[0]
    drafter = Drafter(model, speculator, generation_config, rows, tree, logits_processor=logits_processor)
    cache, cached = take_cache(model, model_kwargs, generation_config, input_ids, drafter.max_nodes, tree is not None)
    batch = SpeculativeBatch(model, drafter, input_ids, attention_mask, cache, logits_processor, stopping_criteria,
                             streamer)  # fmt: skip
    batch.prefill(input_ids, cached)
    while batch.next_step():
        batch.step()
    return batch.finish()


class Acceptance(NamedTuple):
    """
    What verification keeps of a step, on the device, per row: `tokens` (the verifier's own, of which a row emits the
    first `accepted + 1`), `accepted` (drafts accepted; None for a plain step), `last_node` (the node whose output
    is the row's last token, its deepest kept slot: ancestors come first; None for a plain step), `kept` (which of the
    step's cache slots the row keeps), and what starts its next draft: the `hidden` state that emitted its last
    token, and that token (`last_tokens`).
    """

    tokens: torch.LongTensor
    accepted: torch.LongTensor | None
    last_node: torch.LongTensor | None
    kept: torch.BoolTensor
    hidden: torch.Tensor
    last_tokens: torch.LongTensor


class HostStep(NamedTuple):
    """A step as the host reads it, in one transfer: `Acceptance`'s `tokens`, `accepted` and `last_node`, what
    `emit_on_device` decided (`num_kept` tokens and `finished`, where the device decides), and the step's drafts."""

    tokens: list[list[int]]
    accepted: list[int] | None
    last_node: list[int] | None
    num_kept: list[int] | None
    finished: list[bool] | None
    drafts: HostDrafts | None


class SpeculativeBatch:
    """
    The state of one call: every row's tokens (on the host as lists, and on the device only where logits processors or
    custom stopping criteria read them), the rows still generating (by their index in the call's batch), their
    attention mask over the cache slots, the KV cache, and what starts each row's next draft (its last token, the
    hidden state that emitted it, its next position).
    """

    def __init__(self, model, drafter: Drafter, input_ids, attention_mask, cache, logits_processor, stopping_criteria,
                 streamer):  # fmt: skip
        self.model, self.drafter, self.cache = model, drafter, cache
        self.generation_config = generation_config = drafter.generation_config
        self.logits_processor, self.stopping_criteria, self.streamer = logits_processor, stopping_criteria, streamer
        drafter.picker = self
        rows, prompt_length = input_ids.shape
        self.device = input_ids.device
        # Sampling keyed by position (see `position_noise`): the seed is drawn here, once, from torch's generator.
        vocab_size = drafter.speculator.config.vocab_size
        self.noise = PositionNoise(vocab_size, self.device) if drafter.sampled else None
        if self.noise is not None:  # under tensor parallelism, every rank draws the same noise
            (self.noise.seed,) = drafter.agreement.decide([self.noise.seed])
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
        self.host_tokens, kept, *eos_ids = to_host(input_ids, mask.sum(-1), *eos_ids)
        self.eos = {token for ids in eos_ids for token in ([ids] if isinstance(ids, int) else ids)}
        self.slots = CacheSlots(mask, kept)
        self.prompt_mask = mask
        self.on_device = None
        if logits_processor or not simple:
            self.on_device = DeviceTokens(input_ids, self.max_length, self.pad, logits_processor, stopping_criteria)
        self.rows = torch.arange(rows, device=self.device)
        self.host_rows, self.finished = list(range(rows)), [False] * rows
        takes_logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.forward_kwargs = dict(use_cache=True, output_hidden_states=-1, **cache_kwargs(model, cache))
        self.keep_logits = takes_logits_to_keep
        self.step_call = compiled_call(model, cache, generation_config)
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
        outputs = self.forward(input_ids[:, cached:], self.slots.mask, positions[:, cached:], 1, prefill=True)
        tokens = self.select(self.process(outputs.logits[:, -1].float()))[:, None]
        self.hidden, self.last_tokens = outputs.hidden_states[-1][:, -1], tokens[:, 0]
        self.next_position = mask.sum(-1)
        del self.prompt_mask
        # Each row's room for drafts is `room_end - next_position`, on the device as well as on the host.
        self.room_end = self.next_position + self.max_length - 2 - input_ids.shape[1]  # after the token below
        self.emit(Acceptance(tokens, None, None, None, self.hidden, self.last_tokens), None, None)

    def next_step(self) -> bool:
        """Drops the rows that finished (one transfer to the device when some did); whether any row still generates."""
        if any(self.finished):
            keep = [i for i, done in enumerate(self.finished) if not done]
            if not keep:
                return False
            index = torch.tensor(keep, device=self.device)
            select_rows(self.cache, index)
            self.rows, self.hidden = self.rows[index], self.hidden[index]
            self.slots.select(keep, index)
            self.last_tokens, self.next_position = self.last_tokens[index], self.next_position[index]
            self.room_end = self.room_end[index]
            self.host_rows, self.finished = [self.host_rows[i] for i in keep], [False] * len(keep)
        if self.noise is not None:
            self.noise.new_step()
        return True

    def step(self) -> None:
        """Drafts, verifies every row's drafts in one forward, and keeps what the verifier confirms."""
        drafts, step = self.draft()
        outputs = self.verify(drafts, step)
        acceptance = self.accept_chain(drafts, outputs) if drafts.tree is None else self.accept_tree(drafts, outputs)
        self.hidden, self.last_tokens = acceptance.hidden, acceptance.last_tokens
        self.next_position = self.next_position + (1 if acceptance.accepted is None else acceptance.accepted + 1)
        deepest, accepted = self.emit(acceptance, drafts, step)
        self.slots.keep(self.cache, acceptance.kept, drafts.num_nodes, deepest, accepted)

    def draft(self) -> tuple[Drafts, DraftStep]:
        """This step's drafts for every row, as deep as the controller and each row's room allow."""
        step = self.drafter.start_step(self.slots.width, self.host_rows, self.host_lengths(), self.host_tokens)
        limits = None  # every row may draft `most`; rows near the maximum length may not
        if min(step.room) < step.most:
            limits = (self.room_end - self.next_position).clamp(min=0, max=step.most)
        return self.drafter.draft(step, self.hidden, self.last_tokens, limits), step

    def verify(self, drafts: Drafts, step: DraftStep):
        """Every row's drafts in one forward: each sees its row's kept cache slots and its own ancestors."""
        if drafts.tree is not None:
            attention, depths = self.slots.tree_mask(drafts.tree.ancestors, self.model.dtype), drafts.tree.depths
        else:  # a chain is causal: the plain 2D mask, which every model takes, or none
            attention = self.slots.chain_mask(drafts.num_nodes)
            depths = torch.arange(drafts.num_nodes, device=self.device)
        mark = self.drafter.start_verify()
        outputs = self.forward(drafts.tokens, attention, self.next_position[:, None] + depths, drafts.num_nodes)
        self.drafter.stop_verify(step, mark)
        return outputs

    def accept_chain(self, drafts: Drafts, outputs) -> "Acceptance":
        """
        Each row keeps its drafts up to the first the verifier disagrees with, then the verifier's own next token. So
        the tokens emitted are the verifier's own choices at the first `accepted + 1` nodes.
        """
        targets = self.targets(drafts, outputs.logits)
        hidden = outputs.hidden_states[-1]
        if drafts.num_nodes == 1:  # a plain step
            # A copy: a compiled forward's outputs may live in buffers that its next run overwrites (CUDA graphs).
            return Acceptance(targets, None, None, torch.ones_like(targets), hidden[:, 0].clone(), targets[:, 0])
        nodes = torch.arange(drafts.num_nodes, device=self.device)
        matched = (drafts.tokens[:, 1:] == targets[:, :-1]) & (nodes[:-1] < drafts.limits[:, None])
        accepted = matched.cumprod(dim=1).sum(dim=1)
        batch_rows = torch.arange(len(self.host_rows), device=self.device)
        return Acceptance(targets, accepted, accepted, nodes <= accepted[:, None], hidden[batch_rows, accepted],
                          targets[batch_rows, accepted])  # fmt: skip

    def accept_tree(self, drafts: Drafts, outputs) -> "Acceptance":
        """Each row keeps its longest path the verifier confirms, then the verifier's own next token."""
        tree = drafts.tree
        paths = tree.paths(drafts.tokens, drafts.max_depth)
        best, next_tokens = _accept_greedy(drafts, self.targets(drafts, outputs.logits, paths))
        batch_rows = torch.arange(len(self.host_rows), device=self.device)
        accepted = tree.depths[batch_rows, best]
        new_tokens = torch.cat([paths[batch_rows, best], next_tokens[:, None]], dim=1)
        new_tokens[batch_rows, accepted] = next_tokens
        return Acceptance(new_tokens, accepted, best, tree.ancestors[batch_rows, best],
                          outputs.hidden_states[-1][batch_rows, best], next_tokens)  # fmt: skip

    def emit(self, acceptance: "Acceptance", drafts: Drafts | None, step: DraftStep | None) -> tuple[int, list]:
        """
        Appends each row's first `accepted + 1` tokens (one token after prefill, where `drafts` is None), up to where
        it stops, reading the device once; then the host's side of the step: tokens, metrics, the controller's
        estimates, hybrid scores, the streamer. Returns the deepest node any row kept, and each row's drafts accepted.
        """
        counts = None if acceptance.accepted is None else acceptance.accepted + 1
        on_device = (None, None)  # how many tokens each row kept and whether it finished, where the device decides
        if self.on_device is not None:  # the stopping criteria read the tokens on the device
            on_device = self.on_device.append(acceptance.tokens, counts, self.rows, self.host_lengths())
        read = to_host(acceptance.tokens, acceptance.accepted, acceptance.last_node, *on_device,
                       *(self.drafter.read_back(drafts) if drafts is not None else [None] * 4))  # fmt: skip
        host = HostStep(*read[:5], Drafts.read(*read[5:]) if drafts is not None else None)
        accepted = host.accepted or [0] * len(host.tokens)  # a plain step accepts nothing
        emitted = [self.append(i, row_tokens[: accepted[i] + 1], host) for i, row_tokens in enumerate(host.tokens)]
        if drafts is not None:
            self.drafter.end_step(step, StepRecord(self.host_rows, host.drafts, accepted, emitted, drafts.num_nodes))
        self.stream()
        return max(host.last_node or [0]), accepted

    def append(self, i: int, tokens: list[int], host: "HostStep") -> list[int]:
        """Appends `tokens` to the `i`-th row of the step on the host, up to where it stops; returns those kept."""
        row = self.host_rows[i]
        if host.num_kept is None:  # the end-of-sequence and maximum-length checks, on the host
            ends = [j for j, token in enumerate(tokens) if token in self.eos]
            tokens = tokens[: min(ends[0] + 1 if ends else len(tokens), self.max_length - len(self.host_tokens[row]))]
            self.finished[i] = bool(ends) or len(self.host_tokens[row]) + len(tokens) >= self.max_length
        else:
            tokens = tokens[: host.num_kept[i]]
            self.finished[i] = bool(host.finished[i])
        self.host_tokens[row] += tokens
        return tokens

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
        return self.process(scores, torch.stack(drafts, dim=1) if drafts else None)

    def process(self, scores, extra=None, depths=None, host_depths=None):
        """The logits processors, each row seeing its own tokens followed by `extra` (see `DeviceTokens.process`)."""
        if not self.logits_processor:
            return scores
        return self.on_device.process(scores, self.rows, self.host_lengths(), extra, depths, host_depths)

    def select(self, scores, depth: int = 0):
        """Each row's token `depth` places past its last emitted one, from processed `scores`, as the verifier does
        (as a `TokenPicker`, head `depth` drafts that token)."""
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
        self.drafter.finish(cache_slots=self.slots.peak)
        width = max(map(len, self.host_tokens))
        output = torch.tensor([row + [self.pad] * (width - len(row)) for row in self.host_tokens], device=self.device)
        if not self.generation_config.return_dict_in_generate:
            return output
        if len(self.host_tokens) > 1:  # rows' caches hold masked slots where they advanced apart: not one to reuse
            return GenerateDecoderOnlyOutput(sequences=output)
        # One sequence: the cache holds its tokens but the last, as plain generate() returns it, once the drafts kept
        # past an end-of-sequence token are dropped.
        drop_last_slots(self.cache, self.slots.width - (width - 1))
        return GenerateDecoderOnlyOutput(sequences=output, **{GENERATE_OUTPUT_CACHE: self.cache})


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
