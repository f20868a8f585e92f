"""`hf-mlp-speculator bench`: plain, prompt-lookup and MLPSpeculator decoding compared in one run on the same prompts.

Modes: plain greedy, prompt-lookup greedy, the speculator drafting a chain with 1..n_predict heads or a tree of
candidates (its config's `top_k_tokens_per_head` and `n_candidates`), and plain sampling against speculative sampling.
The modes take turns prompt by prompt, so that a slow spell of a shared machine hits all alike. The results go to
`bench.json`, `bench.md` and, with matplotlib installed, `bench.png`.

`--batch-sizes 1,4,16,32` compares instead plain and speculative greedy `generate()` on left-padded batches of that
many prompts: throughput and per-user tokens/s (each row's tokens over the call's duration), as ratios.

`--verify-cost` measures instead what decides whether speculation can win: the verifier's forward over `k + 1` new
tokens relative to one new token on a filled cache, and each draft head's cost relative to a plain step.
"""

import contextlib
import copy
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from torch import nn
from transformers.utils import logging

from ..cpu.fast_decoding import fast_cpu_decoding
from ..cpu.weight_layouts import fixed_layout, kinds_that_fit, packed_matches_plain
from ..drafting.drafts import base_ids, scored_step
from ..generation.transformers_hooks import cache_kwargs, output_cache
from ..utils.batching import left_padded
from ..utils.data_sources import iter_documents
from ..utils.package_data import evaluation_prompts, grounded_prompts
from ..utils.progress import Progress
from .runs import (
    WARMUP_TOKENS,
    GenerationRun,
    add_model_arguments,
    encode_prompts,
    load_pair,
    machine_description,
    positive_int,
    positive_ints,
)

logger = logging.get_logger(__name__)

# The kinds of CPU weights besides the plain ones that `--verify-cost` measures, with how it names them.
KINDS = {"transposed": "Transposed weights", "packed": "Packed oneDNN weights"}


def add_arguments(parser) -> None:
    add_model_arguments(parser)
    parser.add_argument(
        "--prompt-lookup-num-tokens",
        type=positive_int,
        default=10,
        help="Draft length of prompt lookup (default: %(default)s).",
    )
    parser.add_argument(
        "--prompt-set",
        choices=["chat", "grounded"],
        default="chat",
        help="The held-out chat prompts, or requests that edit, convert or answer from a text they give (default: "
        "%(default)s).",
    )
    parser.add_argument(
        "--prompts",
        help="Your own prompts instead: a .txt file (prompts separated by blank lines) or a .jsonl file (a 'text' "
        "field, or chat 'messages'), read as `train` reads them.",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="Seed of the sampling modes (one per prompt) (default: %(default)s)."
    )
    parser.add_argument(
        "--output-dir",
        default="bench_results",
        help="Where bench.json, bench.md, bench.png go (default: %(default)s).",
    )
    parser.add_argument(
        "--verify-cost", action="store_true", help="Only measure the verify and draft costs (writes verify_cost.json)."
    )
    parser.add_argument(
        "--context-length",
        type=positive_int,
        default=300,
        help="Cache length of the --verify-cost forwards (default: %(default)s).",
    )
    parser.add_argument(
        "--repeats",
        type=positive_int,
        default=20,
        help="Timed repeats per --verify-cost measurement (default: %(default)s).",
    )
    parser.add_argument(
        "--batch-sizes",
        type=positive_ints,
        help="Only compare plain and speculative greedy decoding on batches of these sizes, e.g. 1,4,16,32 "
        "(writes bench_batch.json and bench_batch.md).",
    )


@dataclass
class Mode:
    name: str
    generate_kwargs: dict
    baseline: str  # the mode its speedup is measured against
    heads: int | None = None  # draft heads of a speculator mode
    fast_cpu: bool = False  # plain decoding on the fastest kind of weights (`fast_cpu_decoding`)


def benchmark_modes(speculator, prompt_lookup_num_tokens: int) -> list[Mode]:
    greedy, sampling = {"do_sample": False}, {"do_sample": True}
    n_predict = speculator.config.n_predict
    return [
        Mode("plain greedy", greedy, "plain greedy"),
        Mode("plain greedy, faster weights", greedy, "plain greedy", fast_cpu=True),
        Mode("prompt lookup", {**greedy, "prompt_lookup_num_tokens": prompt_lookup_num_tokens}, "plain greedy"),
        *[
            Mode(
                f"speculator k={k}",
                {**greedy, "assistant_model": speculator, "num_assistant_tokens": k},
                "plain greedy",
                k,
            )
            for k in range(1, n_predict + 1)
        ],
        Mode(
            "hybrid (speculator + prompt lookup)",
            {**greedy, "assistant_model": speculator, "prompt_lookup_num_tokens": prompt_lookup_num_tokens},
            "plain greedy",
        ),
        Mode(
            f"speculator tree {speculator.config.top_k_tokens_per_head} n={speculator.config.n_candidates}",
            {**greedy, "assistant_model": speculator, "n_candidates": speculator.config.n_candidates},
            "plain greedy",
        ),
        Mode("plain sampling", sampling, "plain sampling"),
        Mode(
            f"speculative sampling k={n_predict}",
            {**sampling, "assistant_model": speculator, "num_assistant_tokens": n_predict},
            "plain sampling",
        ),
    ]


def run_modes(model, modes: list[Mode], prompts: list[torch.LongTensor], max_new_tokens: int, seed: int):
    """Runs every mode on every prompt, warmed up, mode after mode within each prompt; returns a run per mode."""
    def call(run, mode, index, input_ids, tokens):
        if mode.generate_kwargs["do_sample"]:
            torch.manual_seed(seed + index)  # every sampling mode draws from the same seed on the same prompt
        with fast_cpu_decoding(model) if mode.fast_cpu else contextlib.nullcontext():
            return run.generate(model, input_ids, max_new_tokens=tokens, **mode.generate_kwargs)

    for mode in modes:
        call(GenerationRun("warm-up"), mode, 0, prompts[0], min(WARMUP_TOKENS, max_new_tokens))
    runs = {mode.name: GenerationRun(mode.name) for mode in modes}
    with Progress(len(prompts) * len(modes), "Benchmark", "calls") as bar:
        for index, input_ids in enumerate(prompts):
            for mode in modes:
                run = runs[mode.name]
                call(run, mode, index, input_ids, max_new_tokens)
                bar.update(1, mode=mode.name, speed=f"{run.tokens_per_second:.1f} tok/s")
    return runs


def summarize(modes: list[Mode], runs: dict[str, GenerationRun]) -> list[dict]:
    """
    One row of figures per mode; speedups are ratios of tokens/s against the mode's baseline, and for greedy modes
    also against plain greedy decoding on the faster weights (what the drafts bring on a CPU).
    """
    rows = []
    faster = runs.get("plain greedy, faster weights")
    for mode in modes:
        run, baseline = runs[mode.name], runs[mode.baseline]
        metrics = run.speculation_metrics
        greedy = not mode.generate_kwargs["do_sample"]
        over_faster = greedy and faster is not None and faster.tokens_per_second
        rows.append({
            "mode": mode.name,
            "heads": mode.heads,
            "tokens": run.num_tokens,
            "seconds": run.seconds,
            "tokens_per_second": run.tokens_per_second,
            "speedup": run.tokens_per_second / baseline.tokens_per_second if baseline.tokens_per_second else None,
            "baseline": mode.baseline,
            "speedup_over_faster_weights": run.tokens_per_second / faster.tokens_per_second if over_faster else None,
            "latency_ms_median": run.latency_ms(50),
            "latency_ms_p90": run.latency_ms(90),
            "tokens_per_step": run.tokens_per_step,
            "acceptance_rate": metrics.draft_acceptance_rate if metrics else None,
            "system_efficiency": metrics.system_efficiency if metrics else None,
            "head_acceptance_rates": metrics.head_acceptance_rates if metrics else None,
            # Lossless greedy decoding must reproduce the baseline token for token.
            "identical_to_baseline": run.outputs == baseline.outputs if greedy else None,
        })  # fmt: skip
    return rows


def markdown_table(rows: list[dict]) -> str:
    def fmt(value, pattern="{:.2f}"):
        return "-" if value is None else pattern.format(value)

    lines = [
        "| mode | tok/s | speedup | over faster weights | latency median (ms) | latency p90 (ms) | tokens/step "
        "| acceptance | per-head acceptance | identical |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        heads = (
            None if r["head_acceptance_rates"] is None else ", ".join(f"{a:.2f}" for a in r["head_acceptance_rates"])
        )
        same = None if r["identical_to_baseline"] is None else ("yes" if r["identical_to_baseline"] else "NO")
        lines.append(
            f"| {r['mode']} | {fmt(r['tokens_per_second'], '{:.1f}')} | {fmt(r['speedup'], '{:.2f}x')} | "
            f"{fmt(r['speedup_over_faster_weights'], '{:.2f}x')} | {fmt(r['latency_ms_median'], '{:.1f}')} | "
            f"{fmt(r['latency_ms_p90'], '{:.1f}')} | "
            f"{fmt(r['tokens_per_step'])} | {fmt(r['acceptance_rate'])} | {fmt(heads, '{}')} | {fmt(same, '{}')} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> Path | None:
    """Speedup and tokens per step against the number of draft heads; skipped when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning(f"matplotlib is not installed, so {path.name} was not drawn: `pip install matplotlib`.")
        return None
    by_mode = {r["mode"]: r for r in rows}
    heads = [r for r in rows if r["heads"] is not None]
    ks = [r["heads"] for r in heads]
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(ks, [r["speedup"] for r in heads], "o-", label="MLPSpeculator")
    left.axhline(1.0, color="grey", linestyle=":", label="plain greedy")
    left.axhline(by_mode["prompt lookup"]["speedup"], color="tab:orange", linestyle="--", label="prompt lookup")
    left.set(xlabel="draft heads k", ylabel="speedup over plain greedy (tokens/s ratio)", xticks=ks)
    left.legend()
    right.plot(ks, [r["tokens_per_step"] for r in heads], "o-")
    right.set(xlabel="draft heads k", ylabel="tokens per verifier forward", xticks=ks)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def _interleaved_medians_ms(functions: dict, repeats: int, warmup: int = 3) -> dict:
    """
    Median milliseconds of each `function(setup())` in `functions` (name -> (function, setup)), `setup` untimed. The
    functions take turns round by round, so that a busy spell of a shared machine slows all of them alike; the first
    `warmup` rounds, which pay one-time costs such as kernel selection, are not counted.
    """
    times = {name: [] for name in functions}
    for round_ in range(warmup + repeats):
        for name, (function, setup) in functions.items():
            argument = setup()
            start = time.perf_counter()
            function(argument)
            if round_ >= warmup:
                times[name].append((time.perf_counter() - start) * 1000)
    return {name: statistics.median(values) for name, values in times.items()}


@torch.no_grad()
def measure_verify_cost(model, speculator, context_length: int = 300, max_k: int = 4, repeats: int = 20) -> dict:
    """
    On a cache of `context_length` tokens: the verifier's forward over `m = 1 .. max_k + 1` new tokens (returning
    logits for all of them and the last hidden states, as a verify step does), and each draft head's step (plus the
    argmax of its logits). Ratios are against the 1-token forward, i.e. a plain decoding step.
    """
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.get_text_config().vocab_size
    context = torch.randint(vocab, (1, context_length), generator=generator)
    prefill = model(context, use_cache=True, output_hidden_states=-1)

    def forward(new_tokens):
        return lambda cache: model(new_tokens, use_cache=True, output_hidden_states=-1, **cache_kwargs(model, cache))

    def fresh_cache():  # a forward appends to the cache it is given
        return copy.deepcopy(output_cache(prefill))

    heads = speculator.speculator
    param = next(speculator.parameters())
    states, tokens = (
        [heads.input_state(prefill.hidden_states[-1][:, -1].to(param.device, param.dtype))],
        [context[:, -1]],
    )
    for head in range(speculator.config.n_predict - 1):
        state, logits = heads.step(head, states[-1], tokens[-1])
        states.append(state)
        tokens.append(logits.argmax(-1))

    def draft(head):  # a greedy draft as decoding makes it
        def run(_):
            _, logits, draft_vocab = scored_step(heads, head, states[head], tokens[head])
            return base_ids(draft_vocab, logits.argmax(-1))

        return run

    functions = {
        m: (forward(torch.randint(vocab, (1, m), generator=generator)), fresh_cache) for m in range(1, max_k + 2)
    }
    functions.update({f"head {h}": (draft(h), lambda: None) for h in range(speculator.config.n_predict)})
    medians = _interleaved_medians_ms(functions, repeats)
    forward_ms = {m: medians[m] for m in range(1, max_k + 2)}
    head_ms = [medians[f"head {h}"] for h in range(speculator.config.n_predict)]
    return {
        "context_length": context_length,
        "forward_ms_by_new_tokens": forward_ms,
        "verify_ratio_by_k": {k: forward_ms[k + 1] / forward_ms[1] for k in range(1, max_k + 1)},
        "draft_head_ms": head_ms,
        "draft_cost_per_head": [ms / forward_ms[1] for ms in head_ms],
    }


def verify_cost_report(cost: dict) -> str:
    lines = [f"Verifier forward on a {cost['context_length']}-token cache:"]
    for m, ms in cost["forward_ms_by_new_tokens"].items():
        ratio = f" = {cost['verify_ratio_by_k'][m - 1]:.2f}x a plain step (k={m - 1})" if m > 1 else " (plain step)"
        lines.append(f"  {m} new token(s): {ms:7.2f} ms{ratio}")
    for head, (ms, share) in enumerate(zip(cost["draft_head_ms"], cost["draft_cost_per_head"], strict=True)):
        lines.append(f"Draft head {head}: {ms:.2f} ms = {share:.3f} of a plain step")
    return "\n".join(lines)


def new_tokens_per_row(sequences: torch.LongTensor, prompt_width: int, eos_token_ids: list[int]) -> list[int]:
    """How many tokens each row generated, up to and including its first EOS (the rest is padding)."""
    counts = []
    for row in sequences[:, prompt_width:].tolist():
        ends = [i for i, token in enumerate(row) if token in eos_token_ids]
        counts.append(ends[0] + 1 if ends else len(row))
    return counts


@torch.no_grad()
def run_batch_sizes(model, speculator, prompts, batch_sizes: list[int], max_new_tokens: int, pad_token_id: int):
    """
    Plain greedy `generate()`, the same on the faster weights (`fast_cpu_decoding`), then speculative, on a batch of
    the first `size` prompts, for each size.
    """
    eos = model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    rows = []
    progress = Progress(len(batch_sizes), "Batch sizes", "batches")
    for size in batch_sizes:
        input_ids, attention_mask = left_padded(
            [prompts[i % len(prompts)][0].tolist() for i in range(size)], pad_token_id
        )
        kwargs = {"attention_mask": attention_mask, "do_sample": False, "pad_token_id": pad_token_id}
        seconds, outputs = {}, {}
        for name, extra in (("plain", {}), ("faster_weights", {}), ("speculative", {"assistant_model": speculator})):
            with fast_cpu_decoding(model) if name == "faster_weights" else contextlib.nullcontext():
                model.generate(input_ids, max_new_tokens=WARMUP_TOKENS, **kwargs, **extra)  # warm-up at this shape
                start = time.perf_counter()
                outputs[name] = model.generate(input_ids, max_new_tokens=max_new_tokens, **kwargs, **extra)
                seconds[name] = time.perf_counter() - start
        metrics = speculator.speculation_metrics
        tokens = new_tokens_per_row(outputs["plain"], input_ids.shape[1], eos)
        row = {"batch_size": size, "tokens": sum(tokens)}
        for name in seconds:
            row[f"{name}_tokens_per_second"] = sum(tokens) / seconds[name]
            row[f"{name}_per_user_tokens_per_second"] = statistics.mean(t / seconds[name] for t in tokens)
        row.update({
            "speedup": seconds["plain"] / seconds["speculative"],
            "speedup_over_faster_weights": seconds["faster_weights"] / seconds["speculative"],
            "tokens_per_step": metrics.mean_tokens_per_step,
            "acceptance_rate": metrics.draft_acceptance_rate,
            "identical": all(torch.equal(outputs["plain"], outputs[name]) for name in seconds),
        })  # fmt: skip
        rows.append(row)
        progress.update(1, batch=size, speedup=f"{row['speedup']:.2f}x")
    progress.close()
    return rows


def batch_markdown_table(rows: list[dict]) -> str:
    lines = [
        "| batch | plain tok/s | faster weights tok/s | speculative tok/s | speedup | over faster weights "
        "| plain per-user tok/s | speculative per-user tok/s | tokens/step | acceptance | identical |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['batch_size']} | {r['plain_tokens_per_second']:.1f} | "
            f"{r['faster_weights_tokens_per_second']:.1f} | {r['speculative_tokens_per_second']:.1f} | "
            f"{r['speedup']:.2f}x | {r['speedup_over_faster_weights']:.2f}x | "
            f"{r['plain_per_user_tokens_per_second']:.2f} | {r['speculative_per_user_tokens_per_second']:.2f} | "
            f"{r['tokens_per_step']:.2f} | "
            f"{r['acceptance_rate']:.2f} | {'yes' if r['identical'] else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


def environment(args, model, speculator) -> dict:
    return {
        "model": str(args.model or model.name_or_path),
        "speculator": str(args.speculator or speculator.name_or_path),
        "dtype": args.dtype,
        "max_new_tokens": args.max_new_tokens,
        "num_prompts": args.num_prompts,
        "prompt_set": getattr(args, "prompt_set", "chat"),
        "prompts": getattr(args, "prompts", None),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "machine": machine_description(),
    }


def write_results(output_dir: Path, name: str, environment: dict, rows: list[dict], table: str) -> list[str]:
    """Prints the Markdown `table` with the machine it ran on, and writes both as `name`.md and the JSON results as
    `name`.json."""
    table += f"\n{environment['machine']}; torch {environment['torch']}, transformers {environment['transformers']}\n"
    print("\n" + table)
    (output_dir / f"{name}.json").write_text(json.dumps({"environment": environment, "results": rows}, indent=2))
    (output_dir / f"{name}.md").write_text(table)
    return [f"{name}.json", f"{name}.md"]


def prompt_texts(args, tokenizer) -> list[str]:
    """The prompts a run uses: the user's file, or one of the held-out sets."""
    if args.prompts:
        return list(iter_documents(args.prompts, tokenizer))
    return grounded_prompts() if args.prompt_set == "grounded" else evaluation_prompts()


def run(args) -> int:
    output_dir = Path(args.output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise ValueError(f"--output-dir {output_dir} is a file, not a folder: name a folder for the results.")
    model, tokenizer, speculator = load_pair(args.model, args.speculator, args.dtype)
    output_dir.mkdir(parents=True, exist_ok=True)
    if args.verify_cost:
        max_k = max(4, speculator.config.n_predict)
        cost = measure_verify_cost(model, speculator, args.context_length, max_k, args.repeats)
        print("Plain weights: " + verify_cost_report(cost))
        results = {"environment": environment(args, model, speculator), "verify_cost": cost}
        if model.device.type == "cpu" and model.dtype == torch.float32:
            # The other kinds of weights speculative generate() verifies with where they measure faster
            # (`adaptive_weights`): transposed, and packed where the ops exist and agree with the plain weights; each
            # where its copy fits in memory.
            fitting = kinds_that_fit([m for m in model.modules() if type(m) is nn.Linear], ["plain", *KINDS])
            for kind, name in KINDS.items():
                if kind not in fitting or kind == "packed" and not packed_matches_plain(model):
                    continue
                with fixed_layout(model, kind):
                    results[f"verify_cost_{kind}"] = measure_verify_cost(model, speculator, args.context_length,
                                                                         max_k, args.repeats)  # fmt: skip
                print(f"{name}: " + verify_cost_report(results[f"verify_cost_{kind}"]))
        (output_dir / "verify_cost.json").write_text(json.dumps(results, indent=2))
        return 0

    if args.batch_sizes:
        prompts = encode_prompts(tokenizer, prompt_texts(args, tokenizer))
        # Padding is masked out, so any id will do where the tokenizer names none.
        pad = next((t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id) if t is not None), 0)
        rows = run_batch_sizes(model, speculator, prompts, args.batch_sizes, args.max_new_tokens, pad)
        written = write_results(output_dir, "bench_batch", environment(args, model, speculator), rows,
                                batch_markdown_table(rows))  # fmt: skip
        print(f"Wrote {', '.join(written)} to {output_dir}")
        return 0

    prompts = encode_prompts(tokenizer, prompt_texts(args, tokenizer)[: args.num_prompts])
    modes = benchmark_modes(speculator, args.prompt_lookup_num_tokens)
    rows = summarize(modes, run_modes(model, modes, prompts, args.max_new_tokens, args.seed))
    written = write_results(output_dir, "bench", environment(args, model, speculator), rows, markdown_table(rows))
    written += ["bench.png"] * bool(plot(rows, output_dir / "bench.png"))
    print(f"Wrote {', '.join(written)} to {output_dir}")
    return 0
