"""The Hub model card of a trained speculator: what it drafts for, how it was trained, how well it drafts, how to use it."""

import os
from pathlib import Path

from huggingface_hub import ModelCard, ModelCardData


def _last_eval(log_history: list) -> dict:
    return next((entry for entry in reversed(log_history) if "eval/tokens_per_step" in entry), {})


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
    rows = "\n".join(
        f"| {i} | {evaluation[f'eval/head_{i}_acc']:.3f} | {evaluation[f'eval/head_{i}_acceptance']:.3f} |"
        for i in range(config.n_predict)
        if f"eval/head_{i}_acc" in evaluation
    )
    settings = "\n".join(
        f"| `{name}` | `{getattr(args, name)}` |"
        for name in (
            "n_predict", "inner_dim", "tie_weights", "scale_input", "draft_vocab_size", "init_from_base", "loss",
            "head_loss_decay", "epochs", "max_train_minutes", "batch_size", "gradient_accumulation_steps",
            "learning_rate", "warmup_steps", "weight_decay", "max_grad_norm", "prompt_length", "num_prompts",
            "synthesize_prompts", "new_tokens", "temperature", "sampling_top_k", "text_tokens", "seq_length",
            "distill_top_k", "dtype", "seed",
        )
    )  # fmt: skip
    body = f"""
# MLPSpeculator for `{args.base_model}`

An [MLPSpeculator](https://arxiv.org/abs/2404.19124) with {config.n_predict} heads that drafts tokens for
`{args.base_model}` from its last hidden state, trained with `hf-mlp-speculator train`: distilled from the base model's own
continuations of prompts (its hidden states and next-token distributions). Weights use the published `ibm-fms` layout,
which vLLM and TGI read as well{" (plus `speculator.draft_vocab`, the base ids of its reduced draft vocabulary)" if config.reduced_draft_vocab else ""}.

## Usage

```python
import hf_mlp_speculator  # registers mlp_speculator with AutoModel and lets generate() draft with it
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained("{args.tokenizer or args.base_model}")
model = AutoModelForCausalLM.from_pretrained("{args.base_model}")
speculator = AutoModel.from_pretrained("{speculator}")

inputs = tokenizer("The quick brown fox", return_tensors="pt")
output = model.generate(**inputs, assistant_model=speculator, max_new_tokens=64)
print(tokenizer.decode(output[0], skip_special_tokens=True))
print(speculator.speculation_metrics)
```

## Held-out acceptance

Measured along the base model's greedy continuations of {args.eval_prompts} held-out prompts: top-1 accuracy of
each head, and acceptance (heads 0..i all right, so head i's draft is accepted).

| head | top-1 accuracy | acceptance |
|---|---|---|
{rows}

Expected tokens per verifier step: **{evaluation.get("eval/tokens_per_step", float("nan")):.3f}**
(held-out loss {evaluation.get("eval/loss", float("nan")):.3f}, after step {evaluation.get("step", 0)}).

## Training settings

| setting | value |
|---|---|
{settings}
| prompts | {", ".join(f"`{d}`" for d in args.prompts) if args.prompts else "the openings of the data's documents"} |
| text (teacher-forced) | {", ".join(f"`{d}`" for d in args.data) if args.data else "none"} |
"""
    return ModelCard(f"---\n{data.to_yaml()}\n---\n{body}")


__all__ = ["make_model_card"]
