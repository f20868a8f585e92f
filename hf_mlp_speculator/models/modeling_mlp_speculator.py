"""The MLPSpeculator (IBM, fms-extras): a multi-head MLP that drafts tokens from a verifier's last hidden state.

Head `i` takes the previous head's state (head 0 takes the verifier's post-final-norm hidden state `h`) and the last
token, and predicts one more token:

    s = rms_norm(h) / sqrt(2)  if scale_input  else h
    s = gelu(ln_i(proj_i(s) + alpha * emb_i(token_i)));   logits_i = head_i(s)

Parameter names match the published checkpoints (`speculator.emb.{i}.weight`, ...), which vLLM and TGI read as well.
A speculator with a reduced draft vocabulary (`config.draft_vocab_size`) adds one tensor, `speculator.draft_vocab`: the
base ids its heads score.

`MLPSpeculatorPreTrainedModel` holds these heads, or Arctic's LSTM heads (`arctic_lstm_speculator.py`) when the config
says `method="sum_lstm"`: one model type, as the published configs have it.
"""

import math
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.utils import ModelOutput, logging

from .arctic_lstm_speculator import ArcticLSTMSpeculator
from .configuration_mlp_speculator import MLPSpeculatorConfig
from .heads import MLPSpeculatorLayerNorm, SpeculatorHeads

logger = logging.get_logger(__name__)


class MLPSpeculator(SpeculatorHeads):
    """The MLP heads; stored under the `speculator.` prefix of the published checkpoints."""

    def __init__(self, config: MLPSpeculatorConfig):
        n, emb_dim, inner_dim = config.n_predict, config.emb_dim, config.speculator_inner_dim
        super().__init__(config, inner_dim)
        # With `tie_weights`, MLPSpeculatorPreTrainedModel ties heads 1.. to head 0 (and proj 2.. to proj 1).
        self.emb = nn.ModuleList([nn.Embedding(config.vocab_size, inner_dim) for _ in range(n)])
        self.proj = nn.ModuleList(
            [nn.Linear(emb_dim if i == 0 else inner_dim, inner_dim, bias=False) for i in range(n)]
        )
        self.add_output_layers(config, inner_dim, n)
        self.ln = nn.ModuleList([MLPSpeculatorLayerNorm(inner_dim) for _ in range(n)])
        self.add_input_norm(config, emb_dim)

    def input_state(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.scaled_input(hidden_states)

    def draft_step(
        self, head: int, state: torch.Tensor, input_ids: torch.LongTensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        state = torch.add(self.proj[head](state), self.emb[head](input_ids), alpha=self.emb_scale)
        state = self.activation(self.ln[head](state))
        return state, self.head[head](state)

    def tied_weights(self) -> dict[str, str]:
        # Tied checkpoints store only emb.0, proj.0, proj.1, head.0 and ln.0.
        return {
            f"{name}.{i}.{param}": f"{name}.{int(name == 'proj')}.{param}"
            for name, params in (("emb", ["weight"]), ("head", ["weight"]), ("ln", ["weight", "bias"]),
                                 ("proj", ["weight"]))
            for param in params
            for i in range(1 + (name == "proj"), self.n_predict)
        }


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
        self.speculator = ArcticLSTMSpeculator(config) if config.is_lstm else MLPSpeculator(config)
        # transformers ties these to their sources when loading and leaves them out when saving. (Read only when
        # `config.tie_word_embeddings`, i.e. `tie_weights`.)
        self._tied_weights_keys = {
            f"speculator.{key}": f"speculator.{source}" for key, source in self.speculator.tied_weights().items()
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
        for module in [m for m in heads.modules() if isinstance(m, nn.Embedding)]:
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
        # ArcticTraining saves the heads' own state dict, without the `speculator.` prefix.
        kwargs["key_mapping"] = {r"^(?!speculator\.)": "speculator.", **(kwargs.get("key_mapping") or {})}
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
                f"The checkpoint does not match its MLPSpeculatorConfig ({c.method or 'MLP'}, "
                f"n_predict={c.n_predict}, "
                f"tie_weights={c.tie_weights}, emb_dim={c.emb_dim}, inner_dim={c.inner_dim}, "
                f"vocab_size={c.vocab_size}): {'; '.join(problems)}. Fix config.json so that it describes the "
                "weights, or re-save the speculator."
            )
        return (model, info) if output_loading_info else model


__all__ = ["MLPSpeculatorPreTrainedModel", "MLPSpeculatorOutput"]
