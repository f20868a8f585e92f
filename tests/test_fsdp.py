"""FSDP training on CPU: two processes (gloo) with the speculator sharded match one process, resume exactly after a
SIGKILL, and publish a whole speculator that loads and decodes losslessly; processes that accelerate does not join are
refused."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch
from conftest import GLOO_EXIT_ABORT
from test_training import CLI_ENV, as_flags, assert_same_weights, history, one_thread, toy, toy_args, weights  # noqa: F401
from transformers import AutoModel, AutoModelForCausalLM

from hf_mlp_speculator.training import latest_checkpoint, loop, train

ENV = {**CLI_ENV, "ACCELERATE_USE_CPU": "true"}

# Records, on each process, what its parameters are at the first optimizer step: DTensor shards under FSDP.
RECORDING_SCRIPT = '''
import json, os, runpy, sys
import torch

class Recording(torch.optim.AdamW):
    recorded = False

    def step(self, *args, **kwargs):
        if not self.recorded:
            self.recorded = True
            params = [p for g in self.param_groups for p in g["params"]]
            local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
            record = {"types": sorted({type(p).__name__ for p in params}),
                      "local": sum(t.numel() for t in local), "whole": sum(p.numel() for p in params)}
            with open(os.environ["RECORD"] + "." + os.environ["RANK"] + ".json", "w") as f:
                json.dump(record, f)
        return super().step(*args, **kwargs)

torch.optim.AdamW = Recording
sys.argv[0] = "hf_mlp_speculator.training"
runpy.run_module("hf_mlp_speculator.training", run_name="__main__")
'''


def fsdp_settings(toy, output_dir, cache, **overrides):
    """Half of the single-process batch on each of two processes; checkpoints often, so that a kill lands mid-run.
    Tied heads: FSDP must gather and restore tensors that several heads share."""
    settings = dict(targets_cache=str(cache), batch_size=16, epochs=1, save_every=4, tie_weights=True, fsdp=True)
    return toy_args(toy, output_dir, **{**settings, **overrides})


def torchrun(args, tmp_path, **popen_kwargs):
    script = tmp_path / "recording.py"
    script.write_text(RECORDING_SCRIPT)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(script), *as_flags(args)]
    env = {**ENV, "RECORD": str(tmp_path / "params")}
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            **popen_kwargs)  # fmt: skip


def descendants(pid: int) -> list[int]:
    """The processes below `pid` (torchrun starts its workers in sessions of their own), from /proc."""
    children = {}
    for stat in os.listdir("/proc"):
        if stat.isdigit():
            try:
                fields = open(f"/proc/{stat}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            children.setdefault(int(fields[1]), []).append(int(stat))
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def kill_all(process) -> None:
    """SIGKILL to the launcher and every worker at once, as a machine that loses power would."""
    for pid in [process.pid, *descendants(process.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_to_end(args, tmp_path):
    process = torchrun(args, tmp_path)
    _, stderr = process.communicate(timeout=600)
    if process.returncode != 0 and exited_after_finishing(stderr, Path(args.output_dir)):
        return
    assert process.returncode == 0, stderr[-3000:]


def exited_after_finishing(stderr: str, output_dir: Path) -> bool:
    """Whether a worker died of gloo's abort at interpreter exit ("terminate called without an active exception",
    seen on torch 2.13 and 2.14 under load) after the run had saved everything: the run itself completed."""
    state = output_dir / "trainer_state.json"
    if GLOO_EXIT_ABORT not in stderr or not (state.is_file() and (output_dir / "model.safetensors").is_file()):
        return False
    state = json.loads(state.read_text())
    return state["step"] == state["total_steps"]


@pytest.fixture(scope="module")
def unbroken(toy, tmp_path_factory):
    """
    An uninterrupted FSDP run on two processes, the base sharded too while it computes the targets, and the targets
    one process computes alone.
    """
    root = tmp_path_factory.mktemp("fsdp")
    run_to_end(fsdp_settings(toy, root / "fsdp", root / "cache", fsdp_base=True), root)
    train(fsdp_settings(toy, root / "targets-one", root / "cache-one", fsdp=False, epochs=0.05))
    return root


# A few steps: over many, AdamW amplifies the last-bit differences of a sharded reduction (on torch 2.7.1 the loss
# histories part after about 30 steps, on 2.13 they do not within 60).
SHORT = 0.15


def compare_with_one_process(toy, cache, tmp_path, **settings):
    """An FSDP run and a one-process run with the same global batch on the same targets: same losses and weights."""
    run_to_end(fsdp_settings(toy, tmp_path / "fsdp", cache, epochs=SHORT, **settings), tmp_path)
    train(fsdp_settings(toy, tmp_path / "one", cache, fsdp=False, batch_size=32, epochs=SHORT, **settings))
    for rank in (0, 1):
        record = json.loads((tmp_path / f"params.{rank}.json").read_text())
        assert record["types"] == ["DTensor"]
        # Each process holds about half of every parameter (dim 0 split in two, rounded up).
        assert record["whole"] / 2 <= record["local"] <= record["whole"] / 2 + 1000
    losses_one, losses_two = history(tmp_path / "one", "train/loss"), history(tmp_path / "fsdp", "train/loss")
    assert len(losses_one) >= 5 and losses_two == pytest.approx(losses_one, rel=1e-5)
    one, two = weights(tmp_path / "one"), weights(tmp_path / "fsdp")
    assert one.keys() == two.keys()
    for key in one:
        torch.testing.assert_close(two[key], one[key], rtol=1e-4, atol=1e-5)
    return one


def test_the_sharded_base_computes_the_same_targets(unbroken):
    """Within float16 rounding of the stored states: a sharded forward may sum in another order."""
    sharded, whole = sorted((unbroken / "cache").glob("*.pt")), sorted((unbroken / "cache-one").glob("*.pt"))
    assert [p.name for p in sharded] == [p.name for p in whole] and len(whole) > 3  # the same fingerprint and inputs
    for a, b in zip(sharded, whole):
        a, b = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
        for name, tensor in b.get("targets", {}).items():
            torch.testing.assert_close(a["targets"][name], tensor, rtol=1e-3, atol=1e-3)  # float16 states


def test_two_sharded_processes_match_one_process(toy, unbroken, tmp_path):
    compare_with_one_process(toy, unbroken / "cache", tmp_path)


def test_untied_heads_shard_layer_by_layer_and_match_one_process(toy, unbroken, tmp_path):
    """Untied, each head's embedding, projection and output layer is an FSDP unit of its own."""
    assert "speculator.emb.1.weight" in compare_with_one_process(toy, unbroken / "cache", tmp_path, tie_weights=False)


def test_lstm_heads_shard_and_match_one_process(toy, unbroken, tmp_path):
    """An LSTM's embedding and output layer sit under several names each: FSDP shards, gathers and saves them once."""
    one = compare_with_one_process(toy, unbroken / "cache", tmp_path, architecture="lstm")
    assert "speculator.cell_proj.1.weight" in one and "speculator.head.1.weight" not in one


def test_the_published_speculator_is_whole_and_lossless(toy, unbroken):
    speculator = AutoModel.from_pretrained(unbroken / "fsdp")
    base = AutoModelForCausalLM.from_pretrained(toy / "base")
    assert not [p for p in speculator.parameters() if type(p) is not torch.nn.Parameter]
    prompt = torch.tensor([[40, 41, 42, 43, 44]])
    plain = base.generate(prompt, max_new_tokens=20, do_sample=False)
    assert torch.equal(base.generate(prompt, max_new_tokens=20, do_sample=False, assistant_model=speculator), plain)
    assert speculator.speculation_metrics.num_accepted_tokens > 0  # it learned the toy language


def test_killed_fsdp_run_resumes_to_the_unbroken_one(toy, unbroken, tmp_path):
    args = fsdp_settings(toy, tmp_path / "run", unbroken / "cache")  # the targets are cached: straight to training
    process = torchrun(args, tmp_path)
    try:
        while process.poll() is None and latest_checkpoint(args.output_dir) is None:
            time.sleep(0.002)
        killed = process.poll() is None
        kill_all(process)
        process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            kill_all(process)
    assert killed, "the run ended before it could be killed"
    checkpoint = latest_checkpoint(args.output_dir)
    steps = json.loads((checkpoint / "trainer_state.json").read_text())
    assert 0 < steps["step"] < steps["total_steps"]
    assert not (tmp_path / "run" / "model.safetensors").exists()

    run_to_end(dataclasses.replace(args, resume=True), tmp_path)
    assert_same_weights(tmp_path / "run", unbroken / "fsdp")
    assert history(tmp_path / "run", "train/loss") == history(unbroken / "fsdp", "train/loss")


@pytest.mark.parametrize("flag,what", [("fsdp", "the speculator"), ("fsdp_base", "the base model")])
def test_fsdp_needs_several_processes(toy, tmp_path, flag, what):
    name = "--" + flag.replace("_", "-")
    with pytest.raises(ValueError, match=f"{name} shards {what} across processes, and this run has one"):
        train(fsdp_settings(toy, tmp_path / "run", tmp_path / "cache", **{"fsdp": False, flag: True}))


NOT_JOINED = (
    "The launcher started {n} processes (WORLD_SIZE={n}), but accelerate sees this one alone, so each would train a "
    "speculator of its own into the same --output-dir. "
)


def accelerate_joins_cpu_processes_by_itself(env, folder) -> bool:
    """Whether this accelerate, under torchrun on this machine, joins two processes without ACCELERATE_USE_CPU (the
    oldest supported, 1.0, does; later releases leave CPU processes apart)."""
    script = folder / "processes.py"
    script.write_text("from accelerate import Accelerator\nprint(f'processes={Accelerator().num_processes}')\n")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(script)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return "processes=2" in result.stdout  # the two processes' lines may interleave


@pytest.mark.skipif(torch.cuda.is_available(), reason="accelerate joins CUDA processes without ACCELERATE_USE_CPU")
def test_torchrun_on_cpu_without_accelerate_use_cpu_says_so(toy, tmp_path):
    """Without ACCELERATE_USE_CPU=true, accelerate leaves CPU processes apart: each says so, in one line."""
    args = fsdp_settings(toy, tmp_path / "run", tmp_path / "cache")
    env = {k: v for k, v in CLI_ENV.items() if k != "ACCELERATE_USE_CPU"}
    if accelerate_joins_cpu_processes_by_itself(env, tmp_path):
        pytest.skip("this accelerate joins CPU processes without ACCELERATE_USE_CPU: nothing to refuse")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m",
               "hf_mlp_speculator.training", *as_flags(args)]  # fmt: skip
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    expected = "hf-mlp-speculator train: error: " + NOT_JOINED.format(n=2) + (
        "On a machine without CUDA, accelerate joins the processes only with ACCELERATE_USE_CPU=true in the "
        "environment: launch with ACCELERATE_USE_CPU=true torchrun --nproc-per-node 2 -m hf_mlp_speculator.training ..."
    )
    assert result.stderr.splitlines().count(expected) == 2, result.stderr[-3000:]  # one line from each process
    assert "ValueError" not in result.stderr  # no worker's traceback
    assert not (tmp_path / "run").exists()


def test_processes_accelerate_does_not_join_are_refused_with_cuda_too(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError) as error:
        loop.check_launch(types.SimpleNamespace(num_processes=1))
    assert str(error.value) == NOT_JOINED.format(n=4) + (
        "Check how they were launched (`accelerate env` shows accelerate's settings)."
    )
    loop.check_launch(types.SimpleNamespace(num_processes=4))
    monkeypatch.setenv("WORLD_SIZE", "1")
    loop.check_launch(types.SimpleNamespace(num_processes=1))
