"""`hf-mlp-speculator demo`: the same prompts with plain `generate()`, plain `generate()` on the fastest of plain,
transposed and packed weights (`fast_cpu_decoding`, which speculative `generate()` uses by itself on CPU), then with
the speculator, and how they compare: the speculator's gain over the second is what the drafts themselves bring.

With no model named it runs the offline default pair (see `hf_mlp_speculator.tools.default_models`), built on first use.
"""

import contextlib

import torch
from transformers.utils import logging

from ..cpu.fast_decoding import fast_cpu_decoding
from ..utils.package_data import evaluation_prompts
from .runs import (
    WARMUP_TOKENS,
    GenerationRun,
    add_model_arguments,
    encode_prompts,
    load_pair,
    machine_description,
    token_bar,
)

logger = logging.get_logger(__name__)


def add_arguments(parser) -> None:
    add_model_arguments(parser)


def compare(
    model, speculator, prompts: list[torch.LongTensor], max_new_tokens: int
) -> tuple[GenerationRun, GenerationRun, GenerationRun]:
    """Greedy `generate()` over `prompts`: plain, plain on the faster weights, with the speculator; each warmed up."""
    modes = {
        "Without speculation": (contextlib.nullcontext, {}),
        "Faster weights": (lambda: fast_cpu_decoding(model), {}),
        "With MLPSpeculator": (contextlib.nullcontext, {"assistant_model": speculator}),
    }
    runs = []
    for title, (context, extra) in modes.items():
        with context():
            # The first call pays one-time costs (allocations, kernel selection) that are no part of the speed.
            GenerationRun("warm-up").generate(model, prompts[0], do_sample=False, max_new_tokens=WARMUP_TOKENS,
                                              **extra)  # fmt: skip
            runs.append(GenerationRun(title))
            with token_bar(title) as bar:
                for input_ids in prompts:
                    runs[-1].generate(model, input_ids, bar=bar, do_sample=False, max_new_tokens=max_new_tokens,
                                      **extra)  # fmt: skip
    return tuple(runs)


def report(plain: GenerationRun, fast: GenerationRun, speculative: GenerationRun) -> str:
    def speed(run):
        return f"{run.tokens_per_second:6.1f} toks/s ({run.num_tokens} tokens in {run.seconds:.1f} s"

    same, total = sum(a == b for a, b in zip(plain.outputs, speculative.outputs, strict=True)), len(plain.outputs)
    return "\n".join([
        str(speculative.speculation_metrics),
        machine_description(),
        f"Without speculation: {speed(plain)})",
        f"Faster weights:      {speed(fast)}, plain generate() on the kind of weights that measured fastest)",
        f"With MLPSpeculator:  {speed(speculative)}, {speculative.tokens_per_step:.2f} tokens per verifier forward)",
        f"Speedup: {speculative.tokens_per_second / plain.tokens_per_second:.2f}x over plain generate(), "
        f"{speculative.tokens_per_second / fast.tokens_per_second:.2f}x over it on the faster weights (the drafts' "
        "share)",
        f"Greedy outputs identical: {'yes' if same == total else 'NO'} ({same}/{total} prompts)",
    ])  # fmt: skip


def run(args) -> int:
    model, tokenizer, speculator = load_pair(args.model, args.speculator, args.dtype)
    texts = evaluation_prompts()[: args.num_prompts]
    plain, fast, speculative = compare(model, speculator, encode_prompts(tokenizer, texts), args.max_new_tokens)
    print(f"\nPrompt: {texts[0]}\nAnswer: {tokenizer.decode(speculative.outputs[0], skip_special_tokens=True)}\n")
    print(report(plain, fast, speculative))
    if plain.outputs != speculative.outputs:
        logger.warning(
            "Speculative greedy outputs differ from plain greedy ones. In float32 that is a bug; in reduced precision "
            "the verifier's k+1-token forward may round differently from its 1-token forward."
        )
    return 0
