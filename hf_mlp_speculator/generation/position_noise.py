"""Sampling keyed by position: the same seed gives the same tokens, however the drafting went.

A sampled call draws one seed from torch's global generator (so `torch.manual_seed` before the call fixes it). Each
position of each row then has its own noise over the vocabulary, exponential draws from a generator keyed by (seed,
row, position), and the token at that position is `argmax(p / noise)`, where `p` is the processed distribution there:
the exponential race (the Gumbel-max trick in another form), an exact sample of `p`. A draft for a position is the
same race run on the draft's processed distribution with the same noise, and verification is the greedy rule: a
draft is kept when it equals the verifier's token. So every emitted token is the one that plain decoding with the same
noise would emit, whatever was drafted, how deep, and by whom (speculator or prompt lookup): output follows the
verifier's distribution exactly, and no timing or earlier call can change a token.

The price, against rejection sampling: a draft is kept only when both races pick the same token, which happens less
often than rejection sampling's `min(1, p / q)` where the two distributions differ.
"""

import torch

_MASK64 = (1 << 64) - 1


def _mix(value: int) -> int:
    """splitmix64's finaliser: nearby integers (rows, positions) become unrelated 64-bit seeds."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


class PositionNoise:
    """The noise of one sampled call, `vocab_size` wide, on `device`; `seed` drawn from torch's generator if None."""

    def __init__(self, vocab_size: int, device, seed: int | None = None):
        self.vocab_size, self.device = vocab_size, torch.device(device)
        self.seed = int(torch.randint(2**62, (1,))) if seed is None else seed
        self._kept = {}  # (row, position) -> noise, for the positions of the current step

    def new_step(self) -> None:
        """Forgets the noise of earlier positions: drafting and verifying a step ask for the same ones."""
        self._kept.clear()

    def at(self, rows: list[int], positions: list[int]) -> torch.FloatTensor:
        """
        `(n, vocab_size)`: the noise of row `rows[i]` (its index in the call's batch) at position `positions[i]`. Both
        are host integers: the noise is drawn on the device without reading anything back.
        """
        out = []
        for row, position in zip(rows, positions):
            if (row, position) not in self._kept:
                generator = torch.Generator(self.device).manual_seed(_mix(_mix(self.seed ^ row) ^ position) >> 1)
                noise = torch.empty(self.vocab_size, device=self.device).exponential_(generator=generator)
                self._kept[row, position] = noise.clamp_(min=torch.finfo(noise.dtype).tiny)
            out.append(self._kept[row, position])
        return torch.stack(out)

    def sample(self, scores: torch.FloatTensor, rows: list[int], positions: list[int]):
        """The token each row of processed `scores` `(n, vocab)` samples at its position (host integers)."""
        return (scores.float().softmax(dim=-1) / self.at(rows, positions).to(scores.device)).argmax(dim=-1)
