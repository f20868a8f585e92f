"""The training and held-out targets of a run: which sequences the base model goes over, in what order, until when.

Training targets come in batches, each one file of the target cache: teacher forcing on `text_tokens` of the text
(`--data`), then the continuations of the training prompts, then, with `synthesize_prompts`, of user turns the base
model wrote itself. Without a time budget every batch is computed. With one, batches are added as long as the seconds
they took (as recorded in the cache, so that a resumed run makes the same choice), plus those of one more, fit the
budget. The held-out targets are
the greedy continuations of the first `eval_prompts` held-out prompts.

Under several processes, batch `i` of each round is computed by process `i % processes` (by all of them together when
the base is sharded, `fsdp_base`), and every process then reads them all (the cache folder must be shared, as it is
on one machine).
"""

import itertools
from dataclasses import dataclass

import torch
from transformers.utils import logging

from ..utils.package_data import cache_dir, evaluation_prompts
from ..utils.progress import Progress
from .documents import Corpus
from ..cpu.grouped_attention import grouped_sdpa
from .prompts import keep_new, normalized, render_chat_prompt, synthesize_user_turns
from .targets import TargetCache, Targets, continue_prompts, end_of_sequence_ids, fingerprint, teacher_force

logger = logging.get_logger(__name__)

# Synthesis gives up after this many batches in a row without a new prompt: a base that never ends a user turn, or
# only repeats known ones, would otherwise keep a run without a time budget sampling forever.
GIVE_UP_AFTER = 8


@dataclass
class TrainingData:
    train: Targets
    eval: Targets
    seconds: float  # what computing them took, as recorded in the cache: the share of a time budget they used


def _prompt_source(args, tokenizer) -> Corpus:
    # With prompts of their own for evaluation, none of the training prompts needs to be held out.
    eval_fraction = 0.0 if args.eval_data else args.eval_fraction
    return Corpus(args.prompts or args.data, tokenizer, eval_fraction, args.text_field)


def _prompts(corpus: Corpus, args, held_out: bool):
    """Whole prompt documents from --prompts; from --data, each document's opening, which the base continues."""
    if args.prompts:
        return corpus.prompts(args.prompt_length, held_out)
    return (ids[: args.prompt_length] for ids in corpus.prompts(10**9, held_out))


class _TargetJobs:
    """The base model's target batches as jobs of the target cache, (key, build) pairs, and their computation."""

    def __init__(self, args, base, tokenizer, accelerator, progress: Progress):
        self.args, self.base, self.accelerator, self.progress = args, base, accelerator, progress
        self.cache = TargetCache(args.targets_cache or cache_dir() / "targets")
        self.base_key = {"base": fingerprint(base), "top_k": args.distill_top_k}
        self.eos = end_of_sequence_ids(base, tokenizer)
        self.pad = next((t for t in (tokenizer.pad_token_id, *self.eos) if t is not None), 0)
        # A sharded base computes each batch with every process.
        self.parallel = 1 if args.fsdp_base else accelerator.num_processes

    def continuation(self, prompts, new_tokens, greedy, seed):
        """The job of the base model's continuations of `prompts`: greedy, or sampled as `args` ask."""
        args = self.args
        sampled = not greedy and args.temperature > 0
        key = {**self.base_key, "kind": "continuation", "prompts": prompts, "new_tokens": new_tokens, "eos": self.eos,
               "temperature": args.temperature if sampled else 0.0, "sampling_top_k": args.sampling_top_k * sampled,
               "seed": seed * sampled}  # fmt: skip
        build = lambda: continue_prompts(  # noqa: E731
            self.base, prompts, new_tokens, self.eos, self.pad, args.distill_top_k, key["temperature"],
            args.sampling_top_k, seed, on_tokens=self.progress.update,
        )
        return key, build

    def computed(self, jobs):
        """Each job's targets and recorded seconds, computed round-robin over the processes."""
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        results = []
        for start in range(0, len(jobs), world):
            round_ = jobs[start : start + world]
            if self.args.fsdp_base:  # a sharded forward needs every process: all compute each batch together
                for job in round_:
                    self.cache.get(*job)
            elif rank < len(round_):
                self.cache.get(*round_[rank])
            self.accelerator.wait_for_everyone()
            results += [self.cache.get(*job) for job in round_]
        return results


def _held_out_prompts(args, tokenizer, corpus: Corpus) -> list[list[int]]:
    """The first `eval_prompts` held-out prompts: those of --eval-data, else the held-out share of the prompts."""
    if args.eval_data:
        held_out = Corpus(args.eval_data, tokenizer, 0.0, args.text_field).prompts(args.prompt_length)
    else:
        held_out = _prompts(corpus, args, held_out=True)
    held_out = list(itertools.islice(held_out, args.eval_prompts))
    if not held_out:
        raise ValueError(
            f"No held-out prompt in {', '.join(args.eval_data or corpus.sources)} (eval_fraction="
            f"{args.eval_fraction}): the acceptance would be measured on nothing. Give more prompts, or raise "
            "eval_fraction."
        )
    return held_out


def _within_budget(jobs: _TargetJobs, training_jobs, spent: float, budget_seconds: float) -> tuple[list, float]:
    """The training targets, computed round by round while they fit the budget (all without one), and the seconds
    spent in all."""
    world = jobs.accelerator.num_processes
    training_jobs = iter(training_jobs)
    parts, last_round = [], 0.0
    # A round is only started if it should end within the budget, judging by the one before.
    while not budget_seconds or spent + last_round <= budget_seconds:
        round_ = list(itertools.islice(training_jobs, world))
        if not round_:
            break
        results = jobs.computed([(key, build) for key, build, _ in round_])
        seconds = [built + extra for (_, built), (_, _, extra) in zip(results, round_)]
        last_round = max(seconds) if jobs.parallel > 1 else sum(seconds)
        spent += sum(seconds) / jobs.parallel
        parts += [targets for targets, _ in results]
        jobs.progress.update(0, positions=sum(len(p) for p in parts), minutes=f"{spent / 60:.1f}")
    return parts, spent


def build_training_data(args, base, tokenizer, accelerator, budget_seconds: float = 0.0) -> TrainingData:
    """The held-out targets, then the training targets in their order, as many as `budget_seconds` holds (if any)."""
    progress = Progress(None, "Computing the base model's targets", "tokens",
                        disable=not accelerator.is_local_main_process)  # fmt: skip
    jobs = _TargetJobs(args, base, tokenizer, accelerator, progress)
    corpus = _prompt_source(args, tokenizer)
    held_out = _held_out_prompts(args, tokenizer, corpus)
    size = args.generation_batch_size
    batches = [held_out[i : i + size] for i in range(0, len(held_out), size)]
    with grouped_sdpa(base):  # the base's padded batches on CPU, without copies of its grouped key/value heads
        evaluation = jobs.computed([jobs.continuation(b, args.eval_new_tokens, True, 0) for b in batches])
        spent = sum(seconds for _, seconds in evaluation) / jobs.parallel
        with progress:
            training_jobs = _training_jobs(args, base, tokenizer, corpus, jobs, held_out)
            parts, spent = _within_budget(jobs, training_jobs, spent, budget_seconds)
    if not parts and budget_seconds:
        raise ValueError(
            f"--max-train-minutes {args.max_train_minutes:g} is spent before any training target: the held-out "
            f"targets alone took {spent:.1f} s of the {budget_seconds:.1f} s the targets may use. Raise "
            "--max-train-minutes."
        )
    if not parts:
        raise ValueError("The training data gave no sequence to learn from. Give more prompts or data.")
    return TrainingData(Targets.concatenate(parts), Targets.concatenate([t for t, _ in evaluation]), spent)


def _training_jobs(args, base, tokenizer, corpus, jobs: _TargetJobs, held_out):
    """The (key, build, extra seconds) of the training target batches, in the order they are used."""
    if args.text_tokens:
        text = Corpus(args.data, tokenizer, args.eval_fraction, args.text_field)
        rows = max(1, 2**14 // args.seq_length)  # about 16k tokens per forward
        sequences = itertools.islice(text.sequences(args.seq_length + 1), args.text_tokens // args.seq_length)
        while chunk := list(itertools.islice(sequences, rows)):
            key = {**jobs.base_key, "kind": "text", "sequences": [s.tolist() for s in chunk]}
            yield key, (lambda chunk=chunk: teacher_force(base, torch.stack(chunk), args.distill_top_k)), 0.0

    prompts = _prompts(corpus, args, held_out=False)
    if args.num_prompts:
        prompts = itertools.islice(prompts, args.num_prompts)
    batch_size = args.generation_batch_size
    # Synthesized prompts must not repeat these, nor the demo's and the benchmark's evaluation prompts.
    seen_ids = {tuple(p) for p in _prompts(corpus, args, held_out=True)} | {tuple(p) for p in held_out}
    seen_text = {normalized(p) for p in evaluation_prompts()}
    for index, chunk in enumerate(iter(lambda: list(itertools.islice(prompts, batch_size)), [])):
        seen_ids.update(tuple(p) for p in chunk)
        yield *jobs.continuation(chunk, args.new_tokens, args.temperature == 0, args.seed * 7919 + index), 0.0

    kept, writing = 0, 0.0  # the seconds the base spent writing prompts count with the batch that continues them
    fruitless = 0  # batches in a row that wrote no new prompt
    for index in itertools.count():
        if kept >= args.synthesize_prompts:
            break
        if fruitless == GIVE_UP_AFTER:
            logger.warning(
                f"The base model wrote no new user turn in {GIVE_UP_AFTER} batches in a row; stopping synthesis at "
                f"{kept} of the {args.synthesize_prompts} prompts asked for (--synthesize-prompts)."
            )
            break
        key = {**jobs.base_key, "kind": "user turns", "seed": args.seed, "batch": index, "size": batch_size}
        turns, seconds = jobs.cache.get(
            key, lambda: synthesize_user_turns(base, tokenizer, batch_size, args.seed * 104729 + index)
        )
        writing += seconds
        rendered = []
        for text in keep_new(turns, seen_text):
            ids = render_chat_prompt(tokenizer, text)
            if tuple(ids) not in seen_ids and len(ids) <= args.prompt_length and kept < args.synthesize_prompts:
                seen_ids.add(tuple(ids))
                rendered.append(ids)
                kept += 1
        fruitless = 0 if rendered else fruitless + 1
        if rendered:
            yield *jobs.continuation(rendered, args.new_tokens, args.temperature == 0, -(index + 1)), writing
            writing = 0.0
