"""The default pair's cache: built once, reused while valid, rebuilt when its source or contents change, never half
built.

Only the expensive boundaries are replaced: the GGUF dequantisation (`convert_gguf`) and the trainer (`train`).
"""

import json
import os
import re
import sys
import types
from pathlib import Path

import pytest
import transformers

from hf_mlp_speculator.tools import default_models


class FakeConversion:
    """Stands in for `convert_gguf`: writes a small model folder and counts its calls; can fail halfway."""

    def __init__(self):
        self.calls = 0
        self.fail = False

    def __call__(self, gguf_path: Path, output_dir: Path) -> None:
        self.calls += 1
        output_dir.mkdir(parents=True)
        (output_dir / "config.json").write_text(json.dumps({"source_size": gguf_path.stat().st_size}))
        if self.fail:
            raise KeyboardInterrupt  # as if the user pressed Ctrl-C between two files
        (output_dir / "model.safetensors").write_bytes(b"\0" * 1000)


@pytest.fixture
def conversion(tmp_path, monkeypatch):
    gguf = tmp_path / "pkg" / default_models.GGUF_FILE
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF" + b"\1" * 100)
    monkeypatch.setenv(default_models.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(default_models, "find_base_gguf", lambda: gguf)
    fake = FakeConversion()
    monkeypatch.setattr(default_models, "convert_gguf", fake)
    fake.gguf = gguf
    return fake


def test_valid_cache_is_not_rebuilt(conversion, tmp_path):
    first = default_models.default_base_model()
    second = default_models.default_base_model()
    assert conversion.calls == 1
    assert first == second == tmp_path / "cache" / "SmolLM2-135M-Instruct"
    manifest = json.loads((first / "manifest.json").read_text())
    assert manifest["source"]["size"] == 104
    assert manifest["files"] == {"config.json": len((first / "config.json").read_text()), "model.safetensors": 1000}


@pytest.mark.parametrize("change", ["content", "mtime"])
def test_changed_source_is_rebuilt(conversion, change):
    folder = default_models.default_base_model()
    if change == "content":
        conversion.gguf.write_bytes(b"GGUF" + b"\2" * 200)
    else:
        stat = conversion.gguf.stat()
        os.utime(conversion.gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    default_models.default_base_model()
    assert conversion.calls == 2
    if change == "content":
        assert json.loads((folder / "config.json").read_text()) == {"source_size": 204}


def test_library_upgrade_does_not_rebuild(conversion, monkeypatch):
    """A `pip install -U` changes nothing the conversion depends on: the cache stays valid."""
    default_models.default_base_model()
    monkeypatch.setattr(transformers, "__version__", "99.0.0")
    default_models.default_base_model()
    assert conversion.calls == 1


@pytest.mark.parametrize(
    "damage",
    [
        lambda folder: (folder / "model.safetensors").unlink(),
        lambda folder: (folder / "model.safetensors").write_bytes(b"\0" * 10),  # truncated
        lambda folder: (folder / "manifest.json").unlink(),
        lambda folder: (folder / "manifest.json").write_text("{not json"),
    ],
    ids=["missing-file", "truncated-file", "no-manifest", "corrupt-manifest"],
)
def test_damaged_cache_is_rebuilt(conversion, damage):
    folder = default_models.default_base_model()
    damage(folder)
    assert not default_models.is_valid_cache(folder, {})
    default_models.default_base_model()
    assert conversion.calls == 2
    assert (folder / "model.safetensors").stat().st_size == 1000
    default_models.default_base_model()
    assert conversion.calls == 2


def test_interrupted_conversion_leaves_no_valid_looking_cache(conversion, tmp_path):
    conversion.fail = True
    with pytest.raises(KeyboardInterrupt):
        default_models.default_base_model()
    # Neither the target nor a half-written temporary folder is left behind.
    assert list((tmp_path / "cache").iterdir()) == []

    # An interrupted rebuild keeps the stale folder stale: it is still rebuilt next time.
    conversion.fail = False
    folder = default_models.default_base_model()
    conversion.gguf.write_bytes(b"GGUF changed")
    conversion.fail = True
    with pytest.raises(KeyboardInterrupt):
        default_models.default_base_model()
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [folder.name]
    conversion.fail = False
    default_models.default_base_model()
    assert conversion.calls == 4


def test_missing_package_error_names_the_install_command(monkeypatch):
    monkeypatch.setattr(default_models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=re.escape(default_models.INSTALL_HINT)):
        default_models.find_base_gguf()


def test_evaluation_and_validation_prompts_are_held_out():
    from hf_mlp_speculator.training.prompts import normalized

    def prompts(path):
        return {normalized(p) for p in default_models.read_prompts(path)}

    train, validation = prompts(default_models.TRAIN_PROMPTS), prompts(default_models.VALIDATION_PROMPTS)
    evaluation = prompts(default_models.EVAL_PROMPTS)
    assert len(evaluation) >= 16 and len(validation) >= 32 and len(train) >= 300
    assert not train & evaluation and not train & validation and not validation & evaluation


def fake_base_and_trainer(tmp_path, monkeypatch, train):
    """A base model folder with a tokenizer, a cache in tmp_path, and `train` standing in for the real trainer."""
    from tiny_tokenizer import char_tokenizer

    base = tmp_path / "base"
    char_tokenizer().save_pretrained(base)
    (base / "config.json").write_text("{}")
    monkeypatch.setenv(default_models.CACHE_ENV, str(tmp_path / "cache"))
    trainer = types.ModuleType("hf_mlp_speculator.training")
    trainer.SpeculatorTrainingArguments, trainer.train = types.SimpleNamespace, train
    monkeypatch.setitem(sys.modules, "hf_mlp_speculator.training", trainer)
    return base


def test_speculator_is_trained_once_on_data_without_evaluation_prompts(tmp_path, monkeypatch):
    seen = []

    def train(args):
        seen.append(args)
        def texts(path):
            return "".join(json.loads(line)["text"] for line in Path(path).read_text().splitlines())

        prompts, validation = texts(args.prompts[0]), texts(args.eval_data[0])
        assert not any(prompt in prompts + validation for prompt in default_models.evaluation_prompts())
        # The base continues the chat prompts, rendered with its chat template up to the answer.
        assert "<user>Hi! How are you today?<assistant>" in prompts
        assert all(p in validation for p in default_models.read_prompts(default_models.VALIDATION_PROMPTS))
        final = Path(args.output_dir) / "final"
        final.mkdir(parents=True)
        (final / "config.json").write_text("{}")
        (final / "README.md").write_text(f'AutoModel.from_pretrained("{final.resolve()}")')
        return str(final)

    base = fake_base_and_trainer(tmp_path, monkeypatch, train)
    folder = default_models.default_speculator(base)
    assert default_models.default_speculator(base) == folder and len(seen) == 1
    assert seen[0].base_model == str(base) and seen[0].n_predict == default_models.SPECULATOR_TRAINING["n_predict"]
    assert seen[0].max_train_minutes == default_models.TRAINING_MINUTES
    assert (folder / "config.json").is_file()
    # The model card's usage snippet names the cached folder, not the training folder that is gone.
    assert (folder / "README.md").read_text() == f'AutoModel.from_pretrained("{folder}")'
    # A library upgrade keeps it; a different base model needs a speculator of its own.
    monkeypatch.setattr(transformers, "__version__", "99.0.0")
    default_models.default_speculator(base)
    assert len(seen) == 1
    (base / "config.json").write_text('{"hidden_size": 1}')
    default_models.default_speculator(base)
    assert len(seen) == 2


def test_killed_speculator_training_resumes_and_only_the_model_is_cached(tmp_path, monkeypatch):
    calls = []

    def train(args):
        calls.append(args.resume)
        output = Path(args.output_dir)
        (output / "checkpoint-20").mkdir(parents=True, exist_ok=True)
        (output / "run.json").write_text("{}")
        if len(calls) == 1:
            raise KeyboardInterrupt  # killed after its first checkpoint
        (output / "config.json").write_text("{}")
        return str(output)

    base = fake_base_and_trainer(tmp_path, monkeypatch, train)
    with pytest.raises(KeyboardInterrupt):
        default_models.default_speculator(base)
    folder = default_models.default_speculator(base)
    assert calls == [False, True]  # the second run picked up the first run's checkpoint
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "manifest.json"]  # no run.json, no checkpoint
    assert not any(p.name.startswith(".") for p in folder.parent.iterdir())  # training folder removed once cached
