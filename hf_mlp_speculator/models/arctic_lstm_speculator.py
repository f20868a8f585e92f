"""Arctic's LSTM speculator (Snowflake, ArcticTraining's `sum_lstm`): MLPSpeculator heads with an LSTM cell.

Head `k` reads the state `h` and cell `c` that head `k - 1` left (head 0: the verifier's hidden state, scaled as the
MLP's when `scale_input`, and a zero cell) and the token before it, through projection `j = min(k, 1)`:

    z = alpha * E[token]
    f, i, o = sigmoid(P_f[j] h + z), sigmoid(P_i[j] h + z), sigmoid(P_o[j] h + z)
    c = f * c + i * gelu(cell_ln(P_c[j] h + z));   h = o * gelu(state_ln(c));   logits = head(h)

Every head shares one embedding `E`, one output layer and both layer norms (ArcticTraining refuses anything else).
Parameter names are ArcticTraining's (`forget_emb.0.weight`, `cell_proj.1.weight`, ...) under the `speculator.` prefix.
"""

import torch
from torch import nn

from .heads import MLPSpeculatorLayerNorm, SpeculatorHeads

GATES = ("forget", "input", "output", "cell")


class ArcticLSTMSpeculator(SpeculatorHeads):
    """The LSTM heads; a state is the pair `(h, c)`."""

    def __init__(self, config):
        width = config.speculator_inner_dim
        super().__init__(config, width)
        # One embedding under ArcticTraining's four names, one output layer under every head's name: the checkpoint
        # holds each once per name.
        self.forget_emb = nn.ModuleList([nn.Embedding(config.vocab_size, width)])
        self.input_emb = self.output_emb = self.cell_emb = self.forget_emb
        for gate in GATES:
            projections = [nn.Linear(config.input_hidden_dim, width, bias=False), nn.Linear(width, width, bias=False)]
            setattr(self, f"{gate}_proj", nn.ModuleList(projections))
        self.cell_ln = nn.ModuleList([MLPSpeculatorLayerNorm(width)])
        self.state_ln = nn.ModuleList([MLPSpeculatorLayerNorm(width)])
        self.add_output_layers(config, width, 1)
        self.head = nn.ModuleList([self.head[0]] * config.n_predict)
        self.add_input_norm(config, config.input_hidden_dim)
        self.width = width

    def input_state(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Head 0's state: the (scaled) verifier hidden states and a zero cell."""
        cell = hidden_states.new_zeros(*hidden_states.shape[:-1], self.width)
        return self.scaled_input(hidden_states), cell

    def draft_step(self, head: int, state, input_ids: torch.LongTensor):
        h, c = state
        j = min(head, 1)
        z = self.emb_scale * self.forget_emb[0](input_ids)
        forget, input, output = (torch.sigmoid(getattr(self, f"{g}_proj")[j](h) + z) for g in GATES[:3])
        candidate = self.activation(self.cell_ln[0](self.cell_proj[j](h) + z))
        c = forget * c + input * candidate
        h = output * self.activation(self.state_ln[0](c))
        return (h, c), self.head[head](h)

    def tied_weights(self) -> dict[str, str]:
        tied = {f"{gate}_emb.0.weight": "forget_emb.0.weight" for gate in GATES[1:]}
        tied.update({f"head.{i}.weight": "head.0.weight" for i in range(1, self.n_predict)})
        return tied
