"""Speculative decoding for a batch of prompts, each row accepting its own number of drafts, for draft trees, and for
sampling.

transformers' assisted decoding verifies one chain for one sequence. This loop is the decoding method that
`generate(assistant_model=speculator)` runs instead (through its `custom_generate` slot) when the batch has more than
one row, when tree candidates are asked for, or when the call samples; `generate()` still prepares the inputs, cache,
logits processors and stopping criteria. Sampling is keyed by position (`position_noise`): every token, drafted or
not, is the one plain decoding with the call's noise would emit, so verification is the same greedy rule as for
greedy decoding, trees included.

Design: one rectangular KV cache for the whole batch, realigned by the attention mask alone. Every round appends the
same slots to every row: its last emitted token and its drafts. The verifier then switches off, in the 2D attention
mask, the slots of the drafts each row rejected, and a row's positions count only the slots it kept. So every row
attends to exactly its own tokens at their true positions, using nothing but the `attention_mask` and `position_ids`
that every transformers decoder takes. (Realigning each row's cache instead would mean shifting the tensors of every
cache layer, whose layouts differ between models.) Slots that every row rejected are cropped off the cache, and rows
that finish leave the batch. The price is that masked slots still take attention compute and memory until the end of
the call. Models whose sliding window counts cache slots could see fewer real tokens than
their window, so they are refused when the call could overflow it.

Trees use the same slots: all candidates' nodes are verified in one forward with a 4D mask in which each node sees
the cache and its own ancestors, at position `row position + depth`. Afterwards only the nodes on the longest
accepted path stay unmasked. This needs a model that accepts a custom 4D attention mask, as transformers' own
decoders do.

Greedy rows are token-identical to plain greedy `generate()` on the same batch. Compared with a prompt run alone, the
padding changes only the order of floating-point sums, as it does for plain batched `generate()`.
"""

import inspect
import time

import torch
from transformers import (
    DynamicCache,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    MinPLogitsWarper,
    StopStringCriteria,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .controller import SpeculationController, acceptance_for
from .cost_model import cost_model_for, synchronize
from .drafting import DraftTree, draft_chain, draft_tree
from .kv_cache import cache_kwargs, pop_prepared_cache
from .metrics import SpeculationMetrics
from .position_noise import PositionNoise
from .prompt_lookup import HybridDrafter

# Processors that read nothing but the scores run once on all rows; any other runs once per distinct row length.
_SCORES_ONLY = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper, TypicalLogitsWarper,
                EpsilonLogitsWarper, EtaLogitsWarper)  # fmt: skip
_UNSUPPORTED_OUTPUTS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")


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
    **model_kwargs,
):
    """
    The decoding loop behind `generate(input_ids, attention_mask=..., assistant_model=speculator)` for a batch, and
    behind `generate(..., assistant_model=speculator, n_candidates=..., top_k_tokens_per_head=...)` for trees (either
    argument turns trees on; the other comes from the speculator's config). Returns what `generate()` returns.
    `stop_string_criterion` is the one `generate()` could not build: it keeps the tokenizer from this loop.
    """
    if stop_string_criterion is not None:
        stopping_criteria.append(stop_string_criterion)
    heads, config = speculator.speculator, speculator.config
    num_heads = min(config.n_predict, generation_config.num_assistant_tokens or config.n_predict)
    confidence_threshold = generation_config.assistant_confidence_threshold or 0.0
    tree = n_candidates is not None or top_k_tokens_per_head is not None
    if tree:
        top_k = list(top_k_tokens_per_head or config.top_k_tokens_per_head)
        n_candidates = n_candidates or config.n_candidates
        _check_tree(top_k, n_candidates, num_heads)
    hybrid = HybridDrafter.for_call(input_ids.shape[0], generation_config)
    if hybrid is not None and tree:
        raise ValueError(
            "prompt_lookup_num_tokens drafts chains next to the speculator's; it cannot join tree candidates "
            "(n_candidates / top_k_tokens_per_head). Drop one of the two."
        )
    attention_mask = model_kwargs.get("attention_mask")
    num_nodes = max(num_heads * (n_candidates or 1), generation_config.prompt_lookup_num_tokens or 0)
    cache = _take_cache(model, model_kwargs, generation_config, input_ids, num_nodes)
    requested = [name for name in _UNSUPPORTED_OUTPUTS if getattr(generation_config, name)]
    if requested:
        raise ValueError(
            f"{', '.join(requested)} cannot be returned by batched, tree or sampled speculative decoding: rows "
            "advance by different numbers of tokens per step. Generate one prompt at a time, greedily and without "
            "n_candidates, for them."
        )
    # Sampling keyed by position (see `position_noise`): the seed is drawn here, once, from torch's generator.
    noise = PositionNoise(config.vocab_size, input_ids.device) if generation_config.do_sample else None
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.long()

    batch, prompt_length = input_ids.shape
    pad, eos = generation_config.pad_token_id, generation_config.eos_token_id
    if pad is None:  # plain generate() pads with the first EOS id then
        pad = eos[0] if isinstance(eos, list) else eos
    # int64 whatever the prompt's integer type, as the tokens plain generate() appends are
    sequences = torch.full((batch, generation_config.max_length), 0 if pad is None else int(pad), dtype=torch.long,
                           device=input_ids.device)  # fmt: skip
    sequences[:, :prompt_length] = input_ids
    lengths = torch.full((batch,), prompt_length, device=input_ids.device)
    rows = torch.arange(batch, device=input_ids.device)  # the original row of each row still generating
    metrics = [SpeculationMetrics(num_speculative_tokens=num_heads) for _ in range(batch)]
    if tree:
        # A tree of depth d verifies its root and up to n_candidates nodes per depth (fewer where paths share one).
        widths = [min(n_candidates, _product(top_k[:depth])) for depth in range(1, num_heads + 1)]
        new_tokens = lambda depth: 1 + sum(widths[:depth])  # noqa: E731
    else:
        new_tokens = lambda depth: depth + 1  # noqa: E731
    kind = "tree" if tree else ("chain, sampled" if noise else "chain, greedy")
    controller = SpeculationController(
        lambda rows: cost_model_for(model, rows), acceptance_for(speculator, kind), num_heads, new_tokens,
        generation_config.num_assistant_tokens_schedule,
    )  # fmt: skip
    streamed = prompt_length  # columns of `sequences` handed to the streamer
    if streamer is not None:
        streamer.put(input_ids.cpu())

    def process(scores, extra=None, extra_lengths=None):
        """The logits processors, each row seeing its own tokens followed by `extra[:, :extra_lengths]`."""
        if not logits_processor:
            return scores
        ids, ends = sequences, lengths[rows]
        if extra is not None and extra.shape[1]:
            ids = torch.cat([sequences, sequences.new_zeros(batch, extra.shape[1])], dim=1)
            where = ends[:, None] + torch.arange(extra.shape[1], device=ends.device)
            ids[rows] = ids[rows].scatter(1, where, extra)
            ends = ends + (extra.shape[1] if extra_lengths is None else extra_lengths)
        for processor in logits_processor:
            if isinstance(processor, _SCORES_ONLY):
                scores = processor(ids[rows], scores)
            else:
                scores = _at_own_lengths(processor, ids, rows, ends, scores)
        return scores

    def select(scores, depth: int = 0):
        """Each row's token `depth` places past its last emitted one, from processed `scores`, as the verifier does."""
        if noise is None:
            return scores.argmax(dim=-1)
        return noise.sample(scores, rows, lengths[rows] + depth)

    def emit(tokens, counts):
        """Appends up to `counts[r]` of `tokens[r]` to each row, stopping a row where the stopping criteria say."""
        kept = torch.zeros_like(counts)
        finished = torch.zeros_like(counts, dtype=torch.bool)
        for column in range(tokens.shape[1]):
            live = (column < counts) & ~finished
            if not live.any():
                break
            live_rows = rows[live]
            sequences[live_rows, lengths[live_rows]] = tokens[live, column]
            lengths[live_rows] += 1
            kept[live] += 1
            stop = _at_own_lengths(
                lambda ids, _: stopping_criteria(ids, None), sequences, live_rows, lengths[live_rows]
            )
            finished[live] = stop.bool()
        if streamer is not None:
            stream(rows[~finished])
        return kept, finished

    def stream(live_rows):
        """
        Streams whole batches in their original row order, as plain `generate()` does: the columns that every row
        still generating has reached (rows that finished show padding), as one `(batch, columns)` chunk.
        """
        nonlocal streamed
        ready = int(lengths[live_rows].min()) if len(live_rows) else int(lengths.max())
        if ready > streamed:
            streamer.put(sequences[:, streamed:ready].cpu())
            streamed = ready

    # Prefill: the prompt emits the first token, and the hidden state that emitted it starts the first draft.
    outputs = _forward(model, input_ids, mask, (mask.cumsum(-1) - 1).clamp(min=0), cache, logits_to_keep=1)
    last_tokens = select(process(outputs.logits[:, -1].float()))
    hidden = outputs.hidden_states[-1][:, -1]
    next_position = mask.sum(-1)
    _, finished = emit(last_tokens[:, None], torch.ones_like(last_tokens))

    while True:
        keep = ~finished
        if not keep.all():
            cache.batch_select_indices(keep.nonzero().squeeze(1))
            rows, mask, hidden = rows[keep], mask[keep], hidden[keep]
            last_tokens, next_position = last_tokens[keep], next_position[keep]
        if not len(rows):
            break
        if noise is not None:
            noise.new_step()

        # A row's verifier forward adds one token of its own: never draft past max_length.
        room = (generation_config.max_length - lengths[rows] - 1).clamp(min=0)
        num_drafts = room.clamp(max=num_heads)
        planned = controller.start_step(cache.get_seq_length(), len(rows))
        if tree:  # a tree's drafts come all at once: its depth is the one planned
            num_drafts = num_drafts.clamp(max=planned)
        elif planned == 0:  # the speculator's drafts would not pay; prompt lookup's still may
            num_drafts = torch.zeros_like(num_drafts)
        spec_hidden = hidden.to(speculator.device, speculator.dtype)

        def speculator_chain(skip=None):
            limits = num_drafts if skip is None else torch.where(skip.to(num_drafts.device), 0, num_drafts)
            chain = draft_chain(heads, spec_hidden, last_tokens, limits, process, select, confidence_threshold,
                                controller.keep_drafting)  # fmt: skip
            return _to_device(chain, input_ids.device)

        from_lookup = torch.zeros_like(rows, dtype=torch.bool)
        if tree:
            drafts = _to_device(draft_tree(heads, spec_hidden, last_tokens, num_drafts, top_k, n_candidates),
                                input_ids.device)  # fmt: skip
        elif hybrid is not None:
            drafts, from_lookup = hybrid(speculator_chain, sequences, lengths, rows, room)
        else:
            drafts = speculator_chain()
        num_drafts = drafts.depths.amax(dim=1)  # fewer than asked where a chain stopped at an unsure draft

        # Verify every row's drafts in one forward.
        ancestors = drafts.ancestors()
        if tree:
            attention = _tree_attention_mask(mask, ancestors, model.dtype)
        else:  # a chain is causal: the plain 2D mask, which every model takes
            attention = torch.cat([mask, torch.ones_like(drafts.tokens)], dim=1)
        positions = next_position[:, None] + drafts.depths
        synchronize(input_ids.device)
        start = time.perf_counter()
        outputs = _forward(model, drafts.tokens, attention, positions, cache, logits_to_keep=drafts.num_nodes)
        synchronize(input_ids.device)
        if not from_lookup.any():  # lookup drafts may run deeper than the depths the controller weighs
            controller.end_step(int(num_drafts.max()), time.perf_counter() - start, drafts.num_nodes)
        paths = drafts.paths()
        scores = outputs.logits.float()
        if logits_processor:
            scores = torch.stack(
                [process(scores[:, node], paths[:, node], drafts.depths[:, node]) for node in range(drafts.num_nodes)],
                dim=1,
            )
        if noise is None:
            targets = scores.argmax(dim=-1)
        else:
            node_rows, positions = rows[:, None].expand_as(drafts.depths), lengths[rows, None] + drafts.depths
            targets = noise.sample(scores.flatten(0, 1), node_rows.flatten(), positions.flatten()).view_as(positions)
        best, next_tokens = _accept_greedy(drafts, targets)

        batch_rows = torch.arange(len(rows), device=rows.device)
        accepted = drafts.depths[batch_rows, best]
        new_tokens = torch.cat([paths[batch_rows, best], next_tokens[:, None]], dim=1)
        new_tokens[batch_rows, accepted] = next_tokens
        kept, finished = emit(new_tokens, accepted + 1)
        if tree:  # a tree's drafts have no single confidence: one bin holds its acceptance per depth
            confidences = torch.full((len(rows), num_heads), 0.5, dtype=torch.float64)
        else:
            confidences = drafts.confidences
        if confidences is not None:  # the speculator's rows only: the controller sizes its chains
            own = ~from_lookup
            controller.acceptance.record(confidences[own], num_drafts[own].tolist(), accepted[own].tolist())
        nonfinite = drafts.nonfinite if drafts.nonfinite is not None else torch.zeros_like(from_lookup)
        for row, drafted, emitted, lookup, broken in zip(rows.tolist(), num_drafts.tolist(), kept.tolist(),
                                                         from_lookup.tolist(), nonfinite.tolist()):  # fmt: skip
            metrics[row].record_step(drafted, emitted - 1, from_lookup=lookup, nonfinite=broken)

        # Keep the slots of the root and the accepted path; crop the slots that no row kept.
        kept_slots = ancestors[batch_rows, best]
        mask = torch.cat([mask, kept_slots.long()], dim=1)
        unused = drafts.num_nodes - 1 - int(kept_slots.any(dim=0).nonzero().max())
        if unused:
            cache.crop(-unused)
            mask = mask[:, :-unused]
        hidden = outputs.hidden_states[-1][batch_rows, best]
        last_tokens = next_tokens
        next_position = next_position + accepted + 1

    if streamer is not None:
        streamer.end()
    speculator.speculation_metrics_per_row = metrics
    speculator.speculation_metrics = sum(metrics, SpeculationMetrics(num_speculative_tokens=num_heads))
    controller.report_to(speculator.speculation_metrics)
    output = sequences[:, : int(lengths.max())]
    if generation_config.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(sequences=output)
    return output


def _product(values) -> int:
    out = 1
    for value in values:
        out *= value
    return out


def _accept_greedy(drafts: DraftTree, targets: torch.LongTensor):
    """The deepest node whose path the verifier's argmax confirms all the way (first such node on ties)."""
    rows = torch.arange(drafts.tokens.shape[0], device=targets.device)
    confirmed = drafts.valid & (drafts.tokens == targets.gather(1, drafts.parents))
    confirmed[:, 0] = True
    for node in range(1, drafts.num_nodes):  # a node counts only if its parent does
        confirmed[:, node] &= confirmed[rows, drafts.parents[:, node]]
    best = torch.where(confirmed, drafts.depths, -1).argmax(dim=-1)
    return best, targets[rows, best]


def _at_own_lengths(fn, ids, rows, ends, values=None):
    """
    `fn(ids[:, :end], values)` for each row of `rows` at its own length `ends[i]`, called as plain `generate()` calls
    logits processors and stopping criteria: on the whole batch, in its original order (some keep per-row state, such
    as the repetition penalty's prompt padding), once per distinct length. `values` holds one entry per row of `rows`.
    """
    full = None if values is None else values.new_zeros((ids.shape[0], *values.shape[1:]))
    if full is not None:
        full[rows] = values
    out = None
    for end in ends.unique().tolist():
        hit = ends == end
        result = fn(ids[:, :end], None if full is None else full.clone())
        if out is None:
            out = result.new_zeros((len(rows), *result.shape[1:]))
        out[hit] = result[rows[hit]]
    return out


def _forward(model, input_ids, attention_mask, position_ids, cache, logits_to_keep):
    takes_logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
    kwargs = {"logits_to_keep": logits_to_keep} if takes_logits_to_keep else {}
    return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True,
                 output_hidden_states=-1, **cache_kwargs(model, cache), **kwargs)  # fmt: skip


def _tree_attention_mask(mask, ancestors, dtype):
    """Additive 4D mask: each node sees the row's kept cache slots, itself and its ancestors."""
    nodes = ancestors.shape[1]
    allowed = torch.cat([mask.bool()[:, None].expand(-1, nodes, -1), ancestors], dim=-1)[:, None]
    return torch.zeros(allowed.shape, dtype=dtype, device=mask.device).masked_fill(~allowed, torch.finfo(dtype).min)


def _to_device(drafts: DraftTree, device) -> DraftTree:
    return DraftTree(*(None if t is None else t.to(device) for t in (drafts.tokens, drafts.parents, drafts.depths,
                                                                     drafts.valid, drafts.confidences,
                                                                     drafts.nonfinite)))  # fmt: skip


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


def _take_cache(model, model_kwargs, generation_config, input_ids, num_nodes):
    """The dynamic cache `generate()` prepared, after checking that the masked-slot design can use it."""
    cache = pop_prepared_cache(model_kwargs)
    for name in ("attention_mask", "position_ids", "use_cache", "logits_to_keep"):
        model_kwargs.pop(name, None)
    if model_kwargs:
        raise ValueError(
            f"Batched or tree speculative decoding cannot pass {sorted(model_kwargs)} to the model. Drop them, or "
            "generate one prompt at a time without n_candidates."
        )
    if cache is None:
        cache = DynamicCache(config=model.config)
    if type(cache) is not DynamicCache:
        raise ValueError(
            f"Batched or tree speculative decoding needs a DynamicCache (it masks rejected drafts' cache slots), got "
            f"{type(cache).__name__}. Drop cache_implementation / the cache argument."
        )
    window = getattr(model.config.get_text_config(), "sliding_window", None)
    worst_case = input_ids.shape[1] + (generation_config.max_length - input_ids.shape[1]) * (num_nodes + 1)
    if any(cache.is_sliding) and window and worst_case > window:
        raise ValueError(
            f"This model attends over a sliding window of {window} cache slots, and rejected drafts occupy slots: "
            f"this call could fill up to {worst_case} slots and silently see fewer real tokens than the model should. "
            "Lower max_new_tokens, or generate one prompt at a time without n_candidates."
        )
    return cache
