"""The settings of a training run, each also a flag of `hf-mlp-speculator train` (dashes for underscores)."""

import argparse
import dataclasses
import math
import os
from dataclasses import dataclass, field

from .losses import LOSSES

DTYPES = ("float32", "bfloat16", "float16", "auto")
ARCHITECTURES = {"mlp": "IBM's MLPSpeculator", "lstm": "Arctic's LSTM speculator, sum_lstm"}


@dataclass
class SpeculatorTrainingArguments:
    """Everything a training run needs; `hf-mlp-speculator train --help` lists them with their defaults."""

    base_model: str = field(metadata={"help": "Path or Hub id of the frozen base model (any AutoModelForCausalLM)."})
    prompts: list[str] | None = field(
        default=None,
        metadata={
            "help": "Prompts the base model continues, one per document (e.g. chat turns rendered up to the answer): "
            ".txt/.jsonl/.parquet files, folders of them, or `datasets` names. What the speculator learns most from."
        },
    )
    data: list[str] | None = field(
        default=None,
        metadata={"help": "Text the heads are also teacher-forced on (stage 1); prompts come from it without --prompts."},
    )
    output_dir: str = field(default="speculator", metadata={"help": "Where checkpoints and the final speculator go."})
    tokenizer: str | None = field(default=None, metadata={"help": "Tokenizer path or id; defaults to base_model."})
    # The speculator.
    n_predict: int = field(default=3, metadata={"help": "Number of heads (tokens drafted per step)."})
    inner_dim: int = field(default=0, metadata={"help": "Width of the heads' state; 0 means the base hidden size."})
    architecture: str = field(
        default="mlp",
        metadata={"help": f"The heads: {', '.join(f'{k} ({v})' for k, v in ARCHITECTURES.items())}."},
    )
    tie_weights: bool | None = field(
        default=None,
        metadata={"help": "Share weights across heads (needs n_predict > 1); default: no for mlp, yes for lstm (which "
                  "is always tied)."},
    )  # fmt: skip
    scale_input: bool = field(default=False, metadata={"help": "RMS-normalise the base hidden state first."})
    top_k_tokens_per_head: list[int] | None = field(
        default=None, metadata={"help": "Tree branching per head stored in the config; default 5, 4, 3, 2, 2, ..."}
    )
    draft_vocab_size: int = field(
        default=0,
        metadata={"help": "Tokens the heads score: the most frequent in the base model's outputs; 0: all of them."},
    )
    init_from_base: bool = field(
        default=False,
        metadata={"help": "Start the heads' embeddings and output layers from the base model's (see initialization)."},
    )
    # What the base model computes once: its continuations of prompts, and teacher forcing on --data.
    text_field: str = field(default="text", metadata={"help": "Field of .jsonl/.parquet/datasets records with text."})
    prompt_length: int = field(default=256, metadata={"help": "Longest prompt in tokens; longer ones are skipped."})
    num_prompts: int = field(default=0, metadata={"help": "Prompts to continue; 0: every training prompt once."})
    synthesize_prompts: int = field(
        default=0,
        metadata={"help": "User turns the base model writes itself (Magpie), deduplicated, added to the prompts."},
    )
    new_tokens: int = field(default=256, metadata={"help": "Most tokens the base model writes per prompt."})
    temperature: float = field(default=0.0, metadata={"help": "The base model's sampling temperature; 0: greedy."})
    sampling_top_k: int = field(default=10, metadata={"help": "Top-k of its sampling; 0: off."})
    generation_batch_size: int = field(default=64, metadata={"help": "Prompts the base model continues at once."})
    text_tokens: int = field(default=0, metadata={"help": "Tokens of --data to teacher-force; 0: none."})
    seq_length: int = field(default=256, metadata={"help": "Tokens per packed --data sequence."})
    distill_top_k: int = field(default=32, metadata={"help": "The base model's most likely tokens kept per position."})
    eval_data: list[str] | None = field(
        default=None,
        metadata={"help": "Held-out prompts to measure acceptance on; default: a held-out share of the prompts."},
    )
    eval_fraction: float = field(default=0.05, metadata={"help": "Share of prompts held out for evaluation."})
    eval_prompts: int = field(default=16, metadata={"help": "Held-out prompts the acceptance is measured on."})
    eval_new_tokens: int = field(default=128, metadata={"help": "Greedy tokens the base writes per held-out prompt."})
    targets_cache: str | None = field(
        default=None, metadata={"help": "Folder caching what the base computed; default: the package's cache folder."}
    )
    # Training.
    loss: str = field(default="soft", metadata={"help": f"One of {', '.join(LOSSES)} (see losses)."})
    head_loss_decay: float = field(default=1.0, metadata={"help": "Head i's loss counts decay**i."})
    epochs: float = field(default=3.0, metadata={"help": "Passes over the targets (without --max-train-minutes)."})
    max_train_minutes: float = field(
        default=0.0,
        metadata={
            "help": "Budget of the whole run in minutes: the base computes targets for part of it, and training, "
            "evaluation and checkpoints fill the rest; 0: no budget (--num-prompts and --epochs decide)."
        },
    )
    batch_size: int = field(default=512, metadata={"help": "Positions per process and micro-step."})
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "Micro-steps per optimizer step."})
    learning_rate: float = field(default=3e-3, metadata={"help": "Peak learning rate."})
    warmup_steps: int = field(default=20, metadata={"help": "Linear warmup steps."})
    min_lr_ratio: float = field(default=0.1, metadata={"help": "The cosine decay ends at this share of the peak."})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay (matrices and embeddings only)."})
    adam_beta1: float = field(default=0.9, metadata={"help": "AdamW beta1."})
    adam_beta2: float = field(default=0.95, metadata={"help": "AdamW beta2."})
    max_grad_norm: float = field(default=1.0, metadata={"help": "Gradient clipping norm; 0: off."})
    eval_every: int = field(default=0, metadata={"help": "Evaluate every N steps; 0: ten times a run."})
    save_every: int = field(default=0, metadata={"help": "Checkpoint every N steps; 0: five times a run."})
    save_total_limit: int = field(default=2, metadata={"help": "Checkpoints kept on disk."})
    save_only_model: bool = field(
        default=False,
        metadata={"help": "Checkpoints hold the speculator and the trainer's state but not the optimizer's (which is "
                  "twice the speculator's size): for evaluating or picking a checkpoint, not for --resume, which "
                  "refuses them."},
    )  # fmt: skip
    logging_steps: int = field(default=10, metadata={"help": "Keep training metrics every N steps."})
    # Runtime.
    dtype: str = field(default="float32", metadata={"help": f"Base model dtype: {', '.join(DTYPES)}."})
    mixed_precision: str | None = field(
        default=None, metadata={"help": "no, fp16 or bf16 for the speculator; default: accelerate's config."}
    )
    fsdp: bool = field(
        default=False,
        metadata={"help": "Shard the speculator's parameters, gradients and optimizer state across the processes "
                  "(FSDP2), for a speculator whose training state does not fit one device. Needs several processes "
                  "(torchrun / accelerate launch)."},
    )  # fmt: skip
    fsdp_base: bool = field(
        default=False,
        metadata={"help": "Shard the frozen base model across the processes (FSDP2) while it computes the targets, "
                  "for a base that does not fit one device; every process then computes every target batch with "
                  "the others. Needs several processes."},
    )  # fmt: skip
    resume: bool = field(default=False, metadata={"help": "Continue the run whose checkpoints are in output_dir."})
    seed: int = field(default=0, metadata={"help": "Seed of the initialisation, the data order and any sampling."})
    report_to: str | None = field(
        default="auto", metadata={"help": "An accelerate tracker (tensorboard, wandb, ...), 'none', or 'auto'."}
    )
    push_to_hub: bool = field(default=False, metadata={"help": "Upload the final speculator to the Hub."})
    hub_model_id: str | None = field(default=None, metadata={"help": "Hub repo for --push-to-hub."})

    def __post_init__(self):
        for name in ("data", "prompts", "eval_data"):
            value = getattr(self, name)
            if isinstance(value, (str, os.PathLike)):
                value = [value]
            setattr(self, name, None if value is None else [str(v) for v in value])
        if not self.data and not self.prompts:
            raise ValueError(
                "No training data given: pass prompts for the base model to continue (--prompts), text (--data), or "
                "both."
            )
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type is float and not math.isfinite(value):
                no_limit = " (0 means no budget)" if f.name == "max_train_minutes" else ""
                raise ValueError(f"{f.name} must be a finite number{no_limit}, got {value}.")
        positive = ("n_predict", "batch_size", "gradient_accumulation_steps", "generation_batch_size", "distill_top_k",
                    "eval_prompts", "prompt_length", "seq_length", "save_total_limit", "logging_steps")  # fmt: skip
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}.")
        non_negative = ("inner_dim", "draft_vocab_size", "num_prompts", "synthesize_prompts", "text_tokens",
                        "sampling_top_k", "warmup_steps", "eval_every", "save_every", "max_train_minutes",
                        "temperature", "weight_decay", "max_grad_norm", "epochs")  # fmt: skip
        for name in non_negative:
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}.")
        for name in ("new_tokens", "eval_new_tokens"):
            if getattr(self, name) <= self.n_predict:
                raise ValueError(
                    f"{name}={getattr(self, name)} leaves nothing to learn for n_predict={self.n_predict}: it must "
                    "exceed n_predict."
                )
        if self.seq_length < self.n_predict + 2:
            raise ValueError(
                f"seq_length={self.seq_length} is too short for n_predict={self.n_predict}: head i needs the token "
                f"i + 2 ahead, so a sequence must hold at least n_predict + 2 = {self.n_predict + 2} tokens."
            )
        if self.text_tokens and not self.data:
            raise ValueError(f"text_tokens={self.text_tokens} needs text to teacher-force: give it with --data.")
        if not 0 <= self.eval_fraction < 1:
            raise ValueError(f"eval_fraction must be in [0, 1), got {self.eval_fraction}.")
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture must be one of {', '.join(ARCHITECTURES)}, got {self.architecture!r}.")
        if self.architecture == "lstm" and self.tie_weights is False:
            raise ValueError(
                "architecture=lstm shares one embedding and output layer across heads, as ArcticTraining and "
                "ArcticInference require: drop --no-tie-weights."
            )
        if self.tie_weights is None:
            self.tie_weights = self.architecture == "lstm"
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {', '.join(LOSSES)}, got {self.loss!r}.")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}.")
        if self.fsdp and self.mixed_precision == "fp16":
            raise ValueError(
                "fsdp with mixed_precision fp16 is not supported (its loss scaler does not shard): use bf16, or no."
            )

    def result_settings(self) -> dict:
        """The settings that decide what the run computes, which a resumed run must share with the one it continues
        (the paths of the output, the cache and the Hub, `resume` itself, what checkpoints hold, and whether the base
        is sharded, which computes the same targets, may change)."""
        ignored = {"output_dir", "resume", "targets_cache", "report_to", "push_to_hub", "hub_model_id",
                   "logging_steps", "save_total_limit", "save_only_model", "fsdp_base"}  # fmt: skip
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in ignored}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per `SpeculatorTrainingArguments` field, so the CLI and the Python API never drift apart."""
    for f in dataclasses.fields(SpeculatorTrainingArguments):
        flag = "--" + f.name.replace("_", "-")
        kwargs = {"help": f.metadata.get("help", ""), "dest": f.name}
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            kwargs["required"] = True
        else:
            kwargs["default"] = f.default
            kwargs["help"] += f" Default: {f.default}."
        if f.type in (bool, bool | None):
            kwargs["action"] = argparse.BooleanOptionalAction
        elif str(f.type).startswith("list"):
            kwargs["nargs"] = "+"
            kwargs["type"] = int if "int" in str(f.type) else str
        else:
            kwargs["type"] = {int: int, float: float}.get(f.type, str)
        aliases = ["--output"] if f.name == "output_dir" else []
        parser.add_argument(flag, *aliases, **kwargs)


def from_namespace(namespace: argparse.Namespace) -> SpeculatorTrainingArguments:
    names = {f.name for f in dataclasses.fields(SpeculatorTrainingArguments)}
    return SpeculatorTrainingArguments(**{k: v for k, v in vars(namespace).items() if k in names})
