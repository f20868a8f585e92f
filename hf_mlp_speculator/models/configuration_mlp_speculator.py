"""Configuration of the MLPSpeculator family, field for field as published: IBM's `ibm-fms/*-accelerator` checkpoints,
and Snowflake's Arctic MLP and LSTM speculators (ArcticTraining), which share the model type."""

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig


class _VerifiersToken:
    """
    The special token ids of a speculator, which drafts in its verifier's vocabulary and has none of its own: equal to
    any id. transformers' pipeline compares an assistant's bos/eos/pad ids with the model's to decide whether the two
    share a tokenizer.
    """

    def __eq__(self, other):
        return True

    __hash__ = object.__hash__

    def __repr__(self):
        return "<the verifier's>"


@strict
class MLPSpeculatorConfig(PreTrainedConfig):
    r"""
    Configuration of an [`MLPSpeculatorPreTrainedModel`]: a small multi-head MLP that drafts `n_predict` tokens from
    the verifier's last hidden state, each head conditioned on the previous head's state and token.

    Args:
        vocab_size (`int`, *optional*, defaults to 32000):
            Vocabulary size. Must equal the verifier's `vocab_size`.
        emb_dim (`int`, *optional*, defaults to 4096):
            Size of the verifier's hidden state (alias: `hidden_size`). Must equal the verifier's `hidden_size`.
        inner_dim (`int`, *optional*, defaults to 0):
            Width of the speculator's state. `0` means `emb_dim`.
        n_predict (`int`, *optional*, defaults to 3):
            Number of heads the speculator was trained with; head `i` predicts the token `i + 1` ahead. Drafting can
            use fewer heads at run time, but the state scaling always follows the trained count.
        top_k_tokens_per_head (`list[int]`, *optional*):
            Branching factor of each head when drafting a candidate tree. One entry per head. Defaults to the first
            `n_predict` entries of `[5, 4, 3, 2, 2, ...]`.
        n_candidates (`int`, *optional*, defaults to 5):
            Number of candidate suffixes drawn from the tree.
        tie_weights (`bool`, *optional*, defaults to `False`):
            Share `emb`, `head` and `ln` across heads and `proj` across heads 1.. (needs `n_predict > 1`).
        scale_input (`bool`, *optional*, defaults to `False`):
            RMS-normalise the verifier's hidden state (and divide by sqrt(2)) before the first head.
        draft_vocab_size (`int`, *optional*, defaults to 0):
            Number of tokens the heads score. `0` (as in every published checkpoint) means all `vocab_size` tokens. A
            smaller value makes each head's output layer that much cheaper: the heads then score only the tokens
            whose base ids the checkpoint lists in `speculator.draft_vocab`, and drafts map back to base ids. The
            verifier still scores the whole vocabulary, so decoding stays lossless.
        base_model_name_or_path (`str`, *optional*):
            The verifier this speculator was trained for.
        method (`str`, *optional*):
            `None` for the MLP heads above; `"sum_lstm"` for Arctic's LSTM heads (see `ArcticLSTMSpeculator`), whose
            `emb_dim` is the width of their token embedding and whose verifier hidden size is `input_hidden_dim`.
        input_hidden_dim (`int`, *optional*):
            The verifier's hidden size, for LSTM heads.
        proj_dim (`int`, *optional*, defaults to 0):
            Width of an LSTM's gate projections. `0` means `inner_dim`.
        tie_lstm_embs (`bool`, *optional*):
            Whether an LSTM's four gates share one token embedding; the only layout that runs here.

    `from_pretrained` also reads configs as ArcticTraining writes them: dims as strings (`"4096"`), `architectures` as
    a string, and `top_k_tokesns_per_head` (sic).

    ```python
    >>> from hf_mlp_speculator import MLPSpeculatorConfig, MLPSpeculatorPreTrainedModel
    >>> config = MLPSpeculatorConfig(vocab_size=32000, emb_dim=768, inner_dim=1024, n_predict=3,
    ...                              top_k_tokens_per_head=[5, 3, 2])
    >>> model = MLPSpeculatorPreTrainedModel(config)
    ```"""

    model_type = "mlp_speculator"
    attribute_map = {"hidden_size": "emb_dim", "tie_word_embeddings": "tie_weights"}
    # Class attributes, not fields: never saved, and a config that names its own ids still sets them.
    bos_token_id = eos_token_id = pad_token_id = _VerifiersToken()

    vocab_size: int = 32000
    emb_dim: int = 4096
    inner_dim: int = 0
    n_predict: int = 3
    top_k_tokens_per_head: list[int] | None = None
    n_candidates: int = 5
    tie_weights: bool = False
    scale_input: bool = False
    draft_vocab_size: int = 0
    base_model_name_or_path: str | None = None
    method: str | None = None
    input_hidden_dim: int | None = None
    proj_dim: int = 0
    tie_lstm_embs: bool | None = None

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        return super().from_dict(_as_written_by_arctic_training(config_dict), **kwargs)

    def __post_init__(self, **kwargs):
        if self.top_k_tokens_per_head is None:
            self.top_k_tokens_per_head = ([5, 4, 3] + [2] * self.n_predict)[: self.n_predict]
        super().__post_init__(**kwargs)

    def validate_architecture(self):
        """Part of `@strict`-powered validation: every problem names the field and the fix."""
        if self.method is not None or self.input_hidden_dim is not None:
            self._validate_lstm()
        for name in ("vocab_size", "emb_dim", "n_candidates"):
            if getattr(self, name) <= 0:
                raise ValueError(f"MLPSpeculatorConfig.{name} must be positive, got {getattr(self, name)}.")
        if self.inner_dim < 0:
            raise ValueError(f"MLPSpeculatorConfig.inner_dim must be >= 0 (0 means emb_dim), got {self.inner_dim}.")
        if self.n_predict < 1:
            raise ValueError(f"MLPSpeculatorConfig.n_predict must be >= 1, got {self.n_predict}.")
        if len(self.top_k_tokens_per_head) != self.n_predict:
            raise ValueError(
                f"MLPSpeculatorConfig.top_k_tokens_per_head has {len(self.top_k_tokens_per_head)} entries but "
                f"n_predict is {self.n_predict}: give one branching factor per head."
            )
        if any(k < 1 for k in self.top_k_tokens_per_head):
            raise ValueError(
                "MLPSpeculatorConfig.top_k_tokens_per_head must hold positive values, "
                f"got {self.top_k_tokens_per_head}."
            )
        if not 0 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"MLPSpeculatorConfig.draft_vocab_size is {self.draft_vocab_size}, but the draft vocabulary is a subset of "
                f"the vocabulary of {self.vocab_size} tokens: set at most {self.vocab_size}, or 0 to score the whole "
                "vocabulary."
            )
        if self.tie_weights and self.n_predict < 2:
            raise ValueError(
                "MLPSpeculatorConfig.tie_weights=True needs n_predict > 1 (there is nothing to tie with one head); "
                "set tie_weights=False."
            )

    def _validate_lstm(self):
        if self.method != "sum_lstm":
            variant = "ArcticTraining's default RNN speculator" if self.method in (None, "sum_rnn") else "unknown"
            raise ValueError(
                f"MLPSpeculatorConfig.method={self.method!r} ({variant}) is not supported: only MLP speculators (no "
                "method) and Arctic LSTM speculators (method='sum_lstm') run here."
            )
        if not self.tie_weights or not self.tie_lstm_embs:
            raise ValueError(
                f"An Arctic LSTM speculator with tie_weights={self.tie_weights} and "
                f"tie_lstm_embs={self.tie_lstm_embs} is not supported: ArcticTraining and ArcticInference run sum_lstm"
                " only with one output layer and one token embedding shared by every head and gate (both true)."
            )
        if not self.input_hidden_dim or self.input_hidden_dim <= 0:
            raise ValueError(
                f"MLPSpeculatorConfig.input_hidden_dim is {self.input_hidden_dim}: an LSTM speculator needs its "
                "verifier's hidden size there."
            )
        widths = {"emb_dim": self.emb_dim, "inner_dim": self.speculator_inner_dim, "proj_dim": self.proj_dim or None}
        if len({w for w in widths.values() if w}) > 1:
            raise ValueError(
                f"An LSTM speculator adds its embedding, gate projections and cell of one width, but the config gives "
                f"{', '.join(f'{k}={v}' for k, v in widths.items() if v)}: make them equal."
            )

    def to_dict(self):
        # A full-vocabulary MLP speculator keeps exactly the published config.json fields, which vLLM and TGI read.
        output = super().to_dict()
        defaults = dict(draft_vocab_size=0, method=None, input_hidden_dim=None, proj_dim=0, tie_lstm_embs=None)
        for name, default in defaults.items():
            if output.get(name, default) == default:
                output.pop(name, None)
        return output

    @property
    def is_lstm(self) -> bool:
        """Whether the heads are Arctic's LSTM (`method="sum_lstm"`) rather than IBM's MLP."""
        return self.method == "sum_lstm"

    @property
    def verifier_hidden_size(self) -> int:
        """The hidden size of the verifier whose states head 0 reads."""
        return self.input_hidden_dim if self.is_lstm else self.emb_dim

    @property
    def speculator_inner_dim(self) -> int:
        """The width of the speculator's state, resolving the published `inner_dim=0` convention."""
        return self.inner_dim or self.emb_dim

    @property
    def reduced_draft_vocab(self) -> bool:
        """Whether the heads score only a subset of the vocabulary (listed in `speculator.draft_vocab`)."""
        return 0 < self.draft_vocab_size < self.vocab_size


def _as_written_by_arctic_training(config: dict) -> dict:
    """`config` with ArcticTraining's spellings made this class's: dims as strings, `architectures` as a string, and
    the misspelled `top_k_tokesns_per_head`."""
    config = dict(config)
    if isinstance(config.get("architectures"), str):
        config["architectures"] = [config["architectures"]]
    if "top_k_tokesns_per_head" in config:
        config.setdefault("top_k_tokens_per_head", config.pop("top_k_tokesns_per_head"))
    for name in ("emb_dim", "inner_dim", "proj_dim"):
        if isinstance(config.get(name), str):
            config[name] = _width(name, config[name])
    return config


def _width(name: str, value: str) -> int:
    # ArcticTraining writes widths as "4096", or "a.b" for a stack that only its sum_rnn speculators build.
    try:
        widths = {int(w) for w in value.split(".")}
    except ValueError:
        raise ValueError(f"MLPSpeculatorConfig.{name}={value!r} is not a width: write an integer such as 4096.")
    if len(widths) != 1:
        raise ValueError(
            f"MLPSpeculatorConfig.{name}={value!r} is a stack of widths, which only ArcticTraining's sum_rnn "
            "speculators use; the speculators that run here have one width."
        )
    return widths.pop()


__all__ = ["MLPSpeculatorConfig"]
