"""What every speculator's heads share: the draft vocabulary, the teacher-forced forward, and the layer norm.

A speculator's heads subclass `SpeculatorHeads`, add their layers (the output layers and input norm through the helpers
here, in the order that keeps a seed's initialisation), and define `input_state` (the verifier's hidden states to head
0's state) and `draft_step` (one head: next state and logits over the draft vocabulary). A state is a tensor, or a
tuple of tensors for heads that carry more than one (an LSTM's hidden and cell states).
"""

import math

import torch
from torch import nn


class MLPSpeculatorLayerNorm(nn.Module):
    """RMS normalisation without mean subtraction, optionally followed by `x * weight + bias` (as in fms-extras)."""

    def __init__(self, dim: int, eps: float = 1e-6, elementwise_affine: bool = True):
        super().__init__()
        self.eps = eps
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(dim))
            self.bias = nn.Parameter(torch.zeros(dim))
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The mean of squares is taken in fp32 so that fp16/bf16 checkpoints do not overflow on large hidden states.
        xf = x.float()
        x = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)
        if self.weight is not None:
            x = x * self.weight + self.bias
        return x


class SpeculatorHeads(nn.Module):
    """
    The base of a speculator's heads: `n_predict` heads over a `vocab_size` vocabulary, whose output layers `head[i]`
    may score only a draft vocabulary (the base ids in the `draft_vocab` buffer).
    """

    def __init__(self, config, width: int):
        super().__init__()
        n = config.n_predict
        self.n_predict, self.vocab_size = n, config.vocab_size
        self.activation = nn.GELU()
        # The scaling depends on the TRAINED head count: drafting with fewer heads must not change it.
        state_weight = 0.5 ** (0.5 / n)
        self.emb_scale = math.sqrt((1 - state_weight**2) * (width / 2)) / state_weight

    def add_output_layers(self, config, width: int, count: int) -> None:
        """`count` output layers `head` (they may score a draft vocabulary only) and the `draft_vocab` buffer."""
        # Any token may be the last emitted one, so the embeddings always cover the whole vocabulary; only the heads'
        # output layers shrink to the draft vocabulary.
        draft_vocab = config.draft_vocab_size if config.reduced_draft_vocab else config.vocab_size
        self.head = nn.ModuleList([nn.Linear(width, draft_vocab, bias=False) for _ in range(count)])
        # The base ids the heads score; None (no checkpoint key) when they score the whole vocabulary.
        self.register_buffer("draft_vocab", torch.arange(draft_vocab) if config.reduced_draft_vocab else None)

    def add_input_norm(self, config, hidden_size: int) -> None:
        # `ln0` has no parameters, hence no checkpoint keys.
        self.ln0 = MLPSpeculatorLayerNorm(hidden_size, elementwise_affine=False) if config.scale_input else None

    def scaled_input(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The verifier's hidden states as head 0 reads them: RMS-normalised, over sqrt(2), if `scale_input`."""
        if self.ln0 is not None:
            hidden_states = self.ln0(hidden_states) / math.sqrt(2)
        return hidden_states

    def input_state(self, hidden_states: torch.Tensor):
        """Turns the verifier's hidden states into head 0's input state."""
        raise NotImplementedError

    def draft_step(self, head: int, state, input_ids: torch.LongTensor) -> tuple[object, torch.Tensor]:
        """Runs head `head` on `state` and the previous token(s); returns the next state and the head's logits over
        the draft vocabulary."""
        raise NotImplementedError

    def step(self, head: int, state, input_ids: torch.LongTensor) -> tuple[object, torch.Tensor]:
        """
        `draft_step` with logits over the whole vocabulary, as drafting needs them. Tokens outside the draft vocabulary
        get the dtype's minimum: no argmax picks them and softmax gives them exactly zero mass, so a sampled draft's
        distribution is the one it was drawn from, while arithmetic on them (temperature, penalties) stays finite.
        """
        state, logits = self.draft_step(head, state, input_ids)
        if self.draft_vocab is None:
            return state, logits
        full = logits.new_full((*logits.shape[:-1], self.vocab_size), torch.finfo(logits.dtype).min)
        return state, full.index_copy_(-1, self.draft_vocab, logits)

    def forward(self, hidden_states: torch.Tensor, input_ids: torch.LongTensor) -> torch.Tensor:
        """Teacher-forced logits over the draft vocabulary, `[n_predict, batch, positions, draft vocab]`."""
        num_positions = hidden_states.shape[1]
        state = self.input_state(hidden_states)
        logits = []
        for i in range(self.n_predict):
            state, head_logits = self.draft_step(i, state, input_ids[:, i : i + num_positions])
            logits.append(head_logits)
        return torch.stack(logits, dim=0)

    def draft_labels(self, labels: torch.LongTensor) -> torch.LongTensor:
        """Base-id `labels` as indices into the draft vocabulary; tokens outside it (and -100) become -100."""
        if self.draft_vocab is None:
            return labels
        index = torch.full((self.vocab_size,), -100, dtype=torch.long, device=labels.device)
        index[self.draft_vocab] = torch.arange(len(self.draft_vocab), device=labels.device)
        return torch.where(labels >= 0, index[labels.clamp(min=0)], labels)

    def tied_weights(self) -> dict[str, str]:
        """The parameters that a tied checkpoint leaves out, each mapped to the one it repeats."""
        raise NotImplementedError
