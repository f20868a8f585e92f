"""The trainer on tiny models: the loss pieces, both stages, the toy language, kill-and-resume, 2 processes, the CLI."""

import dataclasses
import json
import math
import os
import random
import re
import string
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModel, AutoModelForCausalLM

from conftest import make_verifier
from hf_mlp_speculator.training import (
    KILL_ENV,
    SpeculatorTrainingArguments,
    head_statistics,
    latest_checkpoint,
    lr_multiplier,
    speculator_batch,
    train,
)
from tiny_tokenizer import char_tokenizer


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Tiny models run far faster on one thread, and on a loaded machine a second one mostly waits for a core.
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
    """A corpus of the toy language, and a tiny Llama (with its tokenizer) that has learned it."""
    root = tmp_path_factory.mktemp("toy")
    rng = random.Random(0)
    (root / "corpus.txt").write_text("\n\n".join(toy_document(rng) for _ in range(300)))
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
        base_model=str(toy / "base"), data=[str(toy / "corpus.txt")], output_dir=str(output_dir), inner_dim=32,
        seq_length=32, batch_size=4, stage1_steps=6, stage2_steps=4, warmup_steps=2, learning_rate=3e-3,
        stage2_prompt_length=8, stage2_new_tokens=16, eval_sequences=4, eval_new_tokens=16, eval_fraction=0.1,
        save_every=0, logging_steps=1, report_to="none",
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


def run_cli(args, *extra, env=None, module="hf_mlp_speculator.cli", launcher=(sys.executable, "-m")):
    command = [*launcher, module, *(["train"] if module.endswith("cli") else []), *as_flags(args), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)


def history(output_dir, key):
    log = json.loads((Path(output_dir) / "trainer_state.json").read_text())["log_history"]
    return {entry["step"]: entry[key] for entry in log if key in entry}


def test_lr_multiplier_follows_both_stages():
    args = SpeculatorTrainingArguments(base_model="x", data=["x"], stage1_steps=10, stage2_steps=5, warmup_steps=2)
    values = [lr_multiplier(step, args) for step in range(15)]
    assert values[:2] == [0.5, 1.0]  # warmup to the peak
    assert values[2] == pytest.approx(1.0) and values[9] == pytest.approx(
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 7 / 8))
    )
    assert values[10:12] == [pytest.approx(0.05), pytest.approx(0.1)]  # stage 2 warms up to 0.1x ...
    assert values[14] == pytest.approx(0.01 + 0.09 * 0.5 * (1 + math.cos(math.pi * 2 / 3)))  # ... and decays to 0.01x


def test_speculator_batch_aligns_heads_with_their_targets():
    base = make_verifier("gpt2")
    tokens = torch.randint(6, 96, (2, 12))
    tokens[0, 7] = 5  # an end of sequence inside the learned part of row 0
    hidden, input_ids, labels = speculator_batch(base, tokens, n_predict=3, start=2, eos_token_id=5)
    expected_hidden = base(tokens[:, :8], output_hidden_states=True).hidden_states[-1][:, 2:]
    assert torch.equal(hidden, expected_hidden) and hidden.shape == (2, 6, 64)
    assert torch.equal(input_ids, tokens[:, 3:])
    for head in range(3):  # the state at t learns token t + 2 + head
        assert torch.equal(labels[head, 1], tokens[1, 4 + head : 10 + head])
        # Row 0: the eos at 7 is learned, the padding after it is not.
        kept = [position for position in range(4 + head, 10 + head) if position <= 7]
        assert labels[head, 0].tolist() == tokens[0, kept].tolist() + [-100] * (6 - len(kept))


def test_head_statistics_counts_acceptance_as_heads_all_right():
    labels = torch.tensor([[[1, 2, 3, -100]], [[1, 2, 3, -100]]])  # [heads, batch, positions]
    predictions = torch.tensor([[[1, 2, 0, 0]], [[1, 0, 3, 3]]])
    logits = torch.nn.functional.one_hot(predictions, 4).float() * 20
    mean_losses, stats = head_statistics(logits, labels)
    hits, accepted, counts = stats[1:].tolist()
    assert hits == [2, 2] and accepted == [2, 1] and counts == [3, 3]
    assert mean_losses[0].item() == pytest.approx(20 / 3, abs=1e-4)  # one wrong position at a margin of 20


def test_toy_language_both_stages_and_the_published_output(toy, tmp_path):
    """Each stage lowers the held-out loss; the heads end near-perfect and draft > 2 tokens per step in generate()."""
    args = toy_args(toy, tmp_path / "run", stage1_steps=40, stage2_steps=15, warmup_steps=5, learning_rate=1e-2)
    output_dir = train(args)
    losses = history(output_dir, "eval/loss")
    assert losses[0] > losses[40] > losses[55]
    log = json.loads((output_dir / "trainer_state.json").read_text())["log_history"][-1]
    acceptance = [log[f"eval/head_{i}_acceptance"] for i in range(3)]
    assert min(acceptance) > 0.95 and log["eval/tokens_per_step"] == pytest.approx(1 + sum(acceptance))

    # The published layout, loadable by AutoModel, naming its base model.
    speculator = AutoModel.from_pretrained(output_dir)
    assert speculator.config.base_model_name_or_path == args.base_model
    assert sorted(load_file(output_dir / "model.safetensors")) == sorted(
        f"speculator.{name}.{i}.{p}" for name, p in [("emb", "weight"), ("proj", "weight"), ("head", "weight"),
                                                     ("ln", "weight"), ("ln", "bias")] for i in range(3)
    )  # fmt: skip

    base = AutoModelForCausalLM.from_pretrained(args.base_model)
    prompt = char_tokenizer()("qrstuvwx", return_tensors="pt").input_ids
    plain = base.generate(prompt, max_new_tokens=40, do_sample=False)
    speculative = base.generate(prompt, max_new_tokens=40, do_sample=False, assistant_model=speculator)
    assert torch.equal(plain, speculative)
    assert speculator.speculation_metrics.mean_tokens_per_step > 2

    # The model card reports the held-out acceptance, and its usage snippet runs.
    card = (output_dir / "README.md").read_text()
    assert f"| 2 | {log['eval/head_2_acc']:.3f} | {acceptance[2]:.3f} |" in card
    assert f"**{log['eval/tokens_per_step']:.3f}**" in card
    snippet = re.search(r"```python\n(.*?)```", card, re.DOTALL).group(1)
    namespace = {}
    exec(snippet.replace("max_new_tokens=64", "max_new_tokens=8"), namespace)
    assert namespace["speculator"].speculation_metrics.num_steps > 0


@pytest.fixture(scope="module")
def toy_prompts(toy):
    """Stage-2 prompts of different lengths, one per record."""
    rng = random.Random(1)
    path = toy / "prompts.jsonl"
    path.write_text("".join(json.dumps({"text": toy_document(rng)[: rng.randint(3, 12)]}) + "\n" for _ in range(80)))
    return path


@pytest.mark.parametrize("separate_prompts", [False, True], ids=["prompts-from-data", "stage2-data"])
def test_resume_after_sigkill_is_exact(toy, toy_prompts, tmp_path, separate_prompts):
    """
    The CLI killed in the middle of writing a checkpoint leaves the previous one intact; resumed from it, the run ends
    with the same weights, bit for bit, and the same loss trajectory as one unbroken run.
    """
    # Tied heads too: a tied checkpoint stores only the shared tensors, and resuming must restore them all.
    extra = {"stage2_data": [str(toy_prompts)]} if separate_prompts else {}
    # Checkpoint 5 falls inside stage 2's second generation (steps 5-7), so the resumed run must sample that
    # generation's continuations again, identically, and train on the rest of them.
    extra.update(stage1_steps=1, stage2_steps=10, stage2_steps_per_generation=3, save_every=5, tie_weights=True)
    args = toy_args(toy, tmp_path / "killed", **extra)
    killed = run_cli(args, env={KILL_ENV: "save:10"})
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert latest_checkpoint(args.output_dir).name == "checkpoint-5"
    assert (tmp_path / "killed" / ".tmp-checkpoint-10" / "model.safetensors").is_file()  # incomplete, and ignored
    train(dataclasses.replace(args, resume=True))
    train(toy_args(toy, tmp_path / "unbroken", **extra))

    weights, expected = (
        load_file(tmp_path / "killed" / "model.safetensors"),
        load_file(tmp_path / "unbroken" / "model.safetensors"),
    )
    assert weights.keys() == expected.keys() and all(torch.equal(weights[k], expected[k]) for k in weights)
    assert history(tmp_path / "killed", "train/loss") == history(tmp_path / "unbroken", "train/loss")
    assert sorted(p.name for p in (tmp_path / "killed").glob("*checkpoint-*")) == ["checkpoint-10", "checkpoint-5"]


def test_two_processes_match_one_with_the_same_global_batch(toy, tmp_path):
    """torchrun with 2 CPU processes (gloo) and half the batch each follows the 1-process loss trajectory."""
    settings = dict(stage2_temperature=0.0, stage1_steps=4, stage2_steps=2)  # greedy stage 2: no per-process sampling
    train(toy_args(toy, tmp_path / "one", **settings))
    launcher = (sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m")
    two = run_cli(toy_args(toy, tmp_path / "two", batch_size=2, **settings), module="hf_mlp_speculator.training",
                  launcher=launcher, env={"ACCELERATE_USE_CPU": "true"})  # fmt: skip
    assert two.returncode == 0, two.stderr[-2000:]
    losses_one, losses_two = history(tmp_path / "one", "train/loss"), history(tmp_path / "two", "train/loss")
    assert len(losses_one) == 6 and losses_two == pytest.approx(losses_one, rel=1e-5)
    assert losses_one[6] < losses_one[1]
    weights, expected = (
        load_file(tmp_path / "two" / "model.safetensors"),
        load_file(tmp_path / "one" / "model.safetensors"),
    )
    assert all(torch.allclose(weights[k], expected[k], atol=1e-5) for k in weights)


def test_generating_several_steps_at_once_trains_on_the_same_continuations(toy, toy_prompts, tmp_path):
    """Stage 2 continues the prompts of several steps in one generate() call; the steps see the same data."""
    settings = dict(stage2_data=[str(toy_prompts)], stage2_temperature=0.0, stage1_steps=2, stage2_steps=5)
    train(toy_args(toy, tmp_path / "one", stage2_steps_per_generation=1, **settings))
    train(toy_args(toy, tmp_path / "many", stage2_steps_per_generation=3, **settings))
    losses_one, losses_many = history(tmp_path / "one", "train/loss"), history(tmp_path / "many", "train/loss")
    assert len(losses_one) == 7 and losses_many == pytest.approx(losses_one, rel=1e-5)


def test_gradient_accumulation_matches_the_whole_batch_at_once(toy, toy_prompts, tmp_path):
    """Two micro-steps of 2 sequences make the same optimizer steps as one of 4, in both stages."""
    settings = dict(stage2_data=[str(toy_prompts)], stage2_temperature=0.0, stage1_steps=3, stage2_steps=3,
                    stage2_steps_per_generation=2)  # fmt: skip
    train(toy_args(toy, tmp_path / "whole", batch_size=4, **settings))
    train(toy_args(toy, tmp_path / "accumulated", batch_size=2, gradient_accumulation_steps=2, **settings))
    whole, accumulated = history(tmp_path / "whole", "train/loss"), history(tmp_path / "accumulated", "train/loss")
    assert len(whole) == 6 and accumulated == pytest.approx(whole, rel=1e-5)
    weights, expected = (
        load_file(tmp_path / "accumulated" / "model.safetensors"),
        load_file(tmp_path / "whole" / "model.safetensors"),
    )
    assert all(torch.allclose(weights[k], expected[k], atol=1e-5) for k in weights)


def test_bad_settings_say_what_to_do():
    with pytest.raises(ValueError, match=r"seq_length=4 is too short for n_predict=3.*at least n_predict \+ 2 = 5"):
        SpeculatorTrainingArguments(base_model="x", data=["x"], seq_length=4)
    with pytest.raises(ValueError, match="No training data given"):
        SpeculatorTrainingArguments(base_model="x", data=[])
    with pytest.raises(ValueError, match="stage2_prompt_length=64 exceeds seq_length=32"):
        SpeculatorTrainingArguments(base_model="x", data=["x"], seq_length=32)
    with pytest.raises(ValueError, match="stage2_steps_per_generation must be >= 1, got 0"):
        SpeculatorTrainingArguments(base_model="x", data=["x"], stage2_steps_per_generation=0)
