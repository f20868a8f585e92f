"""One round of drafts for a batch: a chain of `k` tokens per row, or a tree of candidate suffixes per row.

Both come out as `Drafts`, the layout the verifier checks in one forward. Node 0 of each row is the row's last emitted
token (not yet in the KV cache); nodes 1.. are drafts. A chain's node `q` follows node `q - 1`, so a chain needs
nothing else: it is verified with the plain causal mask and accepted by comparing two rows of tokens. A tree carries
its `TreeLayout` (each node's parent and depth), merged on the host. Chains are drafted without reading anything
back: a GPU runs the heads back to back.
"""

import math
from dataclasses import dataclass
from enum import Enum
from functools import cached_property
from typing import NamedTuple, Protocol

import torch
from torch.utils._pytree import tree_map

from ..utils.host_transfer import to_host


class DraftKind(Enum):
    """What a call drafts; each kind keeps its own acceptance estimate (a sampled draft is accepted less often)."""

    CHAIN_GREEDY = "chain, greedy"
    CHAIN_SAMPLED = "chain, sampled"
    TREE = "tree"


class DraftHeads(Protocol):
    """
    What drafts: a speculator's heads. `input_state` turns the verifier's hidden states `(rows, ..., hidden)` into head
    0's state; `step(head, state, tokens)` runs head `head` on a state and the tokens before it (shaped as the state's
    leading dimensions) and returns the next state and its logits over the vocabulary. Heads that score a reduced
    draft vocabulary may also list its ids in `draft_vocab` and give their logits over it alone through `draft_step`
    (`scored_step` uses them). A state is a tensor or a tuple of tensors (an LSTM carries two), each with the rows, and
    for trees the candidates, as leading dimensions.
    """

    def input_state(self, hidden_states: torch.Tensor): ...

    def step(self, head: int, state, input_ids: torch.LongTensor) -> tuple[object, torch.Tensor]: ...


@dataclass(frozen=True)
class TreeSpec:
    """
    The shape of a call's trees: head `i` keeps its `top_k[i]` likeliest tokens on every branch, and the `n_candidates`
    likeliest paths are verified (IBM's tree drafting), over `num_heads` heads.
    """

    top_k: tuple[int, ...]
    n_candidates: int
    num_heads: int

    def __post_init__(self):
        top_k = self.top_k
        if len(top_k) < self.num_heads:
            raise ValueError(
                f"top_k_tokens_per_head={list(top_k)} needs one positive branching factor for each of the "
                f"{self.num_heads} heads that draft."
            )
        leaves = math.prod(top_k[: self.num_heads])
        if not 1 <= self.n_candidates <= leaves:
            raise ValueError(
                f"n_candidates={self.n_candidates} must be between 1 and the {leaves} paths of the "
                f"top_k_tokens_per_head={list(top_k[: self.num_heads])} tree."
            )

    @classmethod
    def for_call(cls, config, num_heads: int, n_candidates=None, top_k_tokens_per_head=None) -> "TreeSpec | None":
        """The tree a call asks for with either argument (the other from the speculator's `config`), or None."""
        if n_candidates is None and top_k_tokens_per_head is None:
            return None
        if n_candidates is not None and (not _is_int(n_candidates) or n_candidates < 1):
            raise ValueError(
                f"n_candidates={n_candidates!r}: a tree keeps that many candidate paths, so it must be a positive "
                f"integer (the speculator's own is {config.n_candidates})."
            )
        top_k = top_k_tokens_per_head if top_k_tokens_per_head is not None else config.top_k_tokens_per_head
        if not isinstance(top_k, (list, tuple)) or not all(_is_int(k) and k > 0 for k in top_k):
            raise ValueError(
                f"top_k_tokens_per_head={top_k!r}: give a list of positive integers, one branching factor per head "
                f"(the speculator's own is {config.top_k_tokens_per_head})."
            )
        return cls(tuple(top_k), config.n_candidates if n_candidates is None else n_candidates, num_heads)

    def new_tokens(self, depth: int) -> int:
        """The nodes a tree `depth` deep verifies per row: its root and up to `n_candidates` nodes per depth."""
        return 1 + sum(min(self.n_candidates, math.prod(self.top_k[:d])) for d in range(1, depth + 1))


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class HostDrafts(NamedTuple):
    """
    A step's drafts as the host reads them back (see `Drafts.to_read`), per row: `limits` (drafts along its deepest
    path), `confidences` (a chain's, one per draft; None for a tree or a plain step), `nonfinite` (whether a head's
    logits were not finite), and `tokens` (node 0 the last emitted token; None where nobody asked for them).
    """

    limits: list[int]
    confidences: list[list[float]] | None
    nonfinite: list[bool]
    tokens: list[list[int]] | None

    def drafts(self, row: int) -> list[int]:
        """Row `row`'s drafts along a chain, up to its limit (none where the tokens were not read: a plain step)."""
        return [] if self.tokens is None else self.tokens[row][1 : self.limits[row] + 1]

    def until_eos(self, eos_ids: set[int]) -> "HostDrafts":
        """Each row's chain ended at its first end-of-sequence draft: nothing after it could be emitted."""
        ends = [next((i + 1 for i, token in enumerate(self.drafts(row)) if token in eos_ids), limit)
                for row, limit in enumerate(self.limits)]  # fmt: skip
        return self._replace(limits=ends)


@dataclass
class TreeLayout:
    """
    Args:
        parents (`torch.LongTensor` of shape `(rows, nodes)`): the root is its own parent; parents come first.
        depths (`torch.LongTensor` of shape `(rows, nodes)`): drafts between the root and the node; 0 for the root.
        valid (`torch.BoolTensor` of shape `(rows, nodes)`): `False` for the padding that evens out the rows.
        host_depths (`list[list[int]]`): `depths` on the host.
    """

    parents: torch.LongTensor
    depths: torch.LongTensor
    valid: torch.BoolTensor
    host_depths: list[list[int]]

    @cached_property
    def ancestors(self) -> torch.BoolTensor:
        """`(rows, nodes, nodes)`: `[b, q, j]` is True when node `j` is node `q` or one of its ancestors."""
        rows, nodes = self.parents.shape
        ancestors = torch.eye(nodes, dtype=torch.bool, device=self.parents.device).repeat(rows, 1, 1)
        batch = torch.arange(rows, device=self.parents.device)
        for node in range(1, nodes):  # parents come first, so their rows are already complete
            ancestors[:, node] |= ancestors[batch, self.parents[:, node]]
        return ancestors

    def paths(self, tokens: torch.LongTensor, max_depth: int) -> torch.LongTensor:
        """`(rows, nodes, max_depth)`: the drafts from the root down to each node, the node's own token last."""
        rows, nodes = tokens.shape
        paths = tokens.new_zeros(rows, nodes, max(max_depth, 1))
        batch = torch.arange(rows, device=tokens.device)
        for node in range(1, nodes):
            paths[:, node] = paths[batch, self.parents[:, node]]
            depth = self.depths[:, node].clamp(min=1) - 1
            paths[batch, node, depth] = tokens[:, node]
        return paths


@dataclass
class Drafts:
    """
    Args:
        tokens (`torch.LongTensor` of shape `(rows, nodes)`): node 0 is the row's last emitted token.
        limits (`torch.LongTensor` of shape `(rows,)`): each row's drafts along its deepest path; a chain's nodes past
            its row's limit are verified but never accepted.
        max_depth (`int`): the deepest node's depth, known on the host.
        confidences (`torch.FloatTensor` of shape `(rows, nodes - 1)`, *optional*): for a chain, the probability the
            speculator gave each draft.
        nonfinite (`torch.BoolTensor` of shape `(rows,)`, *optional*): rows whose drafts ended early because a head
            gave non-finite logits.
        tree (`TreeLayout`, *optional*): the layout of a tree; None for a chain.
    """

    tokens: torch.LongTensor
    limits: torch.LongTensor
    max_depth: int
    confidences: torch.FloatTensor | None = None
    nonfinite: torch.BoolTensor | None = None
    tree: TreeLayout | None = None

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    def node_depths(self, row: int) -> list[int]:
        """The depth of each node of `row`, on the host."""
        return self.tree.host_depths[row] if self.tree is not None else list(range(self.num_nodes))

    def to_read(self, tokens: bool = False) -> tuple:
        """The tensors the host reads back for `HostDrafts.read` (with the tokens, if `tokens`)."""
        return self.limits, self.confidences, self.nonfinite, self.tokens if tokens else None

    @staticmethod
    def read(limits, confidences, nonfinite, tokens) -> HostDrafts:
        """A `HostDrafts` from the host values of `to_read`'s tensors."""
        return HostDrafts(limits, confidences, [bool(b) for b in nonfinite or [0] * len(limits)], tokens)

    def cut(self, depth: int) -> "Drafts":
        """A chain ended after `depth` drafts in every row."""
        return Drafts(self.tokens[:, : depth + 1], self.limits.clamp(max=depth), depth,
                      None if self.confidences is None else self.confidences[:, :depth], self.nonfinite)  # fmt: skip


def plain_step(last_tokens: torch.LongTensor) -> Drafts:
    """A step with no drafts: each row's last token alone."""
    return Drafts(last_tokens[:, None], torch.zeros_like(last_tokens), 0)


def draft_chain(heads: DraftHeads, hidden, last_tokens, limits, depth: int, process=None, select=None,
                confidence_threshold: float = 0.0) -> Drafts:  # fmt: skip
    """
    Drafts `depth` heads for every row and keeps `limits[b]` of them for row `b` (all `depth` where `limits` is
    None). `process(scores, drafts)` applies the logits processors to the scores that follow `drafts` (a list of the
    drafts so far) and `select(scores, head)` picks head `head`'s token, both exactly as the verifier picks its tokens
    (argmax when not given).

    Each draft's confidence is the probability its head gave it. A row's chain ends before a draft whose logits were
    not finite (a diverged or overflowing speculator: NaN weights, an fp16 head past 65504), and, as transformers'
    assistants do with `assistant_confidence_threshold`, after its first draft that got less than
    `confidence_threshold`: the heads after it would rarely be accepted, and each costs a verified position. Both cuts
    depend on the drafts already made alone, so decoding stays lossless; both are taken after the last head, from the
    confidences, so that nothing is read back between heads.
    """
    if not depth:
        return plain_step(last_tokens)
    device = last_tokens.device  # the verifier's: processors and tokens live there
    state = heads.input_state(hidden)
    token = last_tokens
    drafts, confidences = [], []
    for head in range(depth):
        if process is None and select is None:
            state, logits, vocab = scored_step(heads, head, state, token.to(_device(state)))
            index = logits.argmax(dim=-1)
            token = base_ids(vocab, index).to(device)
            scores = logits
        else:  # the distribution a sample is drawn from, over the whole vocabulary, exactly in fp32
            state, logits = heads.step(head, state, token.to(_device(state)))
            scores = logits.to(device).float()
            scores = scores if process is None else process(scores, drafts)
            index = token = scores.argmax(dim=-1) if select is None else select(scores, head)
        drafts.append(token)
        # NaN or infinite logits make the whole softmax NaN, hence a NaN confidence: the check below sees them.
        confidences.append(scores.softmax(dim=-1, dtype=torch.float32).gather(1, index[:, None]).to(device))
    confidences = torch.cat(confidences, dim=1)
    heads_run = torch.arange(depth, device=device)
    broken = confidences.isnan()
    # A row keeps the drafts before its first broken one, and up to and including its first unsure one.
    ends = torch.where(broken, heads_run, depth)
    if confidence_threshold > 0:
        ends = torch.minimum(ends, torch.where(confidences < confidence_threshold, heads_run + 1, depth))
    ends = ends.amin(dim=1)
    limits = ends if limits is None else torch.minimum(limits, ends)
    return Drafts(torch.stack([last_tokens, *drafts], dim=1), limits, depth, confidences, broken.any(dim=1))


def draft_tree(heads: DraftHeads, hidden, last_tokens, limits, depth: int, tree: TreeSpec) -> Drafts:
    """
    IBM's tree drafting (`tree`): head `i` keeps its `top_k[i]` most likely tokens on every branch, the
    log-probabilities add up along each path, and the `n_candidates` most likely full paths become the tree (shared
    prefixes merged), cut to `limits[b]` drafts deep in row `b` (`depth` where None). A row whose head gives non-finite
    logits keeps the drafts before that head. A state of several tensors (`DraftHeads`) branches with its candidates.
    """
    if not depth:
        return plain_step(last_tokens)
    rows, top_k = hidden.shape[0], tree.top_k
    state = tree_map(lambda part: part[:, None], heads.input_state(hidden))  # (rows, candidates, ...)
    device = _device(state)
    token = last_tokens[:, None].to(device)
    scores = torch.zeros(rows, 1, device=device)
    paths = token.new_zeros(rows, 1, 0)
    ends = torch.full((rows,), depth, device=device)
    for head in range(depth):
        state, logits, vocab = scored_step(heads, head, state, token)
        broken = ~torch.isfinite(logits).flatten(1).all(dim=-1)
        ends = torch.where(broken, ends.clamp(max=head), ends)
        logits = logits.masked_fill(broken[:, None, None], 0.0)  # picking from them still works; they are cut
        # A branch keeps at most the tokens its head scores: the rest have probability zero.
        k = min(top_k[head], logits.shape[-1])
        best = logits.float().log_softmax(dim=-1).topk(k, dim=-1)
        scores = (scores[..., None] + best.values).flatten(1)
        token = base_ids(vocab, best.indices).flatten(1)
        paths = torch.cat([paths.repeat_interleave(k, dim=1), token[..., None]], dim=-1)
        state = tree_map(lambda part: part.repeat_interleave(k, dim=1), state)
    chosen = scores.topk(min(tree.n_candidates, scores.shape[1]), dim=-1).indices
    candidates = paths.gather(1, chosen[..., None].expand(-1, -1, paths.shape[-1]))
    ends = ends.to(last_tokens.device)
    drafts = tree_from_candidates(candidates, last_tokens, ends if limits is None else torch.minimum(limits, ends))
    drafts.nonfinite = ends < depth
    return drafts


def scored_step(heads: DraftHeads, head: int, state, input_ids: torch.LongTensor):
    """
    Head `head`'s next state, its logits over the tokens it scores, and their ids (None: the whole vocabulary), where
    greedy drafts and trees need no more: the tokens outside a draft vocabulary have probability zero. Spreading its
    logits over the whole vocabulary first cost as much as the head itself at 8 rows, twice it at 32 (the default
    speculator: 2048 of SmolLM2's 49152 tokens, 2026-12-07).
    """
    vocab = getattr(heads, "draft_vocab", None)
    if vocab is None:
        return *heads.step(head, state, input_ids), None
    return *heads.draft_step(head, state, input_ids), vocab


def base_ids(vocab: torch.LongTensor | None, index: torch.LongTensor) -> torch.LongTensor:
    """The vocabulary ids of positions `index` in logits that `scored_step` gave over `vocab`."""
    return index if vocab is None else vocab[index]


def _device(state) -> torch.device:
    """The device of a state: a tensor, or a tuple of tensors on one device."""
    return state.device if isinstance(state, torch.Tensor) else state[0].device


def tree_from_candidates(candidates: torch.LongTensor, last_tokens, limits) -> Drafts:
    """
    Merges each row's candidate suffixes `(rows, n, depth)`, cut to `limits[b]` tokens, into one tree: on the host,
    one transfer each way.
    """
    merged = []
    for candidates_row, root, limit in zip(*to_host(candidates, last_tokens, limits)):
        index, tokens, parents, depths = {(): 0}, [root], [0], [0]
        for candidate in candidates_row:
            for depth in range(1, min(len(candidate), limit) + 1):
                prefix = tuple(candidate[:depth])
                if prefix not in index:
                    index[prefix] = len(tokens)
                    tokens.append(prefix[-1])
                    parents.append(index[prefix[:-1]])
                    depths.append(depth)
        merged.append((tokens, parents, depths))
    width = max(len(tokens) for tokens, _, _ in merged)
    # Padding nodes: token 0, the root as parent, depth 0, and not valid.
    host = [[column + [0] * (width - len(column)) for column in (*row, [1] * len(row[0]))] for row in merged]
    tokens, parents, depths, valid = torch.tensor(host, device=last_tokens.device).unbind(dim=1)
    host_depths = [row[2] for row in host]
    layout = TreeLayout(parents, depths, valid.bool(), host_depths)
    return Drafts(tokens, depths.amax(dim=1), max(map(max, host_depths)), tree=layout)
