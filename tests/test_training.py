"""The trainer end to end on a toy language: what it publishes, exact resumption after a SIGKILL from outside, two
processes and gradient accumulation against one large batch, the output-folder guard, checkpoints without the
optimizer, failed and damaged checkpoints, the time budget and bad settings."""

import argparse
import copy
import dataclasses
import errno
import json
import math
import os
import random
import re
import signal
import string
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import make_verifier
from safetensors.torch import load_file
from tiny_tokenizer import char_tokenizer
from transformers import AutoModel, AutoModelForCausalLM

from hf_mlp_speculator import MLPSpeculatorPreTrainedModel, cli
from hf_mlp_speculator.training import (
    SpeculatorTrainingArguments,
    add_arguments,
    from_namespace,
    latest_checkpoint,
    loop,
    lr_multiplier,
    train,
)
from hf_mlp_speculator.training.loop import TIMED_STEPS, Epochs, plan_steps

LETTERS = [ord(c) - 31 for c in string.ascii_lowercase]  # the char tokenizer's ids of a..z


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Tiny models run far faster on one thread, and the subprocesses get OMP_NUM_THREADS=1: the same arithmetic.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def toy_document(rng: random.Random) -> str:
    """The toy language: the alphabet, cyclically, from any letter."""
    start = rng.randrange(26)
    return "".join(string.ascii_lowercase[(start + j) % 26] for j in range(rng.randint(40, 90)))


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """A corpus and prompts of the toy language, and a tiny Llama (with its tokenizer) that has learned it."""
    root = tmp_path_factory.mktemp("toy")
    rng = random.Random(0)
    (root / "corpus.txt").write_text("\n\n".join(toy_document(rng) for _ in range(300)))
    (root / "prompts.jsonl").write_text(
        "".join(json.dumps({"text": toy_document(rng)[: rng.randint(3, 12)]}) + "\n" for _ in range(80))
    )
    tokenizer = char_tokenizer()
    base = make_verifier("llama").train()
    optimizer = torch.optim.AdamW(base.parameters(), lr=1e-2)
    for _ in range(40):
        batch = torch.tensor([tokenizer(toy_document(rng)[:40])["input_ids"] for _ in range(8)])
        base(batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    base.save_pretrained(root / "base")
    tokenizer.save_pretrained(root / "base")
    return root


def toy_args(toy, output_dir, **overrides) -> SpeculatorTrainingArguments:
    settings = dict(
        base_model=str(toy / "base"), prompts=[str(toy / "prompts.jsonl")], data=[str(toy / "corpus.txt")],
        output_dir=str(output_dir), targets_cache=str(toy / "cache"), inner_dim=32, new_tokens=16,
        eval_new_tokens=16, eval_prompts=4, eval_fraction=0.1, text_tokens=1024, seq_length=32,
        generation_batch_size=16, batch_size=32, epochs=1, learning_rate=1e-2, warmup_steps=2, logging_steps=1,
        report_to="none",
    )  # fmt: skip
    return SpeculatorTrainingArguments(**{**settings, **overrides})


def as_flags(args: SpeculatorTrainingArguments) -> list[str]:
    flags = []
    for name, value in vars(args).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list):
            flags += [flag, *map(str, value)]
        elif value is not None:
            flags += [flag, str(value)]
    return flags


def cli_command(args, module="hf_mlp_speculator.cli", launcher=(sys.executable, "-m")) -> list[str]:
    return [*launcher, module, *(["train"] if module.endswith("cli") else []), *as_flags(args)]


CLI_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def history(output_dir, key) -> dict:
    log = json.loads((Path(output_dir) / "trainer_state.json").read_text())["log_history"]
    return {entry["step"]: entry[key] for entry in log if key in entry}


def weights(output_dir) -> dict:
    return load_file(Path(output_dir) / "model.safetensors")


def assert_same_weights(a, b) -> None:
    a, b = weights(a), weights(b)
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"not bit-identical: {different}"


# The schedule and the settings.


def test_lr_multiplier_warms_up_then_decays_along_a_cosine_to_min_lr_ratio():
    args = SpeculatorTrainingArguments(base_model="x", prompts=["x"], warmup_steps=4, min_lr_ratio=0.2)
    values = [lr_multiplier(step, 20, args) for step in range(21)]
    assert values[:4] == [0.25, 0.5, 0.75, 1.0]  # linear warmup, reaching the peak at the last warmup step
    for step in range(4, 21):  # then a cosine over the remaining 16 steps, from 1 down to 0.2
        assert values[step] == pytest.approx(0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi * (step - 4) / 16)))
    assert values[12] == pytest.approx(0.6) and values[20] == pytest.approx(0.2)
    assert all(a > b for a, b in zip(values[4:], values[5:]))
    # A warmup longer than the run is cut to the run.
    assert [lr_multiplier(s, 2, args) for s in range(2)] == [0.5, 1.0]


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"batch_size": 0}, r"batch_size must be at least 1, got 0"),
        ({"gradient_accumulation_steps": 0}, r"gradient_accumulation_steps must be at least 1, got 0"),
        ({"eval_prompts": 0}, r"eval_prompts must be at least 1, got 0"),
        ({"prompts": None}, r"No training data given: pass prompts .*--prompts.*--data"),
        ({"prompts": []}, r"No training data given"),
        ({"loss": "foo"}, r"loss must be one of soft, hard, mix, got 'foo'"),
        ({"text_tokens": 100}, r"text_tokens=100 needs text to teacher-force: give it with --data"),
        ({"new_tokens": 3}, r"new_tokens=3 leaves nothing to learn for n_predict=3: it must exceed n_predict"),
        ({"new_tokens": 4, "n_predict": 4}, r"new_tokens=4 leaves nothing to learn for n_predict=4"),
        ({"eval_new_tokens": 2}, r"eval_new_tokens=2 leaves nothing to learn for n_predict=3"),
        ({"data": ["x"], "seq_length": 4}, r"seq_length=4 is too short for n_predict=3.*n_predict \+ 2 = 5"),
        ({"eval_fraction": 1.0}, r"eval_fraction must be in \[0, 1\), got 1.0"),
        ({"max_train_minutes": -1}, r"max_train_minutes must be >= 0, got -1"),
        ({"max_train_minutes": math.inf}, r"^max_train_minutes must be a finite number \(0 means no budget\), got inf\.$"),
        ({"max_train_minutes": math.nan}, r"^max_train_minutes must be a finite number \(0 means no budget\), got nan\.$"),
        ({"epochs": math.inf}, r"^epochs must be a finite number, got inf\.$"),
        ({"learning_rate": math.nan}, r"^learning_rate must be a finite number, got nan\.$"),
        ({"dtype": "float64"}, r"dtype must be one of float32, bfloat16, float16, auto, got 'float64'"),
    ],
)
def test_bad_settings_name_the_setting(settings, message):
    with pytest.raises(ValueError, match=message):
        SpeculatorTrainingArguments(**{"base_model": "x", "prompts": ["p.txt"], **settings})


def test_the_command_line_has_one_flag_per_setting(toy, tmp_path):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = toy_args(toy, tmp_path / "run", tie_weights=True, top_k_tokens_per_head=[3, 2, 2], max_train_minutes=2.5)
    assert from_namespace(parser.parse_args(as_flags(args))) == args
    with pytest.raises(ValueError, match="batch_size must be at least 1"):
        from_namespace(parser.parse_args(as_flags(args) + ["--batch-size", "0"]))


def test_plan_steps_fills_the_time_budget_or_runs_the_epochs():
    epochs = argparse.Namespace(steps_per_epoch=40)
    no_budget = SpeculatorTrainingArguments(base_model="x", prompts=["x"], epochs=2.5)
    assert plan_steps(no_budget, epochs, seconds_per_step=100.0, budget_left=0.0) == 100
    assert plan_steps(dataclasses.replace(no_budget, epochs=0.001), epochs, 1.0, 0.0) == 1
    budget = SpeculatorTrainingArguments(base_model="x", prompts=["x"], max_train_minutes=1.0, epochs=2.5)
    assert plan_steps(budget, epochs, seconds_per_step=0.25, budget_left=30.0) == 120  # the budget, not the epochs
    assert plan_steps(budget, epochs, seconds_per_step=0.7, budget_left=30.0) == 42  # whole steps that fit
    assert plan_steps(budget, epochs, seconds_per_step=30.0, budget_left=30.0) == 1
    for budget_left, shown in ((29.0, "29 s"), (-5.0, "0 s")):
        message = rf"--max-train-minutes 1 leaves {shown} after computing the targets, less than one training step"
        with pytest.raises(ValueError, match=message + r" \(30\.0 s\)\. Raise --max-train-minutes"):
            plan_steps(budget, epochs, seconds_per_step=30.0, budget_left=budget_left)


def test_a_budget_too_small_for_any_training_says_so(toy, tmp_path):
    """Not "give more prompts or data": the data is there, the budget is what is missing."""
    args = toy_args(toy, tmp_path / "run", max_train_minutes=0.0001)
    with pytest.raises(ValueError, match=r"--max-train-minutes 0.0001 is spent before any training target: the "
                                         r"held-out targets alone took .* Raise --max-train-minutes"):  # fmt: skip
        train(args)


# The toy language end to end.


PUBLISHED_KEYS = sorted(
    f"speculator.{name}.{i}.{p}"
    for name, p in [("emb", "weight"), ("proj", "weight"), ("head", "weight"), ("ln", "weight"), ("ln", "bias")]
    for i in range(3)
)


@pytest.mark.parametrize("draft_vocab_size", [0, 30], ids=["full-vocab", "draft-vocab"])
def test_toy_language_end_to_end(toy, tmp_path, draft_vocab_size):
    """Held-out acceptance near 1, the published layout, lossless greedy generate() with > 2 tokens per step, and a
    model card that reports the run and whose snippet runs. A 30-token draft vocabulary holds the 26 letters."""
    # The heads start from the base (as wide as its hidden size) in the draft-vocabulary run.
    extra = {"draft_vocab_size": draft_vocab_size, "init_from_base": True, "inner_dim": 64} if draft_vocab_size else {}
    args = toy_args(toy, tmp_path / "run", batch_size=64, epochs=3, **extra)
    output_dir = train(args)
    assert Path(output_dir) == Path(args.output_dir)
    log = json.loads((output_dir / "trainer_state.json").read_text())["log_history"]
    evals = [entry for entry in log if "eval/loss" in entry]
    assert evals[0]["step"] == 0 and evals[-1]["eval/loss"] < evals[0]["eval/loss"] / 4
    final = evals[-1]
    acceptance = [final[f"eval/head_{i}_acceptance"] for i in range(3)]
    assert min(acceptance) > 0.95 and final["eval/tokens_per_step"] == pytest.approx(1 + sum(acceptance))

    # The published layout (plus the draft vocabulary's index), loadable by AutoModel, naming its base model.
    speculator = AutoModel.from_pretrained(output_dir)
    assert speculator.config.base_model_name_or_path == args.base_model
    stored = weights(output_dir)
    assert sorted(stored) == sorted(PUBLISHED_KEYS + (["speculator.draft_vocab"] if draft_vocab_size else []))
    config = json.loads((output_dir / "config.json").read_text())
    if draft_vocab_size:
        draft_vocab = stored["speculator.draft_vocab"].tolist()
        assert config["draft_vocab_size"] == 30 and len(draft_vocab) == 30 and draft_vocab == sorted(draft_vocab)
        assert set(LETTERS) <= set(draft_vocab)  # the tokens the base model emits
        assert stored["speculator.head.0.weight"].shape == (30, 64)
    else:
        assert "draft_vocab_size" not in config and stored["speculator.head.0.weight"].shape == (96, 32)

    base = AutoModelForCausalLM.from_pretrained(args.base_model)
    tokenizer = char_tokenizer()
    for text, fast in (("qrstuvwx", True), ("Hi! 42 {x}", False)):  # the second one starts outside the draft vocab
        prompt = tokenizer(text, return_tensors="pt").input_ids
        plain = base.generate(prompt, max_new_tokens=40, do_sample=False)
        speculative = base.generate(prompt, max_new_tokens=40, do_sample=False, assistant_model=speculator)
        assert torch.equal(plain, speculative)
        if fast:
            assert speculator.speculation_metrics.mean_tokens_per_step > 2

    # The model card reports the final held-out figures of trainer_state.json, and its usage snippet runs.
    card = (output_dir / "README.md").read_text()
    for i in range(3):
        assert f"| {i} | {final[f'eval/head_{i}_acc']:.3f} | {acceptance[i]:.3f} |" in card
    assert f"**{final['eval/tokens_per_step']:.3f}**" in card and f"after step {final['step']})" in card
    assert f"| `draft_vocab_size` | `{draft_vocab_size}` |" in card
    snippet = re.search(r"```python\n(.*?)```", card, re.DOTALL).group(1)
    namespace = {}
    exec(snippet.replace("max_new_tokens=64", "max_new_tokens=8"), namespace)
    assert namespace["speculator"].speculation_metrics.num_steps > 0


LSTM_KEYS = sorted(
    [f"speculator.{gate}_proj.{j}.weight" for gate in ("forget", "input", "output", "cell") for j in (0, 1)]
    + ["speculator.forget_emb.0.weight", "speculator.head.0.weight"]
    + [f"speculator.{norm}.0.{p}" for norm in ("cell_ln", "state_ln") for p in ("weight", "bias")]
)


def test_an_lstm_speculator_learns_the_toy_language(toy, tmp_path):
    """`architecture="lstm"`: Arctic's LSTM heads, tied, trained by the same loop to held-out acceptance near 1, saved
    with each shared tensor once, and lossless in generate()."""
    args = toy_args(toy, tmp_path / "run", batch_size=64, epochs=3, architecture="lstm")
    output_dir = train(args)
    final = [entry for entry in json.loads((output_dir / "trainer_state.json").read_text())["log_history"]
             if "eval/loss" in entry][-1]  # fmt: skip
    assert min(final[f"eval/head_{i}_acceptance"] for i in range(3)) > 0.95
    config = json.loads((output_dir / "config.json").read_text())
    assert (config["method"], config["input_hidden_dim"], config["tie_weights"], config["tie_lstm_embs"]) == (
        "sum_lstm", 64, True, True)  # fmt: skip
    assert sorted(weights(output_dir)) == LSTM_KEYS
    speculator = AutoModel.from_pretrained(output_dir)
    base = AutoModelForCausalLM.from_pretrained(args.base_model)
    prompt = char_tokenizer()("qrstuvwx", return_tensors="pt").input_ids
    plain = base.generate(prompt, max_new_tokens=40, do_sample=False)
    assert torch.equal(base.generate(prompt, max_new_tokens=40, do_sample=False, assistant_model=speculator), plain)
    assert speculator.speculation_metrics.mean_tokens_per_step > 2
    assert (output_dir / "README.md").read_text().startswith("---") and "# Arctic LSTM speculator for" in (
        output_dir / "README.md").read_text()  # fmt: skip


# Killed from outside and resumed: exactly the unbroken run.


def kill_settings(toy, output_dir, cache) -> SpeculatorTrainingArguments:
    """Many small target batches and many checkpoints, so that a kill from outside lands inside either phase. Tied
    heads: a tied checkpoint stores only the shared tensors, and resuming must restore them all."""
    return toy_args(toy, output_dir, targets_cache=str(cache), generation_batch_size=4, new_tokens=24,
                    batch_size=16, save_every=10, tie_weights=True)  # fmt: skip


@pytest.fixture(scope="module")
def unbroken(toy, tmp_path_factory):
    """The reference: one uninterrupted run, computing its own targets."""
    root = tmp_path_factory.mktemp("unbroken")
    train(kill_settings(toy, root / "run", root / "cache"))
    return root


def kill_when(args: SpeculatorTrainingArguments, ready) -> None:
    """Runs the CLI and SIGKILLs it from outside as soon as `ready()` holds."""
    process = subprocess.Popen(cli_command(args), env=CLI_ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        while process.poll() is None and not ready():
            time.sleep(0.002)
        killed = process.poll() is None
        process.send_signal(signal.SIGKILL)
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert killed, f"the run ended before it could be killed (exit {process.returncode}): {stderr[-2000:]}"
    assert process.returncode == -signal.SIGKILL


def test_killed_while_training_resumes_to_the_unbroken_run(toy, unbroken, tmp_path):
    # The unbroken run's cache is complete: this run goes straight to training.
    args = kill_settings(toy, tmp_path / "run", unbroken / "cache")
    kill_when(args, lambda: latest_checkpoint(args.output_dir) is not None)
    checkpoint = latest_checkpoint(args.output_dir)
    assert not (tmp_path / "run" / "model.safetensors").exists()  # killed before the end
    steps = json.loads((checkpoint / "trainer_state.json").read_text())
    assert 0 < steps["step"] < steps["total_steps"]
    with pytest.raises(ValueError, match="already holds a training run. Pass --resume"):
        train(args)

    train(dataclasses.replace(args, resume=True))
    assert_same_weights(tmp_path / "run", unbroken / "run")
    for key in ("train/loss", "train/head_2_acceptance", "eval/loss"):
        assert history(tmp_path / "run", key) == history(unbroken / "run", key)
    assert len(history(tmp_path / "run", "train/loss")) == steps["total_steps"]


def test_killed_while_computing_targets_reuses_them_and_resumes_to_the_unbroken_run(toy, unbroken, tmp_path):
    cache = tmp_path / "cache"
    args = kill_settings(toy, tmp_path / "run", cache)
    complete = sorted(p.name for p in (unbroken / "cache").glob("*.pt"))
    kill_when(args, lambda: len(list(cache.glob("[!.]*.pt"))) >= 3)
    assert latest_checkpoint(args.output_dir) is None  # still computing targets when killed
    written = {p.name: p.stat().st_mtime_ns for p in cache.glob("[!.]*.pt")}
    assert 3 <= len(written) < len(complete) and set(written) <= set(complete)

    train(dataclasses.replace(args, resume=True))
    # The files of the killed run are used as they are (not computed again), and the rest is added.
    assert {name: (cache / name).stat().st_mtime_ns for name in written} == written
    assert sorted(p.name for p in cache.glob("*.pt")) == complete  # the killed run's partial file is gone too
    assert_same_weights(tmp_path / "run", unbroken / "run")
    assert history(tmp_path / "run", "train/loss") == history(unbroken / "run", "train/loss")


def test_a_run_from_cached_targets_equals_the_run_that_computed_them_synthesized_prompts_included(toy, tmp_path):
    """The speculator's initialisation and data order must not depend on what the cache already held."""
    base = tmp_path / "base"
    base.mkdir()
    for path in (toy / "base").iterdir():
        (base / path.name).write_bytes(path.read_bytes())
    # An end-of-turn token the toy base writes (it ends every user turn it writes at the next "z").
    generation = json.loads((base / "generation_config.json").read_text())
    (base / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": [LETTERS[-1]]}))
    settings = dict(base_model=str(base), targets_cache=str(tmp_path / "cache"), synthesize_prompts=1, epochs=0.3)
    train(toy_args(toy, tmp_path / "cold", **settings))
    train(toy_args(toy, tmp_path / "warm", **settings))
    assert_same_weights(tmp_path / "cold", tmp_path / "warm")


# Two processes and gradient accumulation: the same steps as one large batch.


class FirstStepGradients:
    """Stands in for torch.optim.AdamW and keeps the gradients of the first real optimizer step."""

    def __init__(self):
        recorder = self
        self.grads = None

        class Recording(torch.optim.AdamW):
            def step(self, *args, **kwargs):
                if recorder.grads is None:
                    recorder.grads = {id(p): p.grad.clone() for g in self.param_groups for p in g["params"]}
                return super().step(*args, **kwargs)

        self.optimizer_class = Recording


RECORDING_SCRIPT = '''
import os, runpy, sys
import torch

class Recording(torch.optim.AdamW):
    recorded = False

    def step(self, *args, **kwargs):
        if not self.recorded:
            self.recorded = True
            grads = [p.grad.clone() for g in self.param_groups for p in g["params"]]
            torch.save(grads, os.environ["GRADIENTS"] + "." + os.environ["RANK"] + ".pt")
        return super().step(*args, **kwargs)

torch.optim.AdamW = Recording
sys.argv[0] = "hf_mlp_speculator.training"
runpy.run_module("hf_mlp_speculator.training", run_name="__main__")
'''


def test_two_processes_match_one_with_the_same_global_batch(toy, tmp_path, monkeypatch):
    """torchrun with 2 CPU processes (gloo) and half the batch each: the same first gradient (the token mean over the
    global batch), loss history and weights as one process. The two compute the targets between them."""
    settings = dict(epochs=0.15, max_grad_norm=0.0)  # raw gradients (a wrong scale would survive clipping and Adam)
    recorder = FirstStepGradients()
    monkeypatch.setattr(torch.optim, "AdamW", recorder.optimizer_class)
    train(toy_args(toy, tmp_path / "one", batch_size=32, **settings))
    monkeypatch.undo()
    one_process = list(recorder.grads.values())

    script = tmp_path / "recording.py"
    script.write_text(RECORDING_SCRIPT)
    args = toy_args(toy, tmp_path / "two", batch_size=16, targets_cache=str(tmp_path / "cache"), **settings)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(script), *as_flags(args)]
    env = {**CLI_ENV, "ACCELERATE_USE_CPU": "true", "GRADIENTS": str(tmp_path / "grads")}
    two = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert two.returncode == 0, two.stderr[-3000:]

    for rank in (0, 1):
        grads = torch.load(tmp_path / f"grads.{rank}.pt", weights_only=True)
        assert len(grads) == len(one_process)
        for got, expected in zip(grads, one_process):
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-7)
    losses_one, losses_two = history(tmp_path / "one", "train/loss"), history(tmp_path / "two", "train/loss")
    assert len(losses_one) >= 5 and losses_two == pytest.approx(losses_one, rel=1e-5)
    one, two = weights(tmp_path / "one"), weights(tmp_path / "two")
    assert all(torch.allclose(two[k], one[k], atol=1e-5) for k in one)
    # Both processes' share of the targets landed in the one cache the two read.
    assert sorted(p.name for p in (tmp_path / "cache").glob("*.pt")) == sorted(
        p.name for p in (toy / "cache").glob("*.pt")
    )


def capture_run(monkeypatch, args):
    """Trains, keeping what an independent computation of the first step needs: the initial speculator, the targets,
    and the gradients of the first optimizer step."""
    captured, recorder = {}, FirstStepGradients()
    real_make, real_data = loop.make_speculator, loop.build_training_data

    def make(*a, **kw):
        speculator = real_make(*a, **kw)
        captured["initial"], captured["model"] = copy.deepcopy(speculator), speculator
        return speculator

    def data(*a, **kw):
        captured["data"] = real_data(*a, **kw)
        return captured["data"]

    monkeypatch.setattr(loop, "make_speculator", make)
    monkeypatch.setattr(loop, "build_training_data", data)
    monkeypatch.setattr(torch.optim, "AdamW", recorder.optimizer_class)
    train(args)
    monkeypatch.undo()
    names = {id(p): name for name, p in captured["model"].named_parameters()}
    captured["grads"] = {names[i]: g for i, g in recorder.grads.items()}
    return captured


def test_gradient_accumulation_and_the_loss_are_token_means_over_the_global_batch(toy, tmp_path, monkeypatch):
    """Short continuations make the heads' positions differ (a sequence's last rows have fewer heads) and the
    micro-batches' too; the loss is still the mean over the global batch's positions of each head, weighted by
    head_loss_decay**i, whether it is computed at once or in two micro-steps."""
    settings = dict(data=None, text_tokens=0, new_tokens=8, eval_new_tokens=8, loss="hard", head_loss_decay=0.5,
                    max_grad_norm=0.0, epochs=0.4)  # fmt: skip
    whole = capture_run(monkeypatch, toy_args(toy, tmp_path / "whole", batch_size=32, **settings))
    accumulated = capture_run(monkeypatch, toy_args(toy, tmp_path / "accumulated", batch_size=16,
                                                    gradient_accumulation_steps=2, **settings))  # fmt: skip

    # The first global batch, and what one large batch's token-mean loss gives, computed here.
    targets = whole["data"].train
    batch = targets.batch(Epochs(targets, 32, seed=0).rows(0), 3)
    valid = batch.labels != -100
    counts = valid.sum(1)
    assert len(set(counts.tolist())) > 1  # the heads have different numbers of positions...
    assert not torch.equal(valid[:, :16].sum(1), valid[:, 16:].sum(1))  # ...and so do the two micro-batches
    model = whole["initial"]
    logits = model(batch.states[:, None], batch.input_ids).logits[:, :, 0]
    head_losses = torch.stack([F.cross_entropy(logits[i][valid[i]], batch.labels[i][valid[i]]) for i in range(3)])
    (head_losses * torch.tensor([1.0, 0.5, 0.25])).sum().backward()
    expected = {name: p.grad for name, p in model.named_parameters()}

    for run, output_dir in ((whole, "whole"), (accumulated, "accumulated")):
        assert run["grads"].keys() == expected.keys()
        for name, grad in run["grads"].items():
            torch.testing.assert_close(grad, expected[name], rtol=1e-4, atol=1e-7, msg=f"{output_dir}: {name}")
        first = json.loads((tmp_path / output_dir / "trainer_state.json").read_text())["log_history"][1]
        assert first["step"] == 1
        for i in range(3):
            assert first[f"train/head_{i}_loss"] == pytest.approx(head_losses[i].item(), rel=1e-5)
        assert first["train/loss"] == pytest.approx(head_losses.sum().item(), rel=1e-5)

    losses_whole, losses_accumulated = history(tmp_path / "whole", "train/loss"), history(tmp_path / "accumulated",
                                                                                         "train/loss")  # fmt: skip
    assert len(losses_whole) >= 5 and losses_accumulated == pytest.approx(losses_whole, rel=1e-5)
    a, b = weights(tmp_path / "whole"), weights(tmp_path / "accumulated")
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)


# The output folder belongs to one run.


@pytest.fixture(scope="module")
def finished(toy, tmp_path_factory):
    args = toy_args(toy, tmp_path_factory.mktemp("finished") / "run", data=None, text_tokens=0, new_tokens=8,
                    eval_new_tokens=8, epochs=0.4, save_every=2)  # fmt: skip
    train(args)
    return args


def snapshot(folder) -> dict:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in Path(folder).rglob("*")}


def test_a_fresh_run_refuses_a_folder_holding_another_run(finished):
    before = snapshot(finished.output_dir)
    assert latest_checkpoint(finished.output_dir) is not None
    with pytest.raises(ValueError, match=r"already holds a training run\. Pass --resume to continue it, or choose "
                                         r"another --output-dir"):  # fmt: skip
        train(dataclasses.replace(finished, seed=1))
    assert snapshot(finished.output_dir) == before  # nothing pruned, nothing overwritten


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"n_predict": 2}, ["n_predict: 3 then, 2 now"]),
        ({"inner_dim": 16}, ["inner_dim: 32 then, 16 now"]),
        ({"batch_size": 16}, ["batch_size: 32 then, 16 now"]),
        ({"n_predict": 2, "inner_dim": 16, "batch_size": 16},
         ["batch_size: 32 then, 16 now", "inner_dim: 32 then, 16 now", "n_predict: 3 then, 2 now"]),
    ],
)  # fmt: skip
def test_resuming_with_other_settings_names_them(finished, changes, named):
    before = snapshot(finished.output_dir)
    with pytest.raises(ValueError) as error:
        train(dataclasses.replace(finished, resume=True, **changes))
    message = str(error.value)
    assert message.startswith(f"--resume would continue the run in {finished.output_dir} with other settings (")
    assert "; ".join(named) in message and "train into another --output-dir" in message
    assert snapshot(finished.output_dir) == before


def test_resuming_a_finished_run_keeps_its_result(finished, tmp_path):
    copy_dir = tmp_path / "run"
    subprocess.run(["cp", "-a", finished.output_dir, str(copy_dir)], check=True)
    expected_weights, expected_history = weights(copy_dir), history(copy_dir, "train/loss")
    # Where the output goes and how much is logged may change on resume.
    train(dataclasses.replace(finished, output_dir=str(copy_dir), resume=True, save_total_limit=3, report_to="none"))
    assert weights(copy_dir).keys() == expected_weights.keys()
    assert all(torch.equal(weights(copy_dir)[k], v) for k, v in expected_weights.items())
    assert history(copy_dir, "train/loss") == expected_history


def test_a_folder_with_checkpoints_but_no_run_record_is_refused(toy, tmp_path):
    (tmp_path / "run" / "checkpoint-3").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"holds checkpoint-3 from a run that recorded no run\.json.*Train into an "
                                         r"empty folder, or remove them"):  # fmt: skip
        train(toy_args(toy, tmp_path / "run"))


def test_timing_a_step_for_the_budget_runs_the_update_and_then_undoes_it(toy, tmp_path, monkeypatch):
    """The budget's step time includes the optimizer update, and the run then starts from the weights and the
    optimizer state it would have had without that timing: its first step equals the unbudgeted run's."""
    updates = []
    real_step = torch.optim.AdamW.step

    def counted(self, *args, **kwargs):
        updates.append(1)
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", counted)
    settings = dict(data=None, text_tokens=0, new_tokens=8, eval_new_tokens=8, epochs=0.4, warmup_steps=1)
    train(toy_args(toy, tmp_path / "plain", **settings))
    unbudgeted_updates = len(updates)
    updates.clear()
    train(toy_args(toy, tmp_path / "budget", max_train_minutes=0.1, **settings))
    budgeted_updates = len(updates)
    steps = json.loads((tmp_path / "budget" / "trainer_state.json").read_text())["total_steps"]
    assert budgeted_updates == steps + TIMED_STEPS  # the timed updates, undone, then the run's own
    assert unbudgeted_updates == json.loads((tmp_path / "plain" / "trainer_state.json").read_text())["total_steps"]
    first = {run: history(tmp_path / run, "train/loss")[1] for run in ("plain", "budget")}
    assert first["budget"] == first["plain"]


# Checkpoints without the optimizer's state, checkpoint writes that fail, and damaged checkpoints.


def run_cli(args, capsys) -> str:
    """The command line's one line of error for `args` (exit status 2, no traceback)."""
    assert cli.main(["train", *as_flags(args)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert line.startswith("hf-mlp-speculator train: error: "), err
    return line.removeprefix("hf-mlp-speculator train: error: ")


def test_save_only_model_leaves_the_optimizer_out_and_resume_refuses_it(finished, tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    args = dataclasses.replace(finished, output_dir=str(run), save_only_model=True)
    train(args)
    assert_same_weights(run, finished.output_dir)  # what checkpoints hold changes nothing of the run
    for name in ("checkpoint-2", "checkpoint-4"):
        assert sorted(p.name for p in (run / name).iterdir()) == ["config.json", "model.safetensors",
                                                                 "trainer_state.json"]  # fmt: skip
        # For evaluating or picking a checkpoint: the same speculator as a full checkpoint's.
        assert_same_weights(run / name, Path(finished.output_dir) / name)
        assert AutoModel.from_pretrained(run / name).config.n_predict == 3

    def not_reached(*a, **kw):
        raise AssertionError("the targets were computed before the checkpoint was refused")

    monkeypatch.setattr(loop, "build_training_data", not_reached)
    expected = (
        f"--resume cannot continue from {run}/checkpoint-4: it holds no optimizer.pt (checkpoints written with "
        "--save-only-model leave it out), and without the optimizer's state the run would not continue as it would "
        "have. Such checkpoints are for evaluating or picking a speculator (from_pretrained loads them): to train "
        "further, start a run into another --output-dir, without --save-only-model to resume it later."
    )
    for resumed in (dataclasses.replace(args, resume=True), dataclasses.replace(args, resume=True,
                                                                                save_only_model=False)):  # fmt: skip
        with pytest.raises(ValueError) as error:
            train(resumed)
        assert str(error.value) == expected
    assert run_cli(dataclasses.replace(args, resume=True), capsys) == expected


def files(folder) -> dict:
    return {p.name: p.read_bytes() for p in Path(folder).iterdir()}


NO_SPACE = OSError(errno.ENOSPC, "No space left on device")
SHORT_WRITE = "[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"  # torch.save on a full disk


@pytest.mark.parametrize(
    "error, reason",
    [(NO_SPACE, "No space left on device"),
     (RuntimeError(SHORT_WRITE), f"RuntimeError: {SHORT_WRITE}, a short write (is the disk full?)")],
    ids=["ENOSPC", "torch-short-write"],
)  # fmt: skip
def test_a_failed_checkpoint_write_keeps_the_previous_checkpoint_and_says_so(finished, tmp_path, monkeypatch, error,
                                                                            reason):  # fmt: skip
    run = tmp_path / "run"
    kept = {}
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        if Path(f).parent.name == ".tmp-checkpoint-4":
            kept.update(files(run / "checkpoint-2"))
            Path(f).write_bytes(b"half a file")  # what a full disk leaves
            raise error
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    args = dataclasses.replace(finished, output_dir=str(run))
    with pytest.raises(OSError) as raised:
        train(args)
    assert str(raised.value) == (
        f"Writing checkpoint {run}/checkpoint-4 failed ({reason}), and nothing of it is left behind. The previous "
        "checkpoint, checkpoint-2, is kept whole; --resume continues from it. To finish the run, free space on that "
        "disk, train into another --output-dir or pass --save-only-model to leave the optimizer's state, most of a "
        "checkpoint, out."
    )
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint-2", "run.json"]  # no hidden half-written folder
    assert kept and files(run / "checkpoint-2") == kept

    monkeypatch.undo()  # space freed
    train(dataclasses.replace(args, resume=True))
    assert_same_weights(run, finished.output_dir)


def test_a_failed_final_save_leaves_no_partial_speculator_and_says_so(finished, tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    real_save_pretrained = MLPSpeculatorPreTrainedModel.save_pretrained

    def save_pretrained(self, folder, *args, **kwargs):
        real_save_pretrained(self, folder, *args, **kwargs)
        if Path(folder).name == ".tmp-final":
            raise NO_SPACE  # after writing the weights: a partial final speculator is there to be cleaned up
        return None

    monkeypatch.setattr(MLPSpeculatorPreTrainedModel, "save_pretrained", save_pretrained)
    args = dataclasses.replace(finished, output_dir=str(run))
    assert run_cli(args, capsys) == (
        f"Writing the final speculator into {run} failed (No space left on device), and nothing of it is left behind. "
        "The previous checkpoint, checkpoint-4, is kept whole; --resume continues from it. To finish the run, free "
        "space on that disk or train into another --output-dir."
    )
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint-2", "checkpoint-4", "run.json"]

    monkeypatch.undo()
    train(dataclasses.replace(args, resume=True))
    assert_same_weights(run, finished.output_dir)


def truncated(path: Path) -> bytes:
    return path.read_bytes()[: path.stat().st_size // 2]


@pytest.mark.parametrize(
    "name, damage, reason",
    [("checkpoint-4/optimizer.pt", truncated, r"RuntimeError: PytorchStreamReader failed reading zip archive: [^.]+"),
     ("checkpoint-4/model.safetensors", truncated, r"\w+Error: [^.]+"),
     ("checkpoint-4/trainer_state.json", lambda p: b"", re.escape("JSONDecodeError: Expecting value: line 1 column 1 "
                                                                 "(char 0)")),
     ("checkpoint-4/trainer_state.json", lambda p: b"[]", re.escape("ValueError: a JSON list, not an object")),
     ("checkpoint-4/config.json", lambda p: b"", re.escape("JSONDecodeError: Expecting value: line 1 column 1 "
                                                           "(char 0)"))],
)  # fmt: skip
def test_a_damaged_checkpoint_names_its_file_and_the_fix(finished, tmp_path, capsys, name, damage, reason):
    run = tmp_path / "run"
    subprocess.run(["cp", "-a", finished.output_dir, str(run)], check=True)
    (run / name).write_bytes(damage(run / name))
    args = dataclasses.replace(finished, output_dir=str(run), resume=True)
    fix = (f"The checkpoint is damaged: delete {run}/checkpoint-4 and --resume again to continue from checkpoint-2, "
           "or train into another --output-dir.")  # fmt: skip
    assert re.fullmatch(rf"{re.escape(str(run / name))} cannot be read \({reason}\)\. {re.escape(fix)}",
                        run_cli(args, capsys))  # fmt: skip

    # The fix works: the run continues from the checkpoint before, to the same speculator.
    subprocess.run(["rm", "-r", str(run / "checkpoint-4")], check=True)
    train(args)
    assert_same_weights(run, finished.output_dir)


def test_a_damaged_run_record_names_its_file_and_the_fix(finished, tmp_path, capsys):
    run = tmp_path / "run"
    subprocess.run(["cp", "-a", finished.output_dir, str(run)], check=True)
    (run / "run.json").write_text("")
    for resume in (True, False):
        assert run_cli(dataclasses.replace(finished, output_dir=str(run), resume=resume), capsys) == (
            f"{run}/run.json cannot be read (JSONDecodeError: Expecting value: line 1 column 1 (char 0)). It records "
            f"the settings of the run in {run}: restore it, or train into another --output-dir."
        )
