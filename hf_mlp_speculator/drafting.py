"""One round of drafts for a batch: a chain of `k` tokens per row, or a tree of candidate suffixes per row.

Both come out as a `DraftTree`, the layout the verifier checks in one forward. Node 0 of each row is the row's last
emitted token (not yet in the KV cache); nodes 1.. are drafts, every parent before its children. A chain is the tree
whose node `q` has parent `q - 1`. Chains are drafted and laid out on the device without reading anything back; a tree
merges its candidates' shared prefixes on the host.
"""

from dataclasses import dataclass

import torch

from .host_transfer import to_host
from .modeling_mlp_speculator import MLPSpeculator


@dataclass
class DraftTree:
    """
    Args:
        tokens (`torch.LongTensor` of shape `(rows, nodes)`): node 0 is the row's last emitted token.
        parents (`torch.LongTensor` of shape `(rows, nodes)`): the root is its own parent.
        depths (`torch.LongTensor` of shape `(rows, nodes)`): drafts between the root and the node; 0 for the root.
        valid (`torch.BoolTensor` of shape `(rows, nodes)`): `False` for the padding that evens out the rows.
        max_depth (`int`): the deepest node's depth, known on the host.
        confidences (`torch.FloatTensor` of shape `(rows, nodes - 1)`, *optional*): for a chain, the probability the
            speculator gave each draft.
        nonfinite (`torch.BoolTensor` of shape `(rows,)`, *optional*): rows whose drafts ended early because a head
            gave non-finite logits (see `finite_logits`).
        host_depths (`list[list[int]]`, *optional*): `depths` on the host, for a tree (a chain's node `q` is `q` deep).
    """

    tokens: torch.LongTensor
    parents: torch.LongTensor
    depths: torch.LongTensor
    valid: torch.BoolTensor
    max_depth: int
    confidences: torch.FloatTensor | None = None
    nonfinite: torch.BoolTensor | None = None
    host_depths: list[list[int]] | None = None

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    @property
    def limits(self) -> torch.LongTensor:
        """Each row's number of drafts along its deepest path."""
        return self.depths.amax(dim=1)

    def ancestors(self) -> torch.BoolTensor:
        """`(rows, nodes, nodes)`: `[b, q, j]` is True when node `j` is node `q` or one of its ancestors."""
        rows, nodes = self.tokens.shape
        ancestors = torch.eye(nodes, dtype=torch.bool, device=self.tokens.device).repeat(rows, 1, 1)
        batch = torch.arange(rows, device=self.tokens.device)
        for node in range(1, nodes):  # parents come first, so their rows are already complete
            ancestors[:, node] |= ancestors[batch, self.parents[:, node]]
        return ancestors

    def paths(self) -> torch.LongTensor:
        """`(rows, nodes, max_depth)`: the drafts from the root down to each node, the node's own token last."""
        rows, nodes = self.tokens.shape
        paths = self.tokens.new_zeros(rows, nodes, max(self.max_depth, 1))
        batch = torch.arange(rows, device=self.tokens.device)
        for node in range(1, nodes):
            paths[:, node] = paths[batch, self.parents[:, node]]
            depth = self.depths[:, node].clamp(min=1) - 1
            paths[batch, node, depth] = self.tokens[:, node]
        return paths

    def node_depths(self, row: int) -> list[int]:
        """The depth of each node of `row`, on the host."""
        return self.host_depths[row] if self.host_depths is not None else list(range(self.num_nodes))

    def cut(self, depth: int) -> "DraftTree":
        """A chain ended after `depth` drafts in every row."""
        limits = self.limits.clamp(max=depth)
        cut = chain_tree(self.tokens[:, 0], self.tokens[:, 1 : depth + 1], limits, depth)
        cut.confidences = None if self.confidences is None else self.confidences[:, :depth]
        cut.nonfinite = self.nonfinite
        return cut


def chain_tree(last_tokens, drafts, limits, max_depth: int) -> DraftTree:
    """
    The chains `drafts[b, :limits[b]]` after `last_tokens[b]` as a `DraftTree` of `max_depth + 1` nodes per row, built
    on the device.
    """
    rows = last_tokens.shape[0]
    nodes = torch.arange(max_depth + 1, device=last_tokens.device).expand(rows, -1)
    valid = nodes <= limits[:, None]
    tokens = torch.cat([last_tokens[:, None], drafts[:, :max_depth]], dim=1).masked_fill(~valid, 0)
    return DraftTree(tokens=tokens, parents=(nodes - 1).clamp(min=0), depths=nodes.masked_fill(~valid, 0),
                     valid=valid, max_depth=max_depth)  # fmt: skip


def finite_logits(logits: torch.FloatTensor, num_drafts, head: int, nonfinite):
    """
    A diverged or overflowing speculator (NaN weights, an fp16 head past 65504) gives non-finite logits; a row whose
    head `head` did drafts nothing from that head on: its drafts end before it (a plain step where it is the first).
    Returns the logits with zeros in those rows (so that picking from them still works; those drafts are dropped), the
    new per-row limits, and `nonfinite` updated. No host synchronisation.
    """
    broken = ~torch.isfinite(logits).flatten(1).all(dim=-1)
    limits = torch.where(broken, num_drafts.clamp(max=head), num_drafts)
    zeroed = logits.masked_fill(broken.view(-1, *[1] * (logits.dim() - 1)), 0.0)
    return zeroed, limits, nonfinite | broken


def draft_chain(
    heads: MLPSpeculator, hidden, last_tokens, num_drafts, depth: int, process, select, confidence_threshold=0.0
) -> DraftTree:
    """
    Drafts `depth` heads for every row and keeps `num_drafts[b]` of them for row `b`. `process(scores, drafts)`
    applies the logits processors to the scores that follow `drafts` and `select(scores, head)` picks head `head`'s
    token, both exactly as the verifier picks its tokens (sampled with the noise of the position the draft is for, see
    `position_noise`).

    As transformers' assistants do with `assistant_confidence_threshold`, a row's chain ends with its first draft that
    got less than `confidence_threshold` probability: the heads after it would rarely be accepted, and each costs a
    verified position. Stopping depends on the drafts already made alone, so decoding stays lossless. Nothing is read
    back to the host: a GPU runs the heads back to back.
    """
    device = last_tokens.device  # the verifier's: processors and tokens live there
    state = heads.input_state(hidden)
    token = last_tokens
    drafts, confidences = [], []
    nonfinite = torch.zeros_like(num_drafts, dtype=torch.bool)
    for head in range(depth):
        state, logits = heads.step(head, state, token.to(state.device))
        logits, num_drafts, nonfinite = finite_logits(logits.to(device, torch.float32), num_drafts, head, nonfinite)
        scores = process(logits, torch.stack(drafts, dim=1) if drafts else None)
        token = select(scores, head)
        drafts.append(token)
        confidences.append(scores.softmax(-1).gather(1, token[:, None]).squeeze(1))
        if confidence_threshold > 0:
            unsure = confidences[-1] < confidence_threshold
            num_drafts = torch.where(unsure, num_drafts.clamp(max=head + 1), num_drafts)
    stacked = torch.stack(drafts, dim=1) if drafts else last_tokens.new_zeros(len(last_tokens), 0)
    tree = chain_tree(last_tokens, stacked, num_drafts.clamp(max=depth), depth)
    tree.confidences = torch.stack(confidences, dim=1) if confidences else None
    tree.nonfinite = nonfinite
    return tree


def draft_tree(
    heads: MLPSpeculator, hidden, last_tokens, num_drafts, depth: int, top_k: list[int], n_candidates: int
) -> DraftTree:
    """
    IBM's tree drafting: head `i` keeps its `top_k[i]` most likely tokens on every branch, the log-probabilities add
    up along each path, and the `n_candidates` most likely full paths become the tree (shared prefixes merged), cut to
    `num_drafts[b]` drafts deep in row `b`.
    """
    rows = hidden.shape[0]
    state = heads.input_state(hidden)[:, None]
    token = last_tokens[:, None].to(state.device)
    scores = torch.zeros(rows, 1, device=state.device)
    paths = token.new_zeros(rows, 1, 0)
    limits, nonfinite = num_drafts.to(state.device), torch.zeros(rows, dtype=torch.bool, device=state.device)
    for head in range(depth):
        state, logits = heads.step(head, state, token)
        logits, limits, nonfinite = finite_logits(logits, limits, head, nonfinite)
        best = logits.float().log_softmax(dim=-1).topk(top_k[head], dim=-1)
        scores = (scores[..., None] + best.values).flatten(1)
        token = best.indices.flatten(1)
        paths = torch.cat([paths.repeat_interleave(top_k[head], dim=1), token[..., None]], dim=-1)
        state = state.repeat_interleave(top_k[head], dim=1)
    chosen = scores.topk(min(n_candidates, scores.shape[1]), dim=-1).indices
    candidates = paths.gather(1, chosen[..., None].expand(-1, -1, paths.shape[-1]))
    tree = tree_from_candidates(candidates, last_tokens, limits.to(num_drafts.device))
    tree.nonfinite = nonfinite.to(num_drafts.device)
    return tree


def tree_from_candidates(candidates: torch.LongTensor, last_tokens, num_drafts) -> DraftTree:
    """
    Merges each row's candidate suffixes `(rows, n, depth)`, cut to `num_drafts[b]` tokens, into one tree: on the host,
    one transfer each way.
    """
    merged = []
    for candidates_row, root, limit in zip(*to_host(candidates, last_tokens, num_drafts)):
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
    return DraftTree(tokens=tokens, parents=parents, depths=depths, valid=valid.bool(),
                     max_depth=max(map(max, host_depths)), host_depths=host_depths)  # fmt: skip
