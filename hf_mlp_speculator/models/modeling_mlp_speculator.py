"""The MLPSpeculator (IBM, fms-extras): a multi-head MLP that drafts tokens from a verifier's last hidden state.

Head `i` takes the previous head's state (head 0 takes the verifier's post-final-norm hidden state `h`) and the last
token, and predicts one more token:

    s = rms_norm(h) / sqrt(2)  if scale_input  else h
    s = gelu(ln_i(proj_i(s) + alpha * emb_i(token_i)));   logits_i = head_i(s)

Parameter names match the published checkpoints (`speculator.emb.{i}.weight`, ...), which vLLM and TGI read as well.
A speculator with a reduced draft vocabulary (`config.draft_vocab_size`) adds one tensor, `speculator.draft_vocab`: the
base ids its heads score.
"""

import math
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.utils import ModelOutput, logging

from .configuration_mlp_speculator import MLPSpeculatorConfig

logger = logging.get_logger(__name__)


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


class MLPSpeculator(nn.Module):
    """The heads themselves; stored under the `speculator.` prefix of the published checkpoints."""

    def __init__(self, config: MLPSpeculatorConfig):
        super().__init__()
        n, emb_dim, inner_dim, vocab = config.n_predict, config.emb_dim, config.speculator_inner_dim, config.vocab_size
        self.n_predict = n
        self.vocab_size = vocab
        self.scale_input = config.scale_input
        # With `tie_weights`, MLPSpeculatorPreTrainedModel ties heads 1.. to head 0 (and proj 2.. to proj 1).
        self.emb = nn.ModuleList([nn.Embedding(vocab, inner_dim) for _ in range(n)])
        self.proj = nn.ModuleList(
            [nn.Linear(emb_dim if i == 0 else inner_dim, inner_dim, bias=False) for i in range(n)]
        )
        # Any token may be the last emitted one, so the embeddings always cover the whole vocabulary; only the heads'
        # output layers shrink to the draft vocabulary.
        draft_vocab = config.draft_vocab_size if config.reduced_draft_vocab else vocab
        self.head = nn.ModuleList([nn.Linear(inner_dim, draft_vocab, bias=False) for _ in range(n)])
        # The base ids the heads score; None (no checkpoint key) when they score the whole vocabulary.
        self.register_buffer("draft_vocab", torch.arange(draft_vocab) if config.reduced_draft_vocab else None)
        self.ln = nn.ModuleList([MLPSpeculatorLayerNorm(inner_dim) for _ in range(n)])
        # `ln0` has no parameters, hence no checkpoint keys.
        self.ln0 = MLPSpeculatorLayerNorm(emb_dim, elementwise_affine=False) if config.scale_input else None
        self.activation = nn.GELU()

        # The scaling depends on the TRAINED head count: drafting with fewer heads must not change it.
        state_weight = 0.5 ** (0.5 / n)
        emb_weight = math.sqrt((1 - state_weight**2) * (inner_dim / 2))
        self.emb_scale = emb_weight / state_weight

    def input_state(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Turns the verifier's hidden states into head 0's input state."""
        if self.ln0 is not None:
            hidden_states = self.ln0(hidden_states) / math.sqrt(2)
        return hidden_states

    def draft_step(
        self, head: int, state: torch.Tensor, input_ids: torch.LongTensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Runs head `head` on `state` and the previous token(s); returns the next state and the head's logits over
        the draft vocabulary."""
        state = torch.add(self.proj[head](state), self.emb[head](input_ids), alpha=self.emb_scale)
        state = self.activation(self.ln[head](state))
        return state, self.head[head](state)

    def step(self, head: int, state: torch.Tensor, input_ids: torch.LongTensor) -> tuple[torch.Tensor, torch.Tensor]:
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


@dataclass
class MLPSpeculatorOutput(ModelOutput):
    """
    Args:
        logits (`torch.FloatTensor` of shape `(n_predict, batch_size, sequence_length, draft_vocab_size)`):
            Head `i`'s logits at position `t` predict the token `i + 2` after `t` (`i + 1` after the token the verifier
            emitted from position `t`). With a reduced draft vocabulary, entry `j` scores the base token
            `speculator.draft_vocab[j]`; otherwise `draft_vocab_size` is `vocab_size`.
        loss (`torch.FloatTensor`, *optional*):
            Sum over heads of the mean cross-entropy, when `labels` are given.
        head_losses (`torch.FloatTensor` of shape `(n_predict,)`, *optional*):
            Each head's mean cross-entropy, when `labels` are given.
    """

    loss: torch.FloatTensor | None = None
    logits: torch.FloatTensor | None = None
    head_losses: torch.FloatTensor | None = None


class MLPSpeculatorPreTrainedModel(PreTrainedModel):
    """
    An MLPSpeculator loadable with `AutoModel.from_pretrained` from the published `ibm-fms/*-accelerator` checkpoints,
    and usable as `assistant_model` in `generate()` once `hf_mlp_speculator` is imported.

    Loading is strict: a checkpoint with a missing or unexpected key raises an error naming the key, because a
    speculator with a randomly initialised head silently drafts garbage.
    """

    config_class = MLPSpeculatorConfig
    base_model_prefix = "mlp_speculator"
    main_input_name = "hidden_states"
    _no_split_modules = ["MLPSpeculator"]

    def __init__(self, config: MLPSpeculatorConfig):
        super().__init__(config)
        self.speculator = MLPSpeculator(config)
        # Tied checkpoints store only emb.0, proj.0, proj.1, head.0 and ln.0; transformers ties the rest to them when
        # loading and leaves them out when saving. (Read only when `config.tie_word_embeddings`, i.e. `tie_weights`.)
        self._tied_weights_keys = {
            f"speculator.{name}.{i}.{param}": f"speculator.{name}.{int(name == 'proj')}.{param}"
            for name, params in (
                ("emb", ["weight"]),
                ("head", ["weight"]),
                ("ln", ["weight", "bias"]),
                ("proj", ["weight"]),
            )
            for param in params
            for i in range(1 + (name == "proj"), config.n_predict)
        }
        # Left here by each `generate(assistant_model=self)` call: its `SpeculationMetrics`, and one per batch row.
        self.speculation_metrics = None
        self.speculation_metrics_per_row = None
        self.post_init()

    @torch.no_grad()
    def _init_weights(self, module):
        std = 1 / math.sqrt(self.config.speculator_inner_dim)
        if isinstance(module, (nn.Linear, nn.Embedding)):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, MLPSpeculatorLayerNorm) and module.weight is not None:
            init.ones_(module.weight)
            init.zeros_(module.bias)

    def forward(
        self,
        hidden_states: torch.Tensor,
        input_ids: torch.LongTensor,
        labels: torch.LongTensor | None = None,
        **kwargs,
    ) -> MLPSpeculatorOutput:
        r"""
        Teacher-forced forward over all positions at once, as in training.

        Args:
            hidden_states (`torch.Tensor` of shape `(batch_size, sequence_length, emb_dim)`):
                The verifier's post-final-norm hidden states.
            input_ids (`torch.LongTensor` of shape `(batch_size, sequence_length + n_predict)`):
                `input_ids[:, t]` is the token the verifier emitted from position `t`; head `i` reads
                `input_ids[:, i : i + sequence_length]`.
            labels (`torch.LongTensor` of shape `(n_predict, batch_size, sequence_length)`, *optional*):
                Targets of each head, as base token ids; `-100` is ignored, and so are tokens outside a reduced draft
                vocabulary.
        """
        expected = hidden_states.shape[1] + self.config.n_predict
        if input_ids.shape[1] != expected:
            raise ValueError(
                f"input_ids must hold sequence_length + n_predict = {expected} tokens per row (one more per head), "
                f"got {input_ids.shape[1]}."
            )
        logits = self.speculator(hidden_states, input_ids)
        loss = head_losses = None
        if labels is not None:
            labels = self.speculator.draft_labels(labels)
            head_losses = torch.stack(
                [nn.functional.cross_entropy(x.flatten(0, 1).float(), y.flatten()) for x, y in zip(logits, labels)]
            )
            loss = head_losses.sum()
        return MLPSpeculatorOutput(loss=loss, logits=logits, head_losses=head_losses)

    @torch.no_grad()
    def resize_vocab(self, vocab_size: int) -> None:
        """
        Pads the vocabulary to `vocab_size`, for a verifier whose embedding matrix is padded past its tokenizer. The
        new ids get zero embeddings and are never drafted: they stay outside the draft vocabulary (a speculator
        without one gets its old vocabulary as draft vocabulary, saved with it). Tied weights stay tied.
        """
        config, heads = self.config, self.speculator
        if vocab_size < config.vocab_size:
            raise ValueError(f"resize_vocab only pads: {vocab_size} < vocab_size {config.vocab_size}.")
        if heads.draft_vocab is None:
            heads.register_buffer("draft_vocab", torch.arange(config.vocab_size, device=heads.head[0].weight.device))
            config.draft_vocab_size = config.vocab_size
        padded = {}  # one new parameter per old one, so that embeddings sharing a weight (tie_weights) still share it
        for module in heads.emb:
            weight = module.weight
            if id(weight) not in padded:
                new = weight.new_zeros(vocab_size, weight.shape[1])
                new[: weight.shape[0]] = weight
                padded[id(weight)] = nn.Parameter(new, requires_grad=weight.requires_grad)
            module.weight, module.num_embeddings = padded[id(weight)], vocab_size
        config.vocab_size = heads.vocab_size = vocab_size

    @torch.no_grad()
    def expand_draft_vocab(self) -> "MLPSpeculatorPreTrainedModel":
        """
        A copy of a reduced-vocabulary speculator that scores the whole vocabulary, to save in the published layout,
        the only one vLLM and TGI read (they know no `speculator.draft_vocab`). The draft vocabulary's head rows are
        copied; the others are zero, so those tokens get logit 0 where this model gives them no probability at all:
        they are drafted only when every draft-vocabulary logit is negative (and then rejected, or accepted when
        right). Use this copy for those servers only; the reduced model is cheaper and drafts at least as well.
        """
        if self.speculator.draft_vocab is None:
            raise ValueError("This speculator already scores the whole vocabulary (draft_vocab_size=0).")
        config = self.config.__class__(**{**self.config.to_dict(), "draft_vocab_size": 0})
        full = type(self)(config).to(device=self.device, dtype=self.dtype)
        state = {k: v for k, v in self.state_dict().items() if k != "speculator.draft_vocab"}
        for name, weight in list(state.items()):
            if name.startswith("speculator.head."):
                state[name] = weight.new_zeros(config.vocab_size, weight.shape[1]).index_copy_(
                    0, self.speculator.draft_vocab, weight
                )
        full.load_state_dict(state)
        return full.train(self.training)

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        # transformers only warns about missing or unexpected keys and fills the gaps at random; a speculator loaded
        # that way would quietly never be accepted, so every mismatch is an error naming its keys. Wrongly shaped keys
        # are let through transformers (which would name none) only to be reported here.
        output_loading_info = kwargs.pop("output_loading_info", False)
        ignore_mismatched_sizes = kwargs.pop("ignore_mismatched_sizes", False)
        model, info = super().from_pretrained(*args, output_loading_info=True, ignore_mismatched_sizes=True, **kwargs)
        problems = []
        if "speculator.draft_vocab" in info["missing_keys"]:
            raise ValueError(
                f"config.json sets draft_vocab_size={model.config.draft_vocab_size}, but the checkpoint has no "
                "`speculator.draft_vocab` tensor, the base ids its heads score. Re-save the speculator with "
                "hf_mlp_speculator, which writes it, or set draft_vocab_size to 0 if its heads score the whole "
                "vocabulary."
            )
        if info["missing_keys"]:
            problems.append(f"missing key(s) {sorted(info['missing_keys'])}")
        if info["unexpected_keys"]:
            problems.append(f"unexpected key(s) {sorted(info['unexpected_keys'])}")
        if info["mismatched_keys"] and not ignore_mismatched_sizes:
            shapes = ", ".join(
                f"{key} {list(ckpt)} (expected {list(ours)})" for key, ckpt, ours in info["mismatched_keys"]
            )
            problems.append(f"wrongly shaped key(s) {shapes}")
        untied = [
            t for t, src in model._tied_weights_keys.items() if model.get_parameter(t) is not model.get_parameter(src)
        ]
        if model.config.tie_weights and untied:
            problems.append(f"key(s) {sorted(untied)} hold weights of their own although tie_weights=True")
        draft_vocab = model.speculator.draft_vocab
        if draft_vocab is not None and not (
            draft_vocab.unique().numel() == draft_vocab.numel() and 0 <= int(draft_vocab.min())
            and int(draft_vocab.max()) < model.config.vocab_size
        ):  # fmt: skip
            problems.append(f"speculator.draft_vocab must hold distinct ids below vocab_size {model.config.vocab_size}")
        if problems:
            c = model.config
            raise ValueError(
                f"The checkpoint does not match its MLPSpeculatorConfig (n_predict={c.n_predict}, "
                f"tie_weights={c.tie_weights}, emb_dim={c.emb_dim}, inner_dim={c.inner_dim}, "
                f"vocab_size={c.vocab_size}): {'; '.join(problems)}. Fix config.json so that it describes the "
                "weights, or re-save the speculator."
            )
        return (model, info) if output_loading_info else model


__all__ = ["MLPSpeculatorPreTrainedModel", "MLPSpeculatorOutput"]
