"""What the package keeps on disk: the prompt sets it ships, and the cache folder it builds the default pair into.

Below both the default pair (`default_models`) and the trainer (`training`), which read these.
"""

import json
import os
from pathlib import Path

CACHE_ENV = "HF_MLP_SPECULATOR_CACHE"
PROMPTS_DIR = Path(__file__).parent.parent / "prompts"
TRAIN_PROMPTS, EVAL_PROMPTS = PROMPTS_DIR / "train_prompts.txt", PROMPTS_DIR / "eval_prompts.txt"
# Held out from training, and unlike the training prompts written in varied styles: what the trainer's acceptance and
# the tuning of the default recipe were measured on. The evaluation prompts (the demo's and the benchmark's) were not.
VALIDATION_PROMPTS = PROMPTS_DIR / "validation_prompts.txt"
GROUNDED_PROMPTS = PROMPTS_DIR / "grounded_prompts.jsonl"


def cache_dir() -> Path:
    """`$HF_MLP_SPECULATOR_CACHE`, else `~/.cache/hf_mlp_speculator`."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "hf_mlp_speculator")


def read_prompts(path: Path) -> list[str]:
    return [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def evaluation_prompts() -> list[str]:
    """The demo's and the benchmark's prompts; the default speculator never sees them in training."""
    return read_prompts(EVAL_PROMPTS)


def grounded_prompts() -> list[str]:
    """Requests to edit, convert, summarise, refactor or answer from a text they give: work that repeats its input,
    for prompt lookup and hybrid drafting. Like the evaluation prompts, never trained on."""
    lines = GROUNDED_PROMPTS.read_text(encoding="utf-8").splitlines()
    return [json.loads(line)["text"] for line in lines if line.strip()]
