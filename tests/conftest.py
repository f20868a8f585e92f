"""Tiny random verifiers and speculators, and an oracle speculator whose drafts are right only from the right state."""

import pytest
import torch
from torch import nn
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    GPTBigCodeConfig,
    GPTBigCodeForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from hf_mlp_speculator import MLPSpeculatorConfig, MLPSpeculatorPreTrainedModel

VOCAB = 96
HIDDEN = 64

_DECODER = dict(hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=4096, bos_token_id=0,
                eos_token_id=None, pad_token_id=0)  # fmt: skip
_GPT = dict(n_embd=HIDDEN, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=4096, bos_token_id=0,
            eos_token_id=None, pad_token_id=0)  # fmt: skip
ARCHITECTURES = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**_DECODER)),
    "mistral": lambda: MistralForCausalLM(MistralConfig(**_DECODER)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**_DECODER)),
    "granite": lambda: GraniteForCausalLM(
        GraniteConfig(**_DECODER, embedding_multiplier=2.0, logits_scaling=4.0, residual_multiplier=0.5)
    ),
    "gpt2": lambda: GPT2LMHeadModel(GPT2Config(**_GPT)),
    "gpt_bigcode": lambda: GPTBigCodeForCausalLM(GPTBigCodeConfig(**_GPT, multi_query=True)),
}


def make_verifier(arch: str = "llama", seed: int = 0):
    torch.manual_seed(seed)
    return ARCHITECTURES[arch]().eval()


def make_speculator(n_predict=3, tie_weights=False, scale_input=False, inner_dim=48, seed=1, **kwargs):
    torch.manual_seed(seed)
    config = MLPSpeculatorConfig(vocab_size=VOCAB, emb_dim=HIDDEN, inner_dim=inner_dim, n_predict=n_predict,
                                 top_k_tokens_per_head=[2] * n_predict, tie_weights=tie_weights,
                                 scale_input=scale_input, **kwargs)  # fmt: skip
    return MLPSpeculatorPreTrainedModel(config).eval()


def make_prompt(length=12, seed=2):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (1, length), generator=generator)


class OracleHeads(nn.Module):
    """
    Stands in for `MLPSpeculator`: it looks the hidden state it is given up among the verifier's hidden states of a
    known greedy continuation, and drafts that continuation from the position it finds. Given the hidden state of the
    wrong position, it drafts the continuation of the wrong position: its drafts are right only from the right state.
    Drafts for which `wrong(position, head)` holds are deliberately off by one token.
    """

    def __init__(self, sequence: torch.LongTensor, hidden_states: torch.Tensor, wrong=lambda position, head: False):
        super().__init__()
        self.sequence, self.hidden_states, self.wrong = sequence, hidden_states, wrong
        self.positions_seen = []
        self.anchor = nn.Parameter(torch.zeros(1))  # gives the model a device and dtype, as real heads would

    def input_state(self, hidden):
        position = (self.hidden_states - hidden.float()).norm(dim=-1).argmin().item()
        self.positions_seen.append(position)
        return position

    def step(self, head, position, token):
        target = position + 2 + head
        draft = self.sequence[target].item() if target < len(self.sequence) else 0
        if self.wrong(position, head):
            draft = (draft + 1) % VOCAB
        logits = torch.full((1, VOCAB), -10.0)
        logits[0, draft] = 10.0
        return position, logits


def make_oracle(verifier, prompt, num_tokens, n_predict=3, wrong=lambda position, head: False):
    """An MLPSpeculator whose heads are an `OracleHeads` over `verifier`'s greedy continuation of `prompt`."""
    sequence = verifier.generate(prompt, max_new_tokens=num_tokens + n_predict + 2, do_sample=False)
    with torch.no_grad():
        hidden = verifier(sequence, output_hidden_states=True).hidden_states[-1][0].float()
    oracle = make_speculator(n_predict=n_predict)
    oracle.speculator = OracleHeads(sequence[0], hidden, wrong)
    return oracle


@pytest.fixture
def verifier():
    return make_verifier()
