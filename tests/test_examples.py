"""Every script in examples/ end to end on tiny model pairs, through the scripts' own arguments, checking what they
print; that they use only the package's public API; and that examples/README.md lists each of them.

Two pairs: a random Llama with a random speculator (real outputs, drafts rejected) and a GPT-2 that always says "a"
with a speculator that always drafts "a" (every draft accepted: several tokens per step, streamed in chunks)."""

import ast
import json
import re
import runpy
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_speculator, make_verifier
from tiny_tokenizer import char_tokenizer

from hf_mlp_speculator.tools import default_models

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SCRIPTS = sorted(p.name for p in EXAMPLES.glob("*.py"))


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Tiny models run far faster on one thread.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Nothing the examples build or cache (the trainer's targets) lands in the user's cache."""
    monkeypatch.setenv(default_models.CACHE_ENV, str(tmp_path / "cache"))


def tokenizer_with_end_token():
    """The character tokenizer (it has a chat template) with an end token but no padding token: the examples pad with
    the end token. Its id 0 is the models' pad_token_id; the models themselves never stop (no eos_token_id)."""
    tokenizer = char_tokenizer()
    tokenizer.eos_token = "\x00"
    return tokenizer


def always_a(tokenizer):
    """A GPT-2 whose final layer norm outputs a constant, the embedding of "a" (made the longest, so that it wins
    against the tied output layer), and a speculator whose heads always score "a" highest."""
    token = tokenizer.convert_tokens_to_ids("a")
    base, speculator = make_verifier("gpt2"), make_speculator(n_predict=3)
    with torch.no_grad():
        base.transformer.wte.weight[token] *= 10
        base.transformer.ln_f.weight.zero_()
        base.transformer.ln_f.bias.copy_(base.transformer.wte.weight[token])
        for head in range(3):
            speculator.speculator.ln[head].weight.zero_()
            speculator.speculator.ln[head].bias.fill_(1.0)
            speculator.speculator.head[head].weight.zero_()
            speculator.speculator.head[head].weight[token] = 1.0
    return base, speculator


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Both pairs saved as folders ({"random": (model, speculator), "always_a": ...}) and a prompt file."""
    folder = tmp_path_factory.mktemp("tiny")
    tokenizer = tokenizer_with_end_token()
    pairs = {"random": (make_verifier(), make_speculator(n_predict=3)), "always_a": always_a(tokenizer)}
    paths = {}
    for name, (base, speculator) in pairs.items():
        base.save_pretrained(folder / name / "model")
        tokenizer.save_pretrained(folder / name / "model")
        speculator.save_pretrained(folder / name / "speculator")
        paths[name] = (str(folder / name / "model"), str(folder / name / "speculator"))
    topics = ["the sky", "the sea", "a short poem", "three facts", "why it rains", "how a clock works"]
    lines = [f"{i}: tell me about {topics[i % len(topics)]}" for i in range(24)]
    (folder / "prompts.txt").write_text("\n".join(lines) + "\n\n")
    return {**paths, "prompts": str(folder / "prompts.txt"), "lines": lines}


@pytest.fixture(params=["random", "always_a"])
def pair(request):
    return request.param


def run_example(name: str, *argv: str, capsys) -> str:
    """Runs examples/`name` as `python examples/name argv...` would, in this process; returns what it printed."""
    path = EXAMPLES / name
    saved = sys.argv
    sys.argv = [str(path), *argv]
    try:
        runpy.run_path(str(path), run_name="__main__")
    finally:
        sys.argv = saved
    return capsys.readouterr().out


def number(pattern: str, text: str) -> float:
    match = re.search(pattern, text)
    assert match, f"{pattern!r} not in the output:\n{text}"
    return float(match.group(1))


def test_generate_with_speculator(tiny, capsys, pair):
    model, speculator = tiny[pair]
    out = run_example("generate_with_speculator.py", "--model", model, "--speculator", speculator,
                      "--max-new-tokens", "10", capsys=capsys)  # fmt: skip
    assert f"Speculator: {speculator} (3 heads)" in out
    greedy = re.search(r"\nPrompt: Explain how a rainbow forms.\nGreedy: (.*)\n", out).group(1)
    tokens_per_step = number(r"Tokens per step: (\d\.\d\d) \(draft acceptance rate \d\.\d\d, per head: ", out)
    assert "Speculative metrics: Draft acceptance rate: " in out  # str(speculator.speculation_metrics)
    assert "\nSampled (seed 0, temperature 0.7): " in out
    assert "Sampled twice with seed 0, same text: yes" in out
    assert re.search(r"Plain generate\(\): +\d+\.\d tokens/s \(40 tokens in \d+\.\d s\)", out)
    assert re.search(r"With the speculator: +\d+\.\d tokens/s \(40 tokens in \d+\.\d s, \d\.\d\d tokens per step\)",
                     out)  # fmt: skip
    assert re.search(r"Speedup: \d+\.\d\dx over plain generate\(\) \(4 prompts, greedy\)", out)
    assert "Greedy outputs identical: yes (4/4 prompts)" in out
    if pair == "always_a":  # every draft accepted: 9 tokens after the prefill's, in steps of up to 4
        assert greedy == "a" * 10 and tokens_per_step >= 2.0
        assert "(draft acceptance rate 1.00, per head: 1.00, 1.00, 1.00)" in out
    else:
        assert len(greedy) == 10 and 1.0 <= tokens_per_step <= 4.0


def test_generate_with_your_own_prompts_on_the_default_pair(tiny, capsys, monkeypatch):
    """Without --model and --speculator the example runs on the default pair (here stood in for by a tiny one)."""
    model, speculator = tiny["random"]
    monkeypatch.setattr(default_models, "default_base_model", lambda: model)
    monkeypatch.setattr(default_models, "default_speculator", lambda base: speculator)
    out = run_example("generate_with_speculator.py", "--prompt", "Hi!", "--prompt", "Bye.", "--max-new-tokens", "5",
                      capsys=capsys)  # fmt: skip
    assert f"Base model: {model}" in out and "\nPrompt: Hi!\nGreedy: " in out
    assert "Greedy outputs identical: yes (2/2 prompts)" in out


@pytest.mark.parametrize("script", ["generate_with_speculator.py", "batch_and_stream.py",
                                    "measure_on_your_prompts.py"])  # fmt: skip
def test_a_model_needs_its_speculator(tiny, capsys, script):
    with pytest.raises(SystemExit) as exit_info:
        run_example(script, "--model", tiny["random"][0], capsys=capsys)
    assert exit_info.value.code == 2
    assert "--model needs --speculator" in capsys.readouterr().err


def test_batch_and_stream(tiny, capsys, pair):
    model, speculator = tiny[pair]
    out = run_example("batch_and_stream.py", "--model", model, "--speculator", speculator, "--max-new-tokens", "8",
                      capsys=capsys)  # fmt: skip
    # Four chats streamed one by one, then the four in one batch.
    streamed = re.findall(r"User: (.*)\nAssistant: (.*)\n\[streamed; (\d\.\d\d) tokens per step\]", out)
    assert len(streamed) == 4 and all(1.0 <= float(steps) <= 4.0 for _, _, steps in streamed)
    batched = re.findall(r"User: (.*)\nAssistant: (.*)\n", out.split("[streamed;")[-1])
    assert [user for user, _ in batched] == [user for user, _, _ in streamed]
    assert re.search(r"\[batch of 4: \d\.\d\d tokens per step; per row: (\d\.\d\d, ){3}\d\.\d\d\]", out)
    assert "Batch replies identical to plain generate()'s: yes" in out
    assert re.search(r"\nPipeline, first reply: .*\n\[pipeline: \d\.\d\d tokens per step\]", out)
    assert "Pipeline replies identical to the batch's: yes" in out
    if pair == "always_a":  # several tokens per step, streamed in chunks, and the same text every way
        assert all(reply == "a" * 8 and float(steps) >= 2.0 for _, reply, steps in streamed)
        assert all(reply == "a" * 8 for _, reply in batched)
        assert number(r"\[batch of 4: (\d\.\d\d) tokens per step", out) >= 2.0
        assert number(r"\[pipeline: (\d\.\d\d) tokens per step", out) >= 2.0


def test_batch_and_stream_needs_a_chat_model(tiny, tmp_path, capsys):
    speculator = tiny["random"][1]
    tokenizer = tokenizer_with_end_token()
    tokenizer.chat_template = None
    make_verifier().save_pretrained(tmp_path / "plain")
    tokenizer.save_pretrained(tmp_path / "plain")
    with pytest.raises(SystemExit):
        run_example("batch_and_stream.py", "--model", str(tmp_path / "plain"), "--speculator", speculator,
                    capsys=capsys)  # fmt: skip
    assert "has no chat template: this example needs a chat (instruct) model" in capsys.readouterr().err


def test_measure_on_your_prompts(tiny, capsys, pair):
    model, speculator = tiny[pair]
    out = run_example("measure_on_your_prompts.py", "--model", model, "--speculator", speculator, "--prompts",
                      tiny["prompts"], "--num-prompts", "5", "--batch-size", "3", "--max-new-tokens", "6",
                      capsys=capsys)  # fmt: skip
    assert f"Prompts: {tiny['prompts']}" in out
    for size, calls in ((1, 5), (3, 2)):
        block = out.split(f"Batch size {size} (5 prompts, {calls} generate() calls each, greedy):\n")[1]
        assert re.match(r"  plain generate\(\): +\d+\.\d tokens/s\n  with the speculator: +\d+\.\d tokens/s\n"
                        r"  speedup: +\d+\.\d\dx\n  tokens per step: +\d\.\d\d \(draft acceptance rate \d\.\d\d\)\n"
                        r"  acceptance per head: +\d\.\d\d(, \d\.\d\d)*\n  outputs identical: +yes \(5/5 prompts\)",
                        block)  # fmt: skip
        if pair == "always_a":
            assert number(r"tokens per step: +(\d\.\d\d)", block) >= 2.0
            assert "acceptance per head:  1.00, 1.00, 1.00\n" in block


def test_measure_on_the_default_pair_and_prompts(tiny, capsys, monkeypatch):
    model, speculator = tiny["random"]
    monkeypatch.setattr(default_models, "default_base_model", lambda: model)
    monkeypatch.setattr(default_models, "default_speculator", lambda base: speculator)
    out = run_example("measure_on_your_prompts.py", "--num-prompts", "2", "--batch-size", "1", "--max-new-tokens", "4",
                      capsys=capsys)  # fmt: skip
    assert "Prompts: held-out chat prompts" in out
    assert "outputs identical:    yes (2/2 prompts)" in out and "Batch size 2" not in out


def test_train_speculator(tiny, tmp_path, capsys):
    """On the random Llama: a real (if hopeless) speculator, and greedy outputs worth comparing."""
    output_dir = tmp_path / "my-speculator"
    out = run_example("train_speculator.py", "--base-model", tiny["random"][0], "--prompts", tiny["prompts"],
                      "--held-out", "4", "--output-dir", str(output_dir), "--max-train-minutes", "0.15",
                      "--n-predict", "3", "--draft-vocab-size", "48", "--new-tokens", "12", "--batch-size", "64",
                      capsys=capsys)  # fmt: skip
    assert "20 training prompts, 4 held out" in out

    # The held-out prompts, the file's last four, were evaluated on and never trained on.
    def texts(name):
        lines = (tmp_path / "my-speculator-prompts" / name).read_text().splitlines()
        return [json.loads(line)["text"] for line in lines]

    trained, held_out = texts("train_prompts.jsonl"), texts("held_out_prompts.jsonl")
    assert len(trained) == 20 and len(held_out) == 4 and not set(trained) & set(held_out)
    assert all(f"<user>{line}<assistant>" in held_out for line in tiny["lines"][-4:])
    # Saved in the published layout, with a reduced draft vocabulary, and reloaded.
    config = json.loads((output_dir / "config.json").read_text())
    assert config["model_type"] == "mlp_speculator" and config["n_predict"] == 3 and config["draft_vocab_size"] == 48
    assert f"Speculator saved to {output_dir}" in out
    tokens_per_step = number(r"Held-out prompts \(4, never trained on\): (\d\.\d\d) tokens per step, draft acceptance "
                             r"rate \d\.\d\d, per head: \d\.\d\d(, \d\.\d\d)*", out)  # fmt: skip
    assert 1.0 <= tokens_per_step <= 4.0
    assert f"\nPrompt: {tiny['lines'][-4]}\nAnswer: " in out
    assert "Lossless: speculative output == plain output: yes" in out


def test_train_speculator_holds_out_at_least_one_prompt(tiny, tmp_path, capsys):
    with pytest.raises(SystemExit):
        run_example("train_speculator.py", "--base-model", tiny["random"][0], "--prompts", tiny["prompts"],
                    "--held-out", "0", "--output-dir", str(tmp_path / "out"), capsys=capsys)  # fmt: skip
    assert "--held-out 0: hold out 1 to 23 of the 24 prompts." in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def public_api_violations(path: Path) -> list[str]:
    """Names starting with `_` that the script takes from hf_mlp_speculator (imports and attributes of its modules)."""
    tree = ast.parse(path.read_text())
    package_names, violations = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "hf_mlp_speculator":
                    violations += [p for p in alias.name.split(".") if p.startswith("_")]
                    package_names.add((alias.asname or alias.name).split(".")[0])
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "hf_mlp_speculator":
            violations += [p for p in node.module.split(".") if p.startswith("_")]
            violations += [a.name for a in node.names if a.name.startswith("_")]
            package_names.update(a.asname or a.name for a in node.names)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in package_names:
                violations.append(node.attr)
    return violations


@pytest.mark.parametrize("script", SCRIPTS)
def test_examples_use_only_the_public_api(script):
    assert public_api_violations(EXAMPLES / script) == []


def test_the_public_api_check_catches_private_names(tmp_path):
    script = tmp_path / "bad.py"
    script.write_text(
        "import hf_mlp_speculator\nfrom hf_mlp_speculator import default_models, _x\n"
        "from hf_mlp_speculator._private import y\nhf_mlp_speculator.tools.runs._z\ndefault_models._digest\n"
    )
    assert sorted(public_api_violations(script)) == ["_digest", "_private", "_x", "_z"]


def test_the_readme_lists_every_example():
    readme = (EXAMPLES / "README.md").read_text()
    assert SCRIPTS == ["batch_and_stream.py", "generate_with_speculator.py", "measure_on_your_prompts.py",
                       "train_speculator.py"]  # fmt: skip
    for script in SCRIPTS:
        assert f"python examples/{script}" in readme
        assert re.search(rf"## `{re.escape(script)}`.*\n### Output on the default pair \(run on ", readme, re.DOTALL)
    assert len(re.findall(r"### Output on the default pair \(run on ", readme)) == len(SCRIPTS)
