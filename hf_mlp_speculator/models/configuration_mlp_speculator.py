"""Configuration of the MLPSpeculator, field for field as in the published `ibm-fms/*-accelerator` checkpoints."""

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

    def __post_init__(self, **kwargs):
        if self.top_k_tokens_per_head is None:
            self.top_k_tokens_per_head = ([5, 4, 3] + [2] * self.n_predict)[: self.n_predict]
        super().__post_init__(**kwargs)

    def validate_architecture(self):
        """Part of `@strict`-powered validation: every problem names the field and the fix."""
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

    def to_dict(self):
        # A full-vocabulary speculator keeps exactly the published config.json fields, which vLLM and TGI read.
        output = super().to_dict()
        if not output.get("draft_vocab_size"):
            output.pop("draft_vocab_size", None)
        return output

    @property
    def speculator_inner_dim(self) -> int:
        """The width of the speculator's state, resolving the published `inner_dim=0` convention."""
        return self.inner_dim or self.emb_dim

    @property
    def reduced_draft_vocab(self) -> bool:
        """Whether the heads score only a subset of the vocabulary (listed in `speculator.draft_vocab`)."""
        return 0 < self.draft_vocab_size < self.vocab_size


__all__ = ["MLPSpeculatorConfig"]
