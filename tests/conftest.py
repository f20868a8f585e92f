"""Tiny random verifiers and speculators, and an oracle speculator whose drafts are right only from the right state."""

import contextlib

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

from hf_mlp_speculator import FixedDepth, MLPSpeculatorConfig, MLPSpeculatorPreTrainedModel, SpeculationState
from hf_mlp_speculator.generation import mixin

VOCAB = 96
HIDDEN = 64
# What a torchrun worker prints when gloo aborts it at interpreter exit, after its work (torch 2.13 and 2.14, under
# load): tests of launched runs accept it only where the run's output is complete.
GLOO_EXIT_ABORT = "terminate called without an active exception"

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
    verifier = ARCHITECTURES[arch]().eval()
    # Random speculators are never confident: transformers' default threshold (0.4) would stop every chain after its
    # first draft, and the tests would no longer exercise longer chains. Tests of the threshold set it themselves.
    verifier.generation_config.assistant_confidence_threshold = 0.0
    return verifier


def make_speculator(n_predict=3, tie_weights=False, scale_input=False, inner_dim=48, seed=1, **kwargs):
    torch.manual_seed(seed)
    kwargs.setdefault("vocab_size", VOCAB)
    config = MLPSpeculatorConfig(emb_dim=HIDDEN, inner_dim=inner_dim, n_predict=n_predict,
                                 top_k_tokens_per_head=[2] * n_predict, tie_weights=tie_weights,
                                 scale_input=scale_input, **kwargs)  # fmt: skip
    return MLPSpeculatorPreTrainedModel(config).eval()


def make_prompt(length=12, seed=2):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (1, length), generator=generator)


class OracleHeads(nn.Module):
    """
    Stands in for `MLPSpeculator`: it looks the hidden state it is given up among the verifier's hidden states of known
    greedy continuations (one per batch row), and drafts that continuation from the (row, position) it finds. Given
    the hidden state of the wrong position, it drafts the continuation of the wrong position: its drafts are right
    only from the right state. Drafts for which `wrong(row, position, head)` holds are deliberately off by one token,
    with the right token a close second (so a tree that keeps two tokens per head still finds it).
    """

    def __init__(
        self, sequences: torch.LongTensor, hidden_states: torch.Tensor, wrong=lambda row, position, head: False
    ):
        super().__init__()
        self.sequences, self.hidden_states, self.wrong = sequences, hidden_states, wrong
        self.visits = []  # (row, position) of every state handed to the heads, in order
        self.anchor = nn.Parameter(torch.zeros(1))  # gives the model a device and dtype, as real heads would

    @property
    def positions_seen(self):
        return [position for _, position in self.visits]

    def input_state(self, hidden):
        flat = (self.hidden_states.flatten(0, 1) - hidden.float().reshape(-1, 1, hidden.shape[-1])).norm(dim=-1)
        index = flat.argmin(dim=-1).reshape(hidden.shape[:-1])
        width = self.sequences.shape[1]
        self.visits += [(i // width, i % width) for i in index.flatten().tolist()]
        return index

    def step(self, head, index, token):
        width = self.sequences.shape[1]
        logits = torch.full((*index.shape, VOCAB), -10.0)
        for flat, i in enumerate(index.flatten().tolist()):
            row, position = i // width, i % width
            target = position + 2 + head
            draft = self.sequences[row, target].item() if target < width else 0
            cell = logits.view(-1, VOCAB)[flat]
            if self.wrong(row, position, head):
                cell[draft] = 9.0
                draft = (draft + 1) % VOCAB
            cell[draft] = 10.0
        return index, logits


def make_oracle(verifier, prompt, num_tokens, n_predict=3, wrong=None, attention_mask=None):
    """
    An MLPSpeculator whose heads are an `OracleHeads` over `verifier`'s greedy continuation of `prompt`. For a batch,
    pass its `attention_mask`, and `wrong` takes `(row, position, head)`.
    """
    sequences = verifier.generate(prompt, attention_mask=attention_mask, max_new_tokens=num_tokens + n_predict + 2,
                                  do_sample=False)  # fmt: skip
    mask = torch.ones_like(sequences) if attention_mask is None else attention_mask
    mask = torch.cat([mask, mask.new_ones(len(mask), sequences.shape[1] - mask.shape[1])], dim=1)
    with torch.no_grad():
        hidden = verifier(sequences, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                          output_hidden_states=True).hidden_states[-1].float()  # fmt: skip
    hidden = hidden.masked_fill(~mask.bool()[..., None], float("inf"))  # padding is never a drafting state
    oracle = make_speculator(n_predict=n_predict)
    if wrong is None:
        row_wrong = lambda row, position, head: False  # noqa: E731
    elif attention_mask is None:
        row_wrong = lambda row, position, head: wrong(position, head)  # noqa: E731
    else:
        row_wrong = wrong
    oracle.speculator = OracleHeads(sequences, hidden, row_wrong)
    return oracle


def expected_steps(prompt_length, max_new_tokens, n_heads, wrong):
    """The rounds as [(position, drafted, accepted)], when drafts from position p are wrong where wrong(p, head)."""
    max_length = prompt_length + max_new_tokens
    length = prompt_length + 1  # the prefill emits one token
    steps = []
    while length < max_length:
        position = length - 2  # the hidden state that emitted the last token
        drafted = min(n_heads, max_length - length - 1)
        accepted = next((head for head in range(drafted) if wrong(position, head)), drafted)
        steps.append((position, drafted, accepted))
        length += accepted + 1
    return steps


def pytest_configure(config):
    config.addinivalue_line("markers", "cost_aware: the controller chooses depths from its measurements")


@pytest.fixture(autouse=True)
def every_head_drafts(request, monkeypatch):
    """
    Outside tests marked `cost_aware`, every step drafts all the heads the call allows (then the confidence threshold
    and the length limit apply: the `FixedDepth()` policy of every pair), so that what the decoding machinery does is
    known exactly; the controller would choose depths from wall-clock timings. Nor do they choose the CPU weights (the
    check that packed ones agree with the plain ones is forwards that tests counting forwards would see). Both
    are tested in test_cost_aware.py and test_weight_layouts.py.
    """
    if request.node.get_closest_marker("cost_aware") is None:
        monkeypatch.setattr(SpeculationState, "policy", FixedDepth())
        monkeypatch.setattr(mixin, "adaptive_weights", contextlib.nullcontext)


@pytest.fixture
def verifier():
    return make_verifier()
