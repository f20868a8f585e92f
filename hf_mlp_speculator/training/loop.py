"""Trains an MLPSpeculator for any causal LM: the base model computes its targets once, then one readable loop.

1. The frozen base model continues prompts (and, if asked, is teacher-forced on text); its hidden states and top-k
   next-token distributions are cached on disk (`targets`). With `max_train_minutes`, this phase takes its share of
   the budget and stops there.
2. The speculator trains epoch after epoch on those rows, in a random order that follows from the seed and the step
   alone, so a resumed run continues exactly where its checkpoint left off. Only the speculator pays per step.
3. The held-out score is the one inference sees: along the base model's greedy continuations of held-out prompts, how
   often head i's draft is accepted (heads 0..i all right), and the expected tokens per verifier step that follows.

Runs as it is on one CPU, and under `accelerate launch` or `torchrun` on many processes: DDP, or with `fsdp` the
speculator sharded across them (`sharding`). A global batch holds `batch_size x processes x
gradient_accumulation_steps` positions, the same ones whatever the process count, and its loss is a token mean over
all of them.
"""

import contextlib
import copy
import math
import os
import statistics
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import is_tensorboard_available
from torch.utils._pytree import tree_map
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging

from ..cpu.weight_layouts import fixed_layout, packed_matches_plain
from ..models.configuration_mlp_speculator import MLPSpeculatorConfig
from ..models.modeling_mlp_speculator import MLPSpeculatorPreTrainedModel
from ..utils.progress import Progress
from .arguments import SpeculatorTrainingArguments
from .checkpoints import (
    TrainerState,
    check_resumable,
    claim_output_dir,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    save_final,
)
from .initialization import initialize_from_base
from .losses import acceptance_counts, draft_index, token_losses
from .sharding import gathered, restore, shard, shard_base
from .targets import Targets
from .training_data import build_training_data

logger = logging.get_logger(__name__)

# The share of a time budget the base model's targets may take: measured on the default pair, more data beats more
# epochs until about here.
TARGETS_SHARE = 0.7
# Steps run (and undone) to time one: the first pays one-time costs, the median of the rest counts.
TIMED_STEPS = 4


def lr_multiplier(step: int, total_steps: int, args: SpeculatorTrainingArguments) -> float:
    """The share of the peak learning rate at `step`: a linear warmup, then a cosine decay to `min_lr_ratio`."""
    warmup = min(args.warmup_steps, total_steps)
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(total_steps - warmup, 1)
    return args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def load_base(args: SpeculatorTrainingArguments, device):
    """The frozen base model and its tokenizer, with the checks the speculator depends on."""
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.base_model)
    base = AutoModelForCausalLM.from_pretrained(args.base_model, dtype=args.dtype)
    if base.config.is_encoder_decoder:
        raise ValueError(
            f"{args.base_model} is an encoder-decoder model; an MLPSpeculator drafts for decoder-only (causal) LMs."
        )
    base.requires_grad_(False).eval()
    if args.fsdp_base:  # sharding moves each layer's shard to the device: the whole base never goes there
        shard_base(base)
    else:
        base.to(device)
    if getattr(base.config.get_text_config(), "hidden_size", None) is None:
        raise ValueError(
            f"The base model's config ({type(base.config).__name__}) has no hidden_size, which sizes the speculator's "
            "input. Use a causal LM with a standard config."
        )
    return base, tokenizer


def draft_vocabulary(targets: Targets, vocab_size: int, size: int) -> torch.LongTensor:
    """The `size` tokens the base model emitted most often (ties broken by the mass it gave them), ascending ids."""
    mass = torch.zeros(vocab_size, dtype=torch.float64)
    mass.index_add_(0, targets.topk_ids.flatten().long(), targets.topk_logprobs.flatten().double().exp())
    # Counts are whole numbers: mass scaled below 1 only breaks their ties.
    score = targets.token_counts(vocab_size).double() + mass / (mass.sum() + 1)
    return score.topk(size).indices.sort().values


def make_speculator(args: SpeculatorTrainingArguments, base, targets: Targets) -> MLPSpeculatorPreTrainedModel:
    text_config = base.config.get_text_config()
    vocab_size = text_config.vocab_size
    if args.draft_vocab_size > vocab_size:
        raise ValueError(
            f"draft_vocab_size={args.draft_vocab_size} is larger than the base model's vocabulary of {vocab_size} "
            f"tokens. Use at most {vocab_size}, or 0 for the whole vocabulary."
        )
    hidden = text_config.hidden_size
    lstm = args.architecture == "lstm"
    # An LSTM's embeddings and gates have the heads' width; the verifier's hidden size goes to `input_hidden_dim`.
    shape = dict(method="sum_lstm", input_hidden_dim=hidden, emb_dim=args.inner_dim or hidden, tie_lstm_embs=True)
    config = MLPSpeculatorConfig(
        **(shape if lstm else dict(emb_dim=hidden)),
        vocab_size=vocab_size,
        inner_dim=args.inner_dim,
        n_predict=args.n_predict,
        top_k_tokens_per_head=args.top_k_tokens_per_head or [max(5 - i, 2) for i in range(args.n_predict)],
        tie_weights=args.tie_weights,
        scale_input=args.scale_input,
        draft_vocab_size=args.draft_vocab_size if args.draft_vocab_size < vocab_size else 0,
        base_model_name_or_path=args.base_model,
    )
    speculator = MLPSpeculatorPreTrainedModel(config)
    if config.reduced_draft_vocab:
        speculator.speculator.draft_vocab.copy_(draft_vocabulary(targets, vocab_size, config.draft_vocab_size))
    if args.init_from_base:
        initialize_from_base(speculator, base)
    return speculator.train()


def weight_decay_groups(model, weight_decay: float) -> list[dict]:
    # Norm weights and biases are scales and offsets: decaying them towards 0 only fights the normalisation.
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


class Epochs:
    """The global batches of the run: a fresh permutation of the draftable rows per epoch, seeded by (seed, epoch)."""

    def __init__(self, targets: Targets, batch_rows: int, seed: int):
        self.positions, self.batch_rows, self.seed = targets.draft_positions(), batch_rows, seed
        self.steps_per_epoch = len(self.positions) // batch_rows
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"The targets hold {len(self.positions)} positions, fewer than one global batch of {batch_rows}. "
                "Lower batch_size, or give more prompts or data."
            )
        self._order = (None, None)

    def rows(self, step: int) -> torch.LongTensor:
        epoch, offset = divmod(step, self.steps_per_epoch)
        if self._order[0] != epoch:
            generator = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            self._order = (epoch, self.positions[torch.randperm(len(self.positions), generator=generator)])
        return self._order[1][offset * self.batch_rows : (offset + 1) * self.batch_rows]


def summarize(counts: torch.Tensor, loss_per_head: torch.Tensor | None, prefix: str) -> dict:
    """Readable metrics from summed `acceptance_counts` (and the per-head mean losses)."""
    hits, accepted, positions = counts.cpu().double()
    positions = positions.clamp(min=1)
    metrics = {}
    if loss_per_head is not None:
        metrics[f"{prefix}/loss"] = loss_per_head.sum().item()
    for i in range(len(positions)):
        if loss_per_head is not None:
            metrics[f"{prefix}/head_{i}_loss"] = loss_per_head[i].item()
        metrics[f"{prefix}/head_{i}_acc"] = (hits[i] / positions[i]).item()
        metrics[f"{prefix}/head_{i}_acceptance"] = (accepted[i] / positions[i]).item()
    metrics[f"{prefix}/tokens_per_step"] = 1 + sum(
        metrics[f"{prefix}/head_{i}_acceptance"] for i in range(len(positions))
    )
    return metrics


@torch.no_grad()
def evaluate(speculator, targets: Targets, args, accelerator) -> dict:
    """Held-out loss and acceptance, teacher-forced along the base model's greedy continuations of held-out prompts."""
    model = accelerator.unwrap_model(speculator)
    heads, device = model.speculator, accelerator.device
    index = draft_index(heads.draft_vocab, model.config.vocab_size, device)
    model.eval()
    losses, counts, positions = 0, 0, targets.draft_positions()
    for rows in positions.split(2048):
        batch = targets.batch(rows, args.n_predict).to(device)
        with accelerator.autocast():  # through the outer module, which gathers sharded weights
            logits = speculator(batch.states[:, None], batch.input_ids).logits[:, :, 0]
        losses = losses + token_losses(logits, batch, index, args.loss).sum(1)
        counts = counts + acceptance_counts(logits, batch, heads.draft_vocab)
    model.train()
    return summarize(counts, losses / counts[2].clamp(min=1), "eval")


def _trackers(report_to):
    if report_to in (None, "none"):
        return None
    if report_to == "auto":
        return "tensorboard" if is_tensorboard_available() else None
    return report_to


def plan_steps(args, epochs: Epochs, seconds_per_step: float, budget_left: float) -> int:
    """The run's optimizer steps: `epochs` passes, or as many as the rest of the time budget holds."""
    if not args.max_train_minutes:
        return max(1, round(args.epochs * epochs.steps_per_epoch))
    steps = int(budget_left / seconds_per_step)
    if steps < 1:
        raise ValueError(
            f"--max-train-minutes {args.max_train_minutes:g} leaves {max(budget_left, 0):.0f} s after computing the "
            f"targets, less than one training step ({seconds_per_step:.1f} s). Raise --max-train-minutes."
        )
    return steps


class OptimizerStep:
    """One optimizer step of the speculator on a global batch: this process's micro-batches of it, accumulated."""

    def __init__(self, speculator, optimizer, targets: Targets, epochs: Epochs, args, accelerator):
        self.speculator, self.optimizer, self.targets, self.epochs = speculator, optimizer, targets, epochs
        self.args, self.accelerator = args, accelerator
        heads = accelerator.unwrap_model(speculator).speculator
        self.draft_vocab = heads.draft_vocab
        self.index = draft_index(heads.draft_vocab, heads.vocab_size, accelerator.device)
        self.weights = torch.tensor(
            [args.head_loss_decay**i for i in range(args.n_predict)], device=accelerator.device
        )

    def __call__(self, step: int, update: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Runs global batch `step` (with `update=False`, only its forwards and backwards, to time it); returns the
        per-head mean losses and the acceptance counts over the whole global batch."""
        args, accelerator, speculator = self.args, self.accelerator, self.speculator
        world, rank = accelerator.num_processes, accelerator.process_index
        batch = self.targets.batch(self.epochs.rows(step), args.n_predict)
        head_positions = (batch.labels != -100).sum(1).clamp(min=1).to(accelerator.device)
        # Micro-step m of this process is global micro-batch m*world+rank.
        mine = batch.split(args.batch_size)[rank::world]
        loss_sum, counts = 0, 0
        for micro_step, micro in enumerate(mine):
            micro = micro.to(accelerator.device)
            last = micro_step == len(mine) - 1
            if args.fsdp:  # gradients are reduce-scattered after the last micro-batch only
                speculator.set_requires_gradient_sync(last)
            with accelerator.no_sync(speculator) if not last and not args.fsdp else contextlib.nullcontext():
                with accelerator.autocast():
                    logits = speculator(micro.states[:, None], micro.input_ids).logits[:, :, 0]
                losses = token_losses(logits, micro, self.index, args.loss).sum(1)
                # DDP averages gradients over processes: scaled by `world`, the result is the global token mean.
                accelerator.backward((self.weights * losses / head_positions).sum() * world)
            loss_sum = loss_sum + losses.detach()
            counts = counts + acceptance_counts(logits.detach(), micro, self.draft_vocab)
        if update:
            if args.max_grad_norm > 0:
                accelerator.clip_grad_norm_(speculator.parameters(), args.max_grad_norm)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return accelerator.reduce(loss_sum, "sum") / head_positions, accelerator.reduce(counts, "sum")

    def seconds(self) -> float:
        """
        How long a step takes, to fill a time budget: the median of the timed steps after the first, which pays the
        one-time costs (on a shared machine a single timing once came out at 1.6x the steps that followed); the
        optimizer update is included (with the base's vocabulary-wide embeddings it costs more than the forward and
        backward), and afterwards the weights and the optimizer are put back as they were.
        """
        weights = {k: v.clone() for k, v in self.speculator.state_dict().items()}
        optimizer_state = tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v),
                                   self.optimizer.state_dict())  # fmt: skip
        times = []
        for _ in range(TIMED_STEPS):
            start = time.perf_counter()
            self(0)
            times.append(time.perf_counter() - start)
        self.speculator.load_state_dict(weights)
        self.optimizer.load_state_dict(optimizer_state)
        return statistics.median(times[1:])


def start_or_resume(
    args, output_dir: Path, optimizer_step: OptimizerStep, epochs: Epochs, budget_left
) -> TrainerState:
    """The state of a fresh run, with its planned steps, or the one its latest checkpoint left (`--resume`)."""
    checkpoint = latest_checkpoint(output_dir) if args.resume else None
    if checkpoint is not None:
        accelerator, optimizer = optimizer_step.accelerator, optimizer_step.optimizer
        weights, optimizer_state, state = load_checkpoint(checkpoint)
        if args.fsdp:
            restore(optimizer_step.speculator, optimizer, weights, optimizer_state)
        else:
            accelerator.unwrap_model(optimizer_step.speculator).load_state_dict(weights)
            optimizer.load_state_dict(optimizer_state)
        logger.info(f"Resumed from {checkpoint} at step {state.step} of {state.total_steps}.")
        return state
    if args.resume:
        logger.warning(f"--resume: no checkpoint in {output_dir}, starting from scratch.")
    seconds_per_step = optimizer_step.seconds() if args.max_train_minutes else 0.0
    return TrainerState(total_steps=plan_steps(args, epochs, seconds_per_step, budget_left()))


def speculator_and_optimizer(args, base, targets: Targets, accelerator):
    """The initial speculator and its AdamW, ready for DDP or sharded (`fsdp`)."""
    torch.manual_seed(args.seed)  # the same initial speculator on every process, whatever was cached
    speculator = make_speculator(args, base, targets)
    if args.fsdp:  # sharded before the optimizer is made, so that its state is sharded too
        speculator = shard(speculator.to(accelerator.device))
    optimizer = torch.optim.AdamW(
        weight_decay_groups(speculator, args.weight_decay), lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
    )  # fmt: skip
    if args.fsdp:
        return speculator, optimizer
    return accelerator.prepare(speculator, optimizer)


def train(args: SpeculatorTrainingArguments) -> Path:
    """Trains a speculator as `args` describe; returns `args.output_dir`, holding it in the published layout."""
    started = time.monotonic()
    output_dir = Path(args.output_dir)
    accelerator = start_run(args, output_dir)
    base, tokenizer = load_base(args, accelerator.device)
    budget = args.max_train_minutes * 60
    building = time.monotonic()
    data = compute_targets(args, base, tokenizer, accelerator, budget * TARGETS_SHARE)
    # The targets count with the time they took when computed, not with the time reading them from the cache took
    # now: a rerun or a resumed run plans the same training as the first run.
    started += time.monotonic() - building - data.seconds

    speculator, optimizer = speculator_and_optimizer(args, base, data.train, accelerator)
    del base  # the rest needs only the targets
    rows_per_step = args.batch_size * accelerator.num_processes * args.gradient_accumulation_steps
    epochs = Epochs(data.train, rows_per_step, args.seed)
    optimizer_step = OptimizerStep(speculator, optimizer, data.train, epochs, args, accelerator)
    # What is left of the budget, less a little for the evaluations, checkpoints and the final save.
    state = start_or_resume(
        args, output_dir, optimizer_step, epochs, lambda: 0.97 * budget - (time.monotonic() - started)
    )
    eval_every = args.eval_every or max(1, state.total_steps // 10)
    save_every = args.save_every or max(1, state.total_steps // 5)

    hparams = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in vars(args).items()}
    accelerator.init_trackers("mlp_speculator", config=hparams)

    def log(metrics: dict) -> None:
        state.log_history.append({"step": state.step, **metrics})
        accelerator.log(metrics, step=state.step)

    if state.step == 0:
        log(evaluate(speculator, data.eval, args, accelerator))
    progress = Progress(state.total_steps, "Training the speculator", "steps", initial=state.step,
                        disable=not accelerator.is_local_main_process)  # fmt: skip
    run_started, run_rows = time.perf_counter(), 0
    while state.step < state.total_steps:
        lr = args.learning_rate * lr_multiplier(state.step, state.total_steps, args)
        set_learning_rate(optimizer, lr)
        loss_per_head, counts = optimizer_step(state.step)
        state.step += 1
        run_rows += rows_per_step
        metrics = {**summarize(counts, loss_per_head, "train"), "train/lr": lr,
                   "train/positions_per_second": run_rows / (time.perf_counter() - run_started)}  # fmt: skip
        show_progress(progress, metrics, args.n_predict)
        finished = state.step == state.total_steps
        saving = state.step % save_every == 0 and not finished
        if saving or finished or state.step % eval_every == 0:
            metrics.update(evaluate(speculator, data.eval, args, accelerator))
            progress.write(eval_line(metrics, state.step, args.n_predict))
        if "eval/loss" in metrics or state.step % args.logging_steps == 0:
            log(metrics)
        if saving:
            save_run_checkpoint(speculator, optimizer, state, args, accelerator)
    progress.close()

    finish(speculator, state, args, accelerator)
    return output_dir


def start_run(args: SpeculatorTrainingArguments, output_dir: Path) -> Accelerator:
    """The run's accelerator, once the launch, the sharding flags and the output folder (or its checkpoint) pass."""
    accelerator = Accelerator(
        mixed_precision=args.mixed_precision, log_with=_trackers(args.report_to), project_dir=output_dir
    )
    check_launch(accelerator)
    check_sharding(args, accelerator)
    if accelerator.is_main_process:
        claim_output_dir(output_dir, args.result_settings(), args.resume)
    accelerator.wait_for_everyone()
    # Refused before the targets are computed, which can take most of a run.
    if args.resume and (checkpoint := latest_checkpoint(output_dir)) is not None:
        check_resumable(checkpoint)
    return accelerator


def check_sharding(args: SpeculatorTrainingArguments, accelerator) -> None:
    """Refuses `fsdp` and `fsdp_base` on a single process, which would have nothing to shard across."""
    for flag, what in (("fsdp", "the speculator"), ("fsdp_base", "the base model")):
        if getattr(args, flag) and accelerator.num_processes < 2:
            name = "--" + flag.replace("_", "-")
            raise ValueError(
                f"{name} shards {what} across processes, and this run has one. Launch it on several (torchrun "
                f"--nproc-per-node N -m hf_mlp_speculator.training ..., or accelerate launch), or drop {name}."
            )


def compute_targets(args: SpeculatorTrainingArguments, base, tokenizer, accelerator, budget_seconds: float):
    """The base model's training and held-out targets (`build_training_data`), within `budget_seconds` if any."""
    # On CPU, the base computes its targets on packed weights where those agree with the plain ones, whatever they
    # measure: a forward's last bits differ between the two, and a run resumed from a kill must compute the targets
    # the unbroken run computes (a sharded base is left as it is).
    with fixed_layout(base, "packed" if not args.fsdp_base and packed_matches_plain(base) else "plain"):
        return build_training_data(args, base, tokenizer, accelerator, budget_seconds)


def set_learning_rate(optimizer, lr: float) -> None:
    """Sets the learning rate of every parameter group to `lr`, the schedule's value at this step."""
    for group in optimizer.param_groups:
        group["lr"] = lr


def show_progress(progress: Progress, metrics: dict, n_predict: int) -> None:
    """Advances the progress bar by a step, showing the step's loss, per-head acceptance and throughput."""
    acceptance = "/".join(f"{metrics[f'train/head_{i}_acceptance']:.2f}" for i in range(n_predict))
    progress.update(loss=f"{metrics['train/loss']:.3f}", acceptance=acceptance,
                    pos_s=f"{metrics['train/positions_per_second']:.0f}")  # fmt: skip


def save_run_checkpoint(speculator, optimizer, state: TrainerState, args, accelerator) -> None:
    """Saves a checkpoint of the run: what `--resume` continues from (the weights alone with `save_only_model`)."""
    whole, optimizer_state = whole_state(speculator, None if args.save_only_model else optimizer, args, accelerator)
    if accelerator.is_main_process:
        save_checkpoint(whole, optimizer_state, state, Path(args.output_dir), args.save_total_limit)
    accelerator.wait_for_everyone()


def finish(speculator, state: TrainerState, args, accelerator) -> None:
    """Saves the trained speculator in the published layout, with its model card (and upload), and ends the run."""
    final, _ = whole_state(speculator, None, args, accelerator)
    if accelerator.is_main_process:
        save_final(final, state, Path(args.output_dir))
        publish(final, state, args)
    accelerator.wait_for_everyone()
    accelerator.end_training()


def check_launch(accelerator) -> None:
    """Refuses processes that a launcher started together but accelerate runs apart: each would train a speculator of
    its own into the same folder."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched < 2 or accelerator.num_processes > 1:
        return
    if torch.cuda.is_available():
        fix = "Check how they were launched (`accelerate env` shows accelerate's settings)."
    else:
        # accelerate makes a process group of CPU processes only when told to: torchrun alone does not.
        fix = (
            "On a machine without CUDA, accelerate joins the processes only with ACCELERATE_USE_CPU=true in the "
            f"environment: launch with ACCELERATE_USE_CPU=true torchrun --nproc-per-node {launched} -m "
            "hf_mlp_speculator.training ..."
        )
    raise ValueError(
        f"The launcher started {launched} processes (WORLD_SIZE={launched}), but accelerate sees this one alone, so "
        f"each would train a speculator of its own into the same --output-dir. {fix}"
    )


def whole_state(speculator, optimizer, args, accelerator):
    """The whole speculator and the optimizer's state dict, to save (gathered from the shards with `fsdp`)."""
    if args.fsdp:
        return gathered(speculator, optimizer)
    return accelerator.unwrap_model(speculator), None if optimizer is None else optimizer.state_dict()


def eval_line(metrics: dict, step: int, n_predict: int) -> str:
    return (
        f"step {step}: held-out loss {metrics['eval/loss']:.3f}, per-head acceptance "
        + "/".join(f"{metrics[f'eval/head_{i}_acceptance']:.3f}" for i in range(n_predict))
        + f", expected tokens per step {metrics['eval/tokens_per_step']:.3f}"
    )


def publish(speculator, state: TrainerState, args) -> None:
    """The model card next to the speculator, and the upload to the Hub when asked."""
    from .model_card import make_model_card

    output_dir = Path(args.output_dir)
    make_model_card(args, speculator.config, state.log_history).save(output_dir / "README.md")
    if args.push_to_hub:
        from huggingface_hub import create_repo, upload_folder

        repo_id = create_repo(args.hub_model_id or output_dir.name, exist_ok=True).repo_id
        upload_folder(
            repo_id=repo_id, folder_path=output_dir,
            allow_patterns=["config.json", "*.safetensors", "*.json", "README.md"],
            ignore_patterns=["checkpoint-*", ".tmp-*", "trainer_state.json", "run.json"],
        )  # fmt: skip
        logger.info(f"Pushed the speculator to https://huggingface.co/{repo_id}")
