"""Trains an MLPSpeculator for any causal LM, in one readable loop.

Stage 1 teaches the heads the corpus by teacher forcing on the frozen base model's hidden states; stage 2
(self-distillation) lets the base model sample continuations of prompts from the corpus and teaches the heads the base
model's own tokens, which is what acceptance at inference depends on. The held-out score is the one inference sees:
along the base model's greedy continuations of held-out prompts, how often head i's argmax is the base model's token
with heads 0..i all right, and the expected tokens per verifier step that follows.

Runs as it is on one CPU, and under `accelerate launch` on many processes (DDP), with mixed precision and gradient
accumulation. `batch_size` is per process and per micro-step: one optimizer step sees
`batch_size x processes x gradient_accumulation_steps` sequences, read in the same order whatever the process count.
"""

import argparse
import contextlib
import dataclasses
import itertools
import json
import math
import os
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import is_tensorboard_available
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging

from .configuration_mlp_speculator import MLPSpeculatorConfig
from .data import PackedTextStream, left_padded
from .modeling_mlp_speculator import MLPSpeculatorPreTrainedModel
from .packed_linear import pack_linear_weights

logger = logging.get_logger(__name__)

# Test hook: "step:N" SIGKILLs the run right after optimizer step N, "save:N" in the middle of writing checkpoint N.
KILL_ENV = "HF_MLP_SPECULATOR_TEST_KILL"
IGNORE_INDEX = -100


@dataclass
class SpeculatorTrainingArguments:
    """Everything a training run needs; each field is also a flag of `hf-mlp-speculator train` (dashes for _)."""

    base_model: str = field(metadata={"help": "Path or Hub id of the frozen base model (any AutoModelForCausalLM)."})
    data: list[str] = field(
        metadata={"help": ".txt/.jsonl/.parquet files, folders of them, or `datasets` names/paths."}
    )
    output_dir: str = field(default="speculator", metadata={"help": "Where checkpoints and the final speculator go."})
    tokenizer: str | None = field(default=None, metadata={"help": "Tokenizer path or id; defaults to base_model."})
    # The speculator.
    n_predict: int = field(default=3, metadata={"help": "Number of heads (tokens drafted per step)."})
    inner_dim: int = field(default=0, metadata={"help": "Width of the heads' state; 0 means the base hidden size."})
    tie_weights: bool = field(default=False, metadata={"help": "Share weights across heads (needs n_predict > 1)."})
    scale_input: bool = field(default=False, metadata={"help": "RMS-normalise the base hidden state first."})
    top_k_tokens_per_head: list[int] | None = field(
        default=None, metadata={"help": "Tree branching per head stored in the config; default 5, 4, 3, 2, 2, ..."}
    )
    # Data.
    text_field: str = field(default="text", metadata={"help": "Field of .jsonl/.parquet/datasets records with text."})
    seq_length: int = field(default=256, metadata={"help": "Tokens per packed stage-1 training sequence."})
    batch_size: int = field(default=8, metadata={"help": "Sequences per process and micro-step."})
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "Micro-steps per optimizer step."})
    eval_fraction: float = field(default=0.05, metadata={"help": "Share of documents held out for evaluation."})
    eval_sequences: int = field(default=16, metadata={"help": "Held-out prompts the acceptance is measured on."})
    eval_new_tokens: int = field(default=128, metadata={"help": "Greedy tokens the base writes per held-out prompt."})
    eval_every: int = field(default=0, metadata={"help": "Evaluate every N steps (0: at stage ends and checkpoints)."})
    logging_steps: int = field(default=10, metadata={"help": "Keep training metrics every N steps."})
    # Schedule.
    stage1_steps: int = field(default=1000, metadata={"help": "Optimizer steps of stage 1 (teacher forcing on text)."})
    stage2_steps: int = field(
        default=400, metadata={"help": "Optimizer steps of stage 2 (self-distillation); 0: off."}
    )
    learning_rate: float = field(default=1e-3, metadata={"help": "Peak learning rate."})
    warmup_steps: int = field(default=100, metadata={"help": "Linear warmup steps at the start of each stage."})
    min_lr_ratio: float = field(default=0.1, metadata={"help": "Stage 1 decays the lr to this share of the peak."})
    stage2_lr_ratio: float = field(default=0.1, metadata={"help": "Stage 2 warms up to this share of the peak..."})
    stage2_min_lr_ratio: float = field(default=0.01, metadata={"help": "...and decays to this share."})
    weight_decay: float = field(default=0.1, metadata={"help": "AdamW weight decay (matrices and embeddings only)."})
    adam_beta1: float = field(default=0.9, metadata={"help": "AdamW beta1."})
    adam_beta2: float = field(default=0.95, metadata={"help": "AdamW beta2."})
    max_grad_norm: float = field(default=1.0, metadata={"help": "Gradient clipping norm; 0: off."})
    # Stage 2.
    stage2_data: list[str] | None = field(
        default=None,
        metadata={
            "help": "Prompts for stage 2 and the held-out evaluation, one per document (e.g. chat turns rendered up "
            "to the answer); default: prompts cut from --data."
        },
    )
    stage2_prompt_length: int = field(default=64, metadata={"help": "Prompt tokens (the last ones of a document)."})
    stage2_new_tokens: int = field(default=256, metadata={"help": "Tokens the base model samples per prompt."})
    stage2_temperature: float = field(default=1.0, metadata={"help": "Sampling temperature; 0: greedy."})
    stage2_steps_per_generation: int = field(
        default=8,
        metadata={
            "help": "Steps trained on the continuations of one generate() call: each process's base continues "
            "batch_size x gradient_accumulation_steps x this many prompts at once, which decodes several times faster "
            "per token than one batch at a time."
        },
    )
    stage2_top_k: int = field(default=10, metadata={"help": "Top-k of the base model's sampling; 0: off."})
    # Runtime.
    dtype: str = field(default="float32", metadata={"help": "Base model dtype: float32, bfloat16, float16 or auto."})
    mixed_precision: str | None = field(
        default=None, metadata={"help": "no, fp16 or bf16 for the speculator; default: accelerate's config."}
    )
    save_every: int = field(default=200, metadata={"help": "Checkpoint every N steps; 0: only the final model."})
    save_total_limit: int = field(default=2, metadata={"help": "Checkpoints kept on disk."})
    resume: bool = field(default=False, metadata={"help": "Continue from the latest checkpoint in output_dir."})
    seed: int = field(default=0, metadata={"help": "Seed of the initialisation and of stage-2 sampling."})
    report_to: str | None = field(
        default="auto", metadata={"help": "An accelerate tracker (tensorboard, wandb, ...), 'none', or 'auto'."}
    )
    push_to_hub: bool = field(default=False, metadata={"help": "Upload the final speculator to the Hub."})
    hub_model_id: str | None = field(default=None, metadata={"help": "Hub repo for --push-to-hub."})

    def __post_init__(self):
        if isinstance(self.data, (str, os.PathLike)):
            self.data = [self.data]
        self.data = [str(d) for d in self.data]
        if isinstance(self.stage2_data, (str, os.PathLike)):
            self.stage2_data = [self.stage2_data]
        if self.stage2_data is not None:
            self.stage2_data = [str(d) for d in self.stage2_data]
        if not self.data:
            raise ValueError("No training data given: pass at least one file, folder or dataset name (--data).")
        if self.seq_length < self.n_predict + 2:
            raise ValueError(
                f"seq_length={self.seq_length} is too short for n_predict={self.n_predict}: head i needs the token "
                f"i + 2 ahead, so a sequence must hold at least n_predict + 2 = {self.n_predict + 2} tokens. Raise "
                "seq_length (a few hundred is usual)."
            )
        for name in ("stage2_new_tokens", "eval_new_tokens"):
            if getattr(self, name) <= self.n_predict:
                raise ValueError(
                    f"{name}={getattr(self, name)} leaves nothing to learn for n_predict={self.n_predict}: it must "
                    "exceed n_predict."
                )
        if self.stage2_steps_per_generation < 1:
            raise ValueError(f"stage2_steps_per_generation must be >= 1, got {self.stage2_steps_per_generation}.")
        if self.stage2_prompt_length > self.seq_length:
            raise ValueError(
                f"stage2_prompt_length={self.stage2_prompt_length} exceeds seq_length={self.seq_length}: prompts are "
                "cut from the packed sequences. Lower stage2_prompt_length or raise seq_length."
            )
        if self.stage1_steps < 0 or self.stage2_steps < 0 or self.stage1_steps + self.stage2_steps == 0:
            raise ValueError("stage1_steps and stage2_steps must be >= 0 and not both 0.")
        if self.dtype not in ("float32", "bfloat16", "float16", "auto"):
            raise ValueError(f"dtype must be float32, bfloat16, float16 or auto, got {self.dtype!r}.")

    @property
    def total_steps(self) -> int:
        return self.stage1_steps + self.stage2_steps


@dataclass
class TrainerState:
    """What a checkpoint needs besides weights and optimizer to continue exactly: the step (the data position and the
    stage-2 sampling seeds follow from it)."""

    step: int = 0
    log_history: list = field(default_factory=list)


def lr_multiplier(step: int, args: SpeculatorTrainingArguments) -> float:
    """The share of the peak learning rate at `step`: per stage, a linear warmup then a cosine decay."""
    if step < args.stage1_steps:
        peak, floor, length = 1.0, args.min_lr_ratio, args.stage1_steps
    else:
        peak, floor = args.stage2_lr_ratio, args.stage2_min_lr_ratio
        step, length = step - args.stage1_steps, args.stage2_steps
    warmup = min(args.warmup_steps, length)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(length - warmup, 1)
    return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def base_hidden_states(base, input_ids: torch.LongTensor) -> torch.Tensor:
    """The base model's post-final-norm hidden states, without running its LM head."""
    output = base.get_decoder()(input_ids=input_ids, use_cache=False)
    hidden = getattr(output, "last_hidden_state", None)
    if hidden is None:
        # The decoder lookup fell back to the whole model: keep its LM head to one position.
        output = base(input_ids=input_ids, output_hidden_states=True, use_cache=False, logits_to_keep=1)
        if not getattr(output, "hidden_states", None):
            raise ValueError(
                f"{type(base).__name__} returns no hidden states, which the speculator is trained on. Use a causal LM "
                "whose forward supports output_hidden_states=True."
            )
        hidden = output.hidden_states[-1]
    return hidden


def speculator_batch(base, tokens: torch.LongTensor, n_predict: int, start: int = 0, eos_token_id=None, hidden=None):
    """
    Hidden states, head inputs and per-head labels for teacher forcing along `tokens`, from position `start` on.

    The state at position t comes with the tokens t+1, t+2, ... and head i learns token t+2+i. Tokens after the first
    `eos_token_id` at or after `start + 1` (the end of a generated continuation, then padding) are not learned.
    `hidden`, the base model's states along `tokens` when they are already known, saves running it again.
    """
    length = tokens.shape[1] - n_predict - 1
    if hidden is None:
        with torch.no_grad():
            hidden = base_hidden_states(base, tokens[:, :length])
    hidden = hidden[:, start:length]
    labels = torch.stack([tokens[:, start + 2 + i : length + 2 + i] for i in range(n_predict)])
    if eos_token_id is not None:
        ended = torch.isin(tokens, torch.as_tensor(eos_token_id, device=tokens.device))
        ended[:, : start + 1] = False
        after_eos = (ended.cumsum(1) - ended.long()) > 0
        after_eos = torch.stack([after_eos[:, start + 2 + i : length + 2 + i] for i in range(n_predict)])
        labels = labels.masked_fill(after_eos, IGNORE_INDEX)
    return hidden, tokens[:, start + 1 :], labels


def generate_continuations(
    base, prompts: torch.LongTensor, max_new_tokens: int, temperature: float, top_k: int, attention_mask=None
):
    """
    The base model's continuations of `prompts` (sampled, or greedy at temperature 0), prompts included, and the
    hidden states it computed along them on the way (all positions but the last), as in the reference's stage 2.
    """
    sample = temperature > 0
    output = base.generate(
        prompts,
        attention_mask=torch.ones_like(prompts) if attention_mask is None else attention_mask,
        max_new_tokens=max_new_tokens,
        do_sample=sample,
        temperature=temperature if sample else None,
        top_k=top_k if sample else None,
        top_p=None,
        pad_token_id=base.generation_config.pad_token_id or 0,
        return_dict_in_generate=True,
        output_hidden_states=True,
    )
    return output.sequences, torch.cat([layers[-1] for layers in output.hidden_states], dim=1)


def head_statistics(logits: torch.Tensor, labels: torch.LongTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """
    Per-head mean cross-entropy (differentiable) and the counts behind the metrics, `[4, n_predict]`: summed
    cross-entropy, top-1 hits, positions where heads 0..i were all right (head i's draft accepted), positions.
    """
    valid = labels != IGNORE_INDEX
    losses = F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), reduction="none").view_as(labels)
    counts = valid.flatten(1).sum(1)
    mean_losses = losses.flatten(1).sum(1) / counts.clamp(min=1)
    with torch.no_grad():
        hits = (logits.argmax(-1) == labels) & valid
        accepted = hits.cumprod(0)
        stats = torch.stack([losses.flatten(1).sum(1), hits.flatten(1).sum(1), accepted.flatten(1).sum(1), counts])
    return mean_losses, stats.float()


def summarize(stats: torch.Tensor, prefix: str) -> dict:
    """Readable metrics from summed `head_statistics` counts."""
    loss_sum, hits, accepted, counts = stats.cpu().double().clamp(min=0)
    counts = counts.clamp(min=1)
    acceptance = (accepted / counts).tolist()
    metrics = {f"{prefix}/loss": (loss_sum / counts).sum().item()}
    for i in range(len(counts)):
        metrics[f"{prefix}/head_{i}_loss"] = (loss_sum[i] / counts[i]).item()
        metrics[f"{prefix}/head_{i}_acc"] = (hits[i] / counts[i]).item()
    if prefix == "eval":
        for i, rate in enumerate(acceptance):
            metrics[f"eval/head_{i}_acceptance"] = rate
        metrics["eval/tokens_per_step"] = 1 + sum(acceptance)
    return metrics


@torch.no_grad()
def evaluate(speculator, eval_batches, accelerator) -> dict:
    """Held-out metrics over precomputed `speculator_batch`es (the base model's greedy continuations)."""
    speculator.eval()
    total = 0
    for hidden, input_ids, labels in eval_batches:
        with accelerator.autocast():
            logits = speculator(hidden, input_ids).logits
        total = total + head_statistics(logits, labels)[1]
    speculator.train()
    return summarize(total, "eval")


def load_base(args, device):
    """The frozen base model and its tokenizer, with the checks the speculator depends on."""
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.base_model)
    base = AutoModelForCausalLM.from_pretrained(args.base_model, dtype=args.dtype)
    base.requires_grad_(False).eval().to(device)
    if base.device.type == "cpu" and base.dtype == torch.float32:
        # The base only runs forward: oneDNN-packed weights make its batched decoding in stage 2 ~1.5x faster.
        pack_linear_weights(base)
    text_config = base.config.get_text_config()
    if getattr(text_config, "hidden_size", None) is None:
        raise ValueError(
            f"The base model's config ({type(text_config).__name__}) has no hidden_size, which sizes the speculator's "
            "input. Use a causal LM with a standard config."
        )
    if base.generation_config.pad_token_id is None:
        base.generation_config.pad_token_id = tokenizer.pad_token_id or tokenizer.eos_token_id
    return base, tokenizer


def weight_decay_groups(model, weight_decay: float) -> list[dict]:
    # Norm weights and biases are scales and offsets: decaying them towards 0 only fights the normalisation.
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(folder: Path) -> None:
    for path in [*folder.rglob("*"), folder]:
        _fsync(path)


def _maybe_kill(event: str, step: int) -> None:
    if os.environ.get(KILL_ENV) == f"{event}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)


def checkpoints(output_dir) -> list[Path]:
    """The complete checkpoints in `output_dir`, oldest first (incomplete ones are never named checkpoint-*)."""
    found = [p for p in Path(output_dir).glob("checkpoint-*") if p.name.split("-")[-1].isdigit()]
    return sorted(found, key=lambda p: int(p.name.split("-")[-1]))


def latest_checkpoint(output_dir) -> Path | None:
    """The complete checkpoint of the highest step in `output_dir`."""
    return (checkpoints(output_dir) or [None])[-1]


def save_checkpoint(accelerator, speculator, optimizer, state: TrainerState, args) -> None:
    """
    Writes a checkpoint atomically: everything goes to a hidden folder, which is fsynced and then renamed. A run
    killed at any point leaves either the complete checkpoint or none (and a hidden folder the next save removes).
    The folder is also a loadable speculator, so any checkpoint can be tried.
    """
    output_dir = Path(args.output_dir)
    final, tmp = output_dir / f"checkpoint-{state.step}", output_dir / f".tmp-checkpoint-{state.step}"
    if accelerator.is_main_process:
        for stale in output_dir.glob(".tmp-checkpoint-*"):
            shutil.rmtree(stale)
        tmp.mkdir(parents=True)
        accelerator.unwrap_model(speculator).save_pretrained(tmp)
        _maybe_kill("save", state.step)
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        (tmp / "trainer_state.json").write_text(json.dumps(dataclasses.asdict(state), indent=1))
        _fsync_tree(tmp)
        os.replace(tmp, final)
        _fsync(output_dir)
        old = [p for p in checkpoints(output_dir) if p != final]
        for stale in old[: max(len(old) - args.save_total_limit + 1, 0)]:
            # Renamed first, so that a kill halfway through the deletion leaves no partial checkpoint-* folder.
            trash = stale.with_name(f".tmp-{stale.name}")
            os.replace(stale, trash)
            shutil.rmtree(trash)
    accelerator.wait_for_everyone()


def load_checkpoint(path: Path, accelerator, speculator, optimizer) -> TrainerState:
    """Restores weights, optimizer and step from a checkpoint."""
    weights = MLPSpeculatorPreTrainedModel.from_pretrained(path).state_dict()
    accelerator.unwrap_model(speculator).load_state_dict(weights)
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location=accelerator.device, weights_only=True))
    return TrainerState(**json.loads((path / "trainer_state.json").read_text()))


def _trackers(report_to):
    if report_to in (None, "none"):
        return None
    if report_to == "auto":
        return "tensorboard" if is_tensorboard_available() else None
    return report_to


def train(args: SpeculatorTrainingArguments) -> Path:
    """Trains a speculator as `args` describe; returns `args.output_dir`, holding it in the published layout."""
    output_dir = Path(args.output_dir)
    accelerator = Accelerator(
        mixed_precision=args.mixed_precision, log_with=_trackers(args.report_to), project_dir=output_dir
    )
    if int(os.environ.get("WORLD_SIZE", "1")) != accelerator.num_processes:
        logger.warning(
            f"WORLD_SIZE is {os.environ['WORLD_SIZE']} but accelerate runs {accelerator.num_processes} process(es), "
            "so each process would train alone. On CPUs, set ACCELERATE_USE_CPU=true (or `accelerate config` with "
            "distributed_type MULTI_CPU)."
        )
    torch.manual_seed(args.seed)  # the same initial speculator on every process
    base, tokenizer = load_base(args, accelerator.device)
    text_config = base.config.get_text_config()
    config = MLPSpeculatorConfig(
        vocab_size=text_config.vocab_size,
        emb_dim=text_config.hidden_size,
        inner_dim=args.inner_dim,
        n_predict=args.n_predict,
        top_k_tokens_per_head=args.top_k_tokens_per_head or [max(5 - i, 2) for i in range(args.n_predict)],
        tie_weights=args.tie_weights,
        scale_input=args.scale_input,
        base_model_name_or_path=args.base_model,
    )
    speculator = MLPSpeculatorPreTrainedModel(config).train()
    optimizer = torch.optim.AdamW(
        weight_decay_groups(speculator, args.weight_decay),
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
    )
    speculator, optimizer = accelerator.prepare(speculator, optimizer)
    eos_token_id = base.generation_config.eos_token_id

    data = PackedTextStream(args.data, tokenizer, args.seq_length, args.eval_fraction, args.text_field)
    prompt_data = args.stage2_data and PackedTextStream(
        args.stage2_data, tokenizer, args.seq_length, args.eval_fraction, args.text_field
    )
    pad_token_id = base.generation_config.pad_token_id or 0

    def continuations(prompts, new_tokens, temperature, top_k):
        """
        The base model's continuations of `prompts` (token lists from `prompt_data`, or packed sequences) in one
        generate() call, as `speculator_batch`es of `batch_size` rows.
        """
        if prompt_data:
            ids, mask = left_padded(prompts, pad_token_id, accelerator.device)
        else:
            ids = torch.stack(prompts)[:, : args.stage2_prompt_length].to(accelerator.device)
            mask = torch.ones_like(ids)
        with torch.no_grad():
            sequences, hidden = generate_continuations(base, ids, new_tokens, temperature, top_k, mask)
        hidden, input_ids, labels = speculator_batch(
            base, sequences, args.n_predict, ids.shape[1] - 1, eos_token_id, hidden
        )
        rows = args.batch_size
        return list(zip(hidden.split(rows), input_ids.split(rows), labels.split(rows, dim=1)))

    # The held-out set: the base model's greedy continuations of held-out prompts, and its hidden states along them,
    # computed once since the base model never changes.
    if prompt_data:
        held_out = list(
            itertools.islice(prompt_data.prompts(args.stage2_prompt_length, held_out=True), args.eval_sequences)
        )
        if not held_out:
            raise ValueError(
                f"No held-out prompt in {', '.join(args.stage2_data)} (eval_fraction={args.eval_fraction}). Give more "
                "prompts or raise eval_fraction."
            )
    else:
        held_out = list(data.eval_sequences(args.eval_sequences))
    rows_per_generation = args.batch_size * args.gradient_accumulation_steps * args.stage2_steps_per_generation
    eval_batches = []
    for i in range(0, len(held_out), rows_per_generation):
        eval_batches += continuations(held_out[i : i + rows_per_generation], args.eval_new_tokens, 0, 0)

    state = TrainerState()
    checkpoint = latest_checkpoint(output_dir) if args.resume else None
    if args.resume and checkpoint is None:
        logger.warning(f"--resume: no checkpoint in {output_dir}, starting from scratch.")
    if checkpoint is not None:
        state = load_checkpoint(checkpoint, accelerator, speculator, optimizer)
        logger.info(f"Resumed from {checkpoint} at step {state.step}.")
    hparams = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in dataclasses.asdict(args).items()}
    accelerator.init_trackers("mlp_speculator", config=hparams)

    def log(metrics: dict) -> None:
        state.log_history.append({"step": state.step, **metrics})
        accelerator.log(metrics, step=state.step)

    if state.step == 0:
        log(evaluate(speculator, eval_batches, accelerator))

    # Every process reads the same global micro-batches, in the same order whatever the process count, and keeps its
    # own rows of each; where a step reads follows from the step alone, so a resumed run reads what it would have.
    world, rank = accelerator.num_processes, accelerator.process_index
    rows_per_step = args.batch_size * world * args.gradient_accumulation_steps

    def own_rows(source, micro_steps: int) -> list:
        rows = []
        for _ in range(micro_steps):
            micro_batch = [next(source) for _ in range(args.batch_size * world)]
            rows += micro_batch[rank * args.batch_size : (rank + 1) * args.batch_size]
        return rows

    stage1_sequences = data.train_sequences(skip=min(state.step, args.stage1_steps) * rows_per_step)
    stage2_prompts = None  # opened when stage 2 starts, at the generation the current step belongs to
    pending = []  # this process's stage-2 micro-batches, generated but not trained on yet
    progress = tqdm(total=args.total_steps, initial=state.step, disable=not accelerator.is_local_main_process)
    run_started, run_tokens = time.perf_counter(), 0
    while state.step < args.total_steps:
        stage = 1 if state.step < args.stage1_steps else 2
        lr = args.learning_rate * lr_multiplier(state.step, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        if stage == 1:
            rows = torch.stack(own_rows(stage1_sequences, args.gradient_accumulation_steps)).to(accelerator.device)
            batches = (speculator_batch(base, batch, args.n_predict) for batch in rows.split(args.batch_size))
        else:
            if not pending:
                generation, offset = divmod(state.step - args.stage1_steps, args.stage2_steps_per_generation)
                if stage2_prompts is None:
                    skip = generation * args.stage2_steps_per_generation * rows_per_step
                    stage2_prompts = (
                        prompt_data.prompts(args.stage2_prompt_length, skip=skip)
                        if prompt_data
                        else data.train_sequences(skip=args.stage1_steps * rows_per_step + skip)
                    )
                steps = min(args.stage2_steps_per_generation, args.total_steps - state.step + offset)
                # Seeded by the generation, so that a run resumed in its middle samples the same continuations again.
                torch.manual_seed(hash((args.seed, generation, rank)))
                pending = continuations(
                    own_rows(stage2_prompts, steps * args.gradient_accumulation_steps),
                    args.stage2_new_tokens,
                    args.stage2_temperature,
                    args.stage2_top_k,
                )[offset * args.gradient_accumulation_steps :]
            batches = pending[: args.gradient_accumulation_steps]
            del pending[: args.gradient_accumulation_steps]
        stats, accumulation = 0, args.gradient_accumulation_steps
        for micro_step, (hidden, input_ids, labels) in enumerate(batches):
            last = micro_step == accumulation - 1
            with accelerator.no_sync(speculator) if not last else contextlib.nullcontext():
                with accelerator.autocast():
                    head_losses, micro_stats = head_statistics(speculator(hidden, input_ids).logits, labels)
                accelerator.backward(head_losses.sum() / accumulation)
            stats = stats + micro_stats
            run_tokens += labels[0].numel() * world
        if args.max_grad_norm > 0:
            accelerator.clip_grad_norm_(speculator.parameters(), args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        state.step += 1

        # Summed counts over processes give the metrics of the global batch, as one process would compute them.
        stats = accelerator.reduce(stats, "sum")
        # Over the whole run so far: a stage-2 step that generates its continuations takes much longer than the next.
        tokens_per_second = run_tokens / (time.perf_counter() - run_started)
        metrics = {
            **summarize(stats, "train"),
            "train/lr": lr,
            "train/stage": stage,
            "train/tokens_per_second": tokens_per_second,
        }
        accuracies = "/".join(f"{metrics[f'train/head_{i}_acc']:.2f}" for i in range(args.n_predict))
        progress.set_postfix(
            stage=stage, loss=f"{metrics['train/loss']:.3f}", acc=accuracies, tok_s=f"{tokens_per_second:.0f}"
        )
        progress.update()
        saving = args.save_every and state.step % args.save_every == 0 and state.step < args.total_steps
        if (
            saving
            or state.step in (args.stage1_steps, args.total_steps)
            or (args.eval_every and state.step % args.eval_every == 0)
        ):
            metrics.update(evaluate(speculator, eval_batches, accelerator))
            progress.write(
                f"step {state.step}: held-out loss {metrics['eval/loss']:.3f}, per-head acceptance "
                + "/".join(f"{metrics[f'eval/head_{i}_acceptance']:.3f}" for i in range(args.n_predict))
                + f", expected tokens per step {metrics['eval/tokens_per_step']:.3f}"
            )
        if "eval/loss" in metrics or state.step % args.logging_steps == 0:
            log(metrics)
        _maybe_kill("step", state.step)
        if saving:
            save_checkpoint(accelerator, speculator, optimizer, state, args)
    progress.close()

    if accelerator.is_main_process:
        save_final(accelerator.unwrap_model(speculator), state, args)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return output_dir


def save_final(speculator, state: TrainerState, args) -> None:
    """The speculator in the published layout, the run's log, and a model card; pushed to the Hub if asked."""
    from .model_card import make_model_card

    output_dir = Path(args.output_dir)
    speculator.save_pretrained(output_dir)
    (output_dir / "trainer_state.json").write_text(json.dumps(dataclasses.asdict(state), indent=1))
    card = make_model_card(args, speculator.config, state.log_history)
    card.save(output_dir / "README.md")
    if args.push_to_hub:
        from huggingface_hub import create_repo, upload_folder

        repo_id = args.hub_model_id or output_dir.name
        repo_id = create_repo(repo_id, exist_ok=True).repo_id
        upload_folder(
            repo_id=repo_id,
            folder_path=output_dir,
            allow_patterns=["config.json", "*.safetensors", "*.json", "README.md"],
            ignore_patterns=["checkpoint-*", ".tmp-*", "trainer_state.json"],
        )
        logger.info(f"Pushed the speculator to https://huggingface.co/{repo_id}")


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
        if f.type is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif str(f.type).startswith("list"):
            kwargs["nargs"] = "+"
            kwargs["type"] = int if "int" in str(f.type) else str
        else:
            kwargs["type"] = {int: int, float: float}.get(f.type, str)
        aliases = ["--output"] if f.name == "output_dir" else []
        parser.add_argument(flag, *aliases, **kwargs)


def run(args: argparse.Namespace) -> int:
    names = {f.name for f in dataclasses.fields(SpeculatorTrainingArguments)}
    output_dir = train(SpeculatorTrainingArguments(**{k: v for k, v in vars(args).items() if k in names}))
    print(f"Speculator saved to {output_dir}")
    return 0


__all__ = ["SpeculatorTrainingArguments", "TrainerState", "add_arguments", "lr_multiplier", "run", "train"]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m hf_mlp_speculator.training", description=__doc__.splitlines()[0])
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
