"""
The Hub model card of a trained speculator: what it drafts for, how it was trained, how well it drafts, how to use it.
"""

import os
from pathlib import Path

from huggingface_hub import ModelCard, ModelCardData

# The card's Markdown body, below its YAML metadata; `make_model_card` fills in the fields.
CARD_TEMPLATE = """
# {title} for `{base_model}`

{description} with {n_predict} heads that drafts tokens for
`{base_model}` from its last hidden state, trained with `hf-mlp-speculator train`: distilled from the base model's own
continuations of prompts (its hidden states and next-token distributions). {layout}{draft_vocab_note}.

## Usage

```python
import hf_mlp_speculator  # registers mlp_speculator with AutoModel and lets generate() draft with it
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained("{tokenizer}")
model = AutoModelForCausalLM.from_pretrained("{base_model}")
speculator = AutoModel.from_pretrained("{speculator}")

inputs = tokenizer("The quick brown fox", return_tensors="pt")
output = model.generate(**inputs, assistant_model=speculator, max_new_tokens=64)
print(tokenizer.decode(output[0], skip_special_tokens=True))
print(speculator.speculation_metrics)
```

## Held-out acceptance

Measured along the base model's greedy continuations of {eval_prompts} held-out prompts: top-1 accuracy of
each head, and acceptance (heads 0..i all right, so head i's draft is accepted).

| head | top-1 accuracy | acceptance |
|---|---|---|
{acceptance_rows}

Expected tokens per verifier step: **{tokens_per_step:.3f}**
(held-out loss {eval_loss:.3f}, after step {eval_step}).

## Training settings

| setting | value |
|---|---|
{settings}
| prompts | {prompts} |
| text (teacher-forced) | {text} |
"""

# Per architecture: the card's title, what the speculator is, and which engines read its weights.
ARCHITECTURE_NOTES = {
    False: ("MLPSpeculator", "An [MLPSpeculator](https://arxiv.org/abs/2404.19124)",
            "Weights use the published `ibm-fms` layout, which vLLM and TGI read as well; `hf-mlp-speculator export` "
            "writes it for ArcticInference"),
    True: ("Arctic LSTM speculator", "An [Arctic LSTM speculator](https://github.com/snowflakedb/ArcticTraining)",
           "For ArcticInference, `hf-mlp-speculator export --engine arctic` writes the layout ArcticTraining saves"),
}  # fmt: skip

# Vocabulary-sized speculators load anywhere the layout is read; a reduced one also needs its map back to base ids.
DRAFT_VOCAB_NOTE = " (plus `speculator.draft_vocab`, the base ids of its reduced draft vocabulary)"

# The arguments listed under "Training settings", in this order.
CARD_SETTINGS = (
    "architecture", "n_predict", "inner_dim", "tie_weights", "scale_input", "draft_vocab_size", "init_from_base",
    "loss", "head_loss_decay", "epochs", "max_train_minutes", "batch_size", "gradient_accumulation_steps",
    "learning_rate", "warmup_steps", "weight_decay", "max_grad_norm", "prompt_length", "num_prompts",
    "synthesize_prompts", "new_tokens", "temperature", "sampling_top_k", "text_tokens", "seq_length",
    "distill_top_k", "dtype", "seed",
)  # fmt: skip


def _last_eval(log_history: list) -> dict:
    return next((entry for entry in reversed(log_history) if "eval/tokens_per_step" in entry), {})


def _acceptance_rows(evaluation: dict, n_predict: int) -> str:
    """The held-out table's rows: each evaluated head's top-1 accuracy and acceptance."""
    return "\n".join(
        f"| {i} | {evaluation[f'eval/head_{i}_acc']:.3f} | {evaluation[f'eval/head_{i}_acceptance']:.3f} |"
        for i in range(n_predict)
        if f"eval/head_{i}_acc" in evaluation
    )


def _listed(sources: list[str] | None, none: str) -> str:
    """Data sources as a table cell: each one in code, or `none` when there are none."""
    return ", ".join(f"`{source}`" for source in sources) if sources else none


def make_model_card(args, config, log_history: list) -> ModelCard:
    """A `ModelCard` with the training settings, the held-out per-head acceptance and a working usage snippet."""
    # A local base model path means nothing on the Hub, and its metadata would fail the Hub's validation.
    base_on_hub = not os.path.exists(args.base_model)
    data = ModelCardData(
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=["mlp-speculator", "speculative-decoding", "hf-mlp-speculator"],
        base_model=args.base_model if base_on_hub else None,
    )
    speculator = args.hub_model_id if args.push_to_hub and args.hub_model_id else str(Path(args.output_dir).resolve())
    evaluation = _last_eval(log_history)
    title, description, layout = ARCHITECTURE_NOTES[config.is_lstm]
    body = CARD_TEMPLATE.format(
        title=title,
        description=description,
        layout=layout,
        base_model=args.base_model,
        n_predict=config.n_predict,
        draft_vocab_note=DRAFT_VOCAB_NOTE if config.reduced_draft_vocab else "",
        tokenizer=args.tokenizer or args.base_model,
        speculator=speculator,
        eval_prompts=args.eval_prompts,
        acceptance_rows=_acceptance_rows(evaluation, config.n_predict),
        tokens_per_step=evaluation.get("eval/tokens_per_step", float("nan")),
        eval_loss=evaluation.get("eval/loss", float("nan")),
        eval_step=evaluation.get("step", 0),
        settings="\n".join(f"| `{name}` | `{getattr(args, name)}` |" for name in CARD_SETTINGS),
        prompts=_listed(args.prompts, "the openings of the data's documents"),
        text=_listed(args.data, "none"),
    )
    return ModelCard(f"---\n{data.to_yaml()}\n---\n{body}")


__all__ = ["make_model_card"]
