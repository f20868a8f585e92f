"""Timed `generate()` calls: the loading and measuring core shared by the demo and the benchmark.

Speed is counted in tokens. A speculative step emits several tokens at once, so everything here is derived from what
each verifier forward emitted (a streamer sees one chunk per forward), never from the number of chunks.
"""

import argparse
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer
from transformers.generation.streamers import BaseStreamer
from transformers.utils import logging

from ..drafting.metrics import SpeculationMetrics
from ..models.modeling_mlp_speculator import MLPSpeculatorPreTrainedModel
from ..utils.progress import Progress

logger = logging.get_logger(__name__)

# Tokens each model generates once before anything is timed, to pay one-time costs (kernel selection, allocation).
WARMUP_TOKENS = 8

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
UNTRAINED = "untrained"


def machine_description() -> str:
    """
    The machine a measurement ran on, in one line: the CPU's model, its cores, the instructions that decide which kind
    of weights is faster here (`cpu_features`), and the GPU if there is one.
    """
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model in ("", "x86_64", platform.machine()):
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:  # not Linux: the model name alone
        pass
    features = cpu_features(flags)
    line = f"CPU: {model}, {os.cpu_count()} cores" + (f", {', '.join(features)}" if features else "")
    if torch.cuda.is_available():
        line += f"; GPU: {torch.cuda.get_device_name()}"
    return line + f"; torch {torch.__version__}, {torch.get_num_threads()} threads"


def cpu_features(flags: set[str]) -> list[str]:
    """
    What of `/proc/cpuinfo`'s `flags` decides which kind of weights is faster: the vector width (AVX-512, else AVX2),
    AVX-512's BF16 extension, and AMX. Machines here have had each (an AMD EPYC with AVX2 alone, Xeons with AVX-512).
    """
    if not flags:
        return []
    features = ["AVX-512"] if "avx512f" in flags else ["AVX2", "no AVX-512"] if "avx2" in flags else []
    features += [name for name, flag in (("AVX-512 BF16", "avx512_bf16"), ("AMX", "amx_tile")) if flag in flags]
    return features if "amx_tile" in flags else features + ["no AMX"]


def positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def positive_ints(text: str) -> list[int]:
    """An argparse type: positive integers separated by commas, such as 1,4,16."""
    try:
        return [positive_int(part) for part in text.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of positive integers") from None


def add_model_arguments(parser) -> None:
    """The options that choose and load the model pair, common to the demo and the benchmark."""
    parser.add_argument("--model", help="Base model: a folder or Hub id (default: SmolLM2-135M-Instruct, offline).")
    parser.add_argument(
        "--speculator",
        help="MLPSpeculator trained for --model: a folder or Hub id (default: the default speculator, trained on first"
        f" use). '{UNTRAINED}' drafts with random weights of the default shape, to time the machinery.",
    )
    parser.add_argument(
        "--dtype", choices=list(DTYPES), default="float32", help="Weights and compute dtype (default: %(default)s)."
    )
    parser.add_argument(
        "--max-new-tokens", type=positive_int, default=128, help="Tokens generated per prompt (default: %(default)s)."
    )
    parser.add_argument(
        "--num-prompts", type=positive_int, default=8, help="How many prompts to run (default: %(default)s)."
    )


def load_pair(model_name: str | None, speculator_name: str | None, dtype: str = "float32"):
    """
    Loads (model, tokenizer, speculator); names left out mean the offline default pair. Both are left as loaded:
    plain `generate()` runs on them as a user's would, and speculative `generate()` takes its fast path by itself.
    """
    from . import default_models

    if model_name is not None and speculator_name is None:
        raise ValueError(
            f"--model {model_name} needs --speculator: the default speculator drafts for SmolLM2-135M-Instruct only. "
            f"Name a speculator trained for {model_name} (train one with `hf-mlp-speculator train`), or pass "
            f"--speculator {UNTRAINED} to time the machinery with random drafts."
        )
    model_name = model_name or default_models.default_base_model()
    model = AutoModelForCausalLM.from_pretrained(model_name, dtype=DTYPES[dtype]).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_name)
    if speculator_name == UNTRAINED:
        logger.warning("The speculator is untrained: its drafts are random, so speedups will be below 1.")
        speculator = default_models.untrained_speculator(model.config).to(DTYPES[dtype])
    else:
        speculator = AutoModel.from_pretrained(
            speculator_name or default_models.default_speculator(model_name), dtype=DTYPES[dtype]
        )
    return model, tokenizer, speculator.eval()


def encode_prompts(tokenizer, prompts: list[str]) -> list[torch.LongTensor]:
    """Each prompt as a `[1, length]` tensor, rendered as a user turn with the chat template when there is one."""
    if getattr(tokenizer, "chat_template", None):
        return [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, return_tensors="pt", return_dict=True
            )["input_ids"]
            for p in prompts
        ]
    return [tokenizer(p, return_tensors="pt")["input_ids"] for p in prompts]


def token_latencies(start: float, chunk_times: list[float], chunk_sizes: list[int]) -> list[float]:
    """
    Per-token latency: a forward that emits `m` tokens `d` seconds after the previous one (or after `start`) gives each
    of its `m` tokens a latency of `d / m`, so the latencies of a call add up to its duration.
    """
    latencies, previous = [], start
    for when, size in zip(chunk_times, chunk_sizes, strict=True):
        latencies += [(when - previous) / size] * size
        previous = when
    return latencies


class Forward(NamedTuple):
    """One forward of a model: when it started and ended (`time.perf_counter()`), and its input's rows and tokens."""

    start: float
    end: float
    rows: int
    tokens: int


class ForwardClock:
    """While entered, `forwards` lists `model`'s forwards (`Forward`), in order: what the benchmarks split calls by."""

    def __init__(self, model):
        self.model, self.forwards, self.hooks = model, [], []

    def __enter__(self):
        started = []

        def start(module, args, kwargs):
            started.append(time.perf_counter())

        def stop(module, args, kwargs, output):
            inputs = kwargs.get("input_ids", args[0] if args else None)
            rows, tokens = (inputs if inputs is not None else kwargs["inputs_embeds"]).shape[:2]
            self.forwards.append(Forward(started.pop(), time.perf_counter(), int(rows), int(tokens)))

        self.hooks = [self.model.register_forward_pre_hook(start, with_kwargs=True),
                      self.model.register_forward_hook(stop, with_kwargs=True)]  # fmt: skip
        return self

    def __exit__(self, *args):
        for hook in self.hooks:
            hook.remove()


class TokenCounter(BaseStreamer):
    """
    Records when each verifier forward emitted how many tokens. Given a `Progress` bar, advances it by tokens and
    shows the speed of the run so far, `tokens_before` tokens in `seconds_before` seconds having come before this call.
    """

    def __init__(self, bar=None, tokens_before: int = 0, seconds_before: float = 0.0):
        self.bar, self.tokens_before, self.seconds_before = bar, tokens_before, seconds_before
        self.start = time.perf_counter()
        self.times, self.sizes = [], []
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        # generate() streams the prompt first; it is not generated output.
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.times.append(time.perf_counter())
        self.sizes.append(value.numel())
        if self.bar is not None:
            tokens = self.tokens_before + sum(self.sizes)
            seconds = self.seconds_before + self.times[-1] - self.start
            self.bar.update(value.numel(), speed=f"{tokens / max(seconds, 1e-9):.1f} tok/s")

    def end(self) -> None:
        pass


@dataclass
class GenerationRun:
    """The timed `generate()` calls of one decoding mode, and what they produced."""

    name: str
    outputs: list[list[int]] = field(default_factory=list)  # the new tokens of each call
    seconds: float = 0.0
    chunk_sizes: list[int] = field(default_factory=list)  # tokens emitted by each verifier forward, prefill included
    latencies: list[float] = field(default_factory=list)
    metrics: list[SpeculationMetrics] = field(default_factory=list)

    def generate(self, model, input_ids: torch.LongTensor, bar=None, **generate_kwargs) -> list[int]:
        """Runs and times one `generate()` call; `bar`, a `Progress`, advances by tokens and shows the run's speed."""
        counter = TokenCounter(bar, self.num_tokens, self.seconds)
        start = counter.start
        sequences = model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), streamer=counter, **generate_kwargs
        )
        self.seconds += time.perf_counter() - start
        new_tokens = sequences[0, input_ids.shape[1] :].tolist()
        self.outputs.append(new_tokens)
        self.chunk_sizes += counter.sizes
        self.latencies += token_latencies(start, counter.times, counter.sizes)
        speculator = generate_kwargs.get("assistant_model")
        if isinstance(speculator, MLPSpeculatorPreTrainedModel):
            self.metrics.append(speculator.speculation_metrics)
        return new_tokens

    @property
    def num_tokens(self) -> int:
        return sum(len(output) for output in self.outputs)

    @property
    def tokens_per_second(self) -> float:
        return self.num_tokens / self.seconds if self.seconds else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens per verifier forward, the prefill forward included; plain decoding scores exactly 1."""
        return sum(self.chunk_sizes) / len(self.chunk_sizes) if self.chunk_sizes else 0.0

    def latency_ms(self, percentile: float) -> float:
        return float(np.percentile(self.latencies, percentile)) * 1000 if self.latencies else 0.0

    @property
    def speculation_metrics(self) -> SpeculationMetrics | None:
        return sum(self.metrics, SpeculationMetrics()) if self.metrics else None


def token_bar(description: str) -> Progress:
    """Progress that counts generated tokens and shows their speed: a bar on a terminal, a line now and then off it."""
    return Progress(None, description, "tokens")
