"""Which KV cache slots each row of a batch attends to, in the package's decoding loop.

One rectangular cache holds the whole batch, realigned by the attention mask alone. Every step appends the same slots
to every row: its last emitted token and its drafts. The verifier then switches off, in the 2D attention mask, the
slots of the drafts each row rejected, and a row's positions count only the slots it kept, so every row attends to
exactly its own tokens at their true positions. Slots that every row rejected are cropped off the cache (one prompt
drafting a chain never keeps a masked slot, and runs without a mask at all). Once the masked slots pass
`COMPACT_SHARE` of the cache, each row's kept slots move together (`compact`): the cache holds little more than the
tokens, and later steps read no more than they need.
"""

import torch

from .transformers_hooks import can_gather_slots, drop_last_slots, gather_slots

# Rejected drafts' slots are freed once they are more than this share of the cache (see `CacheSlots.compact`).
COMPACT_SHARE = 0.05


class CacheSlots:
    """
    The cache's slots for a batch: `width` slots in all and `kept[i]` of them attended to by row `i` (on the host),
    the attention `mask` over them (on the device, held only while some row has a masked slot: padding, or a rejected
    draft another row kept; without one the model need not build or check a mask), and the most slots the cache held
    (`peak`).
    """

    def __init__(self, prompt_mask: torch.LongTensor, kept: list[int]):
        self.width = self.peak = prompt_mask.shape[1]
        self.kept = kept
        self.mask = prompt_mask if min(kept) < self.width else None

    def select(self, keep: list[int], index: torch.LongTensor) -> None:
        """Keeps the rows `keep` (`index` on the device): the others finished."""
        self.kept = [self.kept[i] for i in keep]
        self.mask = None if self.mask is None else self.mask[index]

    def chain_mask(self, nodes: int) -> torch.LongTensor | None:
        """The 2D mask of a step that verifies `nodes` chained tokens per row (causal among themselves), or None."""
        return None if self.mask is None else torch.cat([self.mask, self.mask.new_ones(len(self.mask), nodes)], dim=1)

    def tree_mask(self, ancestors: torch.BoolTensor, dtype) -> torch.Tensor:
        """Additive 4D mask of a tree: each node sees the row's kept cache slots, itself and its ancestors."""
        rows, nodes = ancestors.shape[:2]
        mask = self.mask.bool() if self.mask is not None else ancestors.new_ones((rows, self.width))
        allowed = torch.cat([mask[:, None].expand(-1, nodes, -1), ancestors], dim=-1)[:, None]
        additive = torch.zeros(allowed.shape, dtype=dtype, device=mask.device)
        return additive.masked_fill(~allowed, torch.finfo(dtype).min)

    def keep(self, cache, kept: torch.BoolTensor, nodes: int, deepest: int, accepted: list[int]) -> None:
        """
        After a step that appended `nodes` slots per row, of which row `i` keeps `kept[i]` (its root and accepted
        path) and `accepted[i] + 1` in all: crops the slots past the `deepest` node any row kept (the deepest kept slot
        of a row is its last kept node: ancestors come first), masks the others each row rejected, and compacts.
        """
        self.peak = max(self.peak, self.width + nodes)
        width, self.width = self.width, self.width + deepest + 1
        self.kept = [slots + count + 1 for slots, count in zip(self.kept, accepted)]
        if self.mask is None and min(self.kept) < self.width:  # this step left a row a masked slot
            self.mask = torch.ones((len(self.kept), width), dtype=torch.long, device=kept.device)
        if self.mask is not None:
            self.mask = torch.cat([self.mask, kept[:, : deepest + 1].long()], dim=1)
        drop_last_slots(cache, nodes - 1 - deepest)
        self.compact(cache)

    def compact(self, cache) -> None:
        """
        Frees rejected drafts' slots once they pass `COMPACT_SHARE` of the cache: every row's kept slots move together,
        in order and left-padded, in every cache layer and in the mask. Positions stay as they were, so every row still
        sees exactly its own tokens; later steps read fewer slots. A sliding window keeps too few slots to move, and
        offloaded or indexed caches are left as they are.
        """
        width, most = self.width, max(self.kept)
        if self.mask is None or width - most <= COMPACT_SHARE * width or not can_gather_slots(cache):
            return
        # A stable sort puts each row's masked slots first and its kept ones last, both in order.
        order = torch.sort(self.mask, dim=1, stable=True).indices[:, width - most :]
        self.mask = self.mask.gather(1, order)
        gather_slots(cache, order)
        self.width = most
        if min(self.kept) == most:  # every row's slots are all kept: no mask needed
            self.mask = None
