"""Plain greedy `generate()` against `generate(assistant_model=speculator)` with no other argument, as ratios.

For each batch size, the evaluation prompts (never trained on) run in batches of that size, plain `generate()`, plain
`generate()` on the fastest kind of weights (`fast_cpu_decoding`) and speculative `generate()` taking turns batch by
batch (each kind first in turn), after a warm-up at each size that pays the one-time costs of the process (copying
the weights, the first timings of each depth and kind of weights); with `--first-call` only plain decoding is
warmed up, and the speculative calls are timed from the process's first. Prints both speedups (the plain calls' seconds
over the speculative calls', and the median of the same ratio call by call): against plain `generate()`, and against
it on the faster weights, which is what the drafts bring; whether every output was identical, the depths the
controller chose, the CPU it ran on, and where the time went: the median one-token forward of the whole batch in plain
decoding on the faster weights and in the speculative calls' k = 0 steps, and each call's seconds outside the
verifier's forwards.

    python benchmarks/cost_aware_ratio.py --batch-sizes 1,8,16,32 --num-prompts 32 --max-new-tokens 64 --repeats 2
    python benchmarks/cost_aware_ratio.py --batch-sizes 32 --num-prompts 32 --min-calls 16   # 16 calls of each kind
    python benchmarks/cost_aware_ratio.py --speculator untrained --batch-sizes 1,8 --first-call
    python benchmarks/cost_aware_ratio.py --batch-sizes 1 --temperature 0.7   # sampled, each batch under one seed
    python benchmarks/cost_aware_ratio.py --batch-sizes 1 --temperature 0.7 --rejection   # transformers' sampling
"""

import argparse
import contextlib
import statistics
import time

import torch

from hf_mlp_speculator import fast_cpu_decoding
from hf_mlp_speculator.tools.default_models import evaluation_prompts
from hf_mlp_speculator.tools.runs import (
    WARMUP_TOKENS,
    ForwardClock,
    encode_prompts,
    load_pair,
    machine_description,
)
from hf_mlp_speculator.training.documents import left_padded


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--speculator", help="a folder, or 'untrained' (default: the default speculator)")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1,
                        help="run the prompts at least this many times (a batch of 32 is one call per pass, and two "
                             "calls of a shared machine differ by up to 20%%)")
    parser.add_argument("--min-calls", type=int, default=8,
                        help="and as many more times as it takes for each kind of call to run this many times at "
                             "every batch size (2 calls at batch 32 gave 0.87x and 0.99x in two processes)")
    parser.add_argument("--assistant-confidence-threshold", type=float, help="passed to the speculative calls only")
    parser.add_argument("--tree", action="store_true", help="draft trees (the speculator's n_candidates)")
    parser.add_argument("--temperature", type=float, help="sample at this temperature (default: greedy)")
    parser.add_argument("--rejection", action="store_true", help="speculative_sampling='rejection' (batch 1)")
    parser.add_argument("--first-call", action="store_true",
                        help="time the speculative calls from the process's first (the warm-up call is plain only)")
    return parser.parse_args()


def speculative_kwargs(args, speculator) -> dict:
    """What the speculative calls pass beyond the plain ones."""
    speculative = {"assistant_model": speculator}
    if args.tree:
        speculative["n_candidates"] = speculator.config.n_candidates
    if args.rejection:
        speculative["speculative_sampling"] = "rejection"
    if args.assistant_confidence_threshold is not None:
        speculative["assistant_confidence_threshold"] = args.assistant_confidence_threshold
    return speculative


def time_calls(model, speculator, batches, args, pad):
    """
    Each batch through the three kinds of call, after a warm-up on the first: ({kind: seconds per call}, whether every
    output was identical, the speculative calls' summed metrics, {kind: its calls' verifier forwards
    (`runs.Forward`)}).
    """
    calls, same, metrics = {"plain": [], "faster weights": [], "speculative": []}, True, None
    forwards = {name: [] for name in calls}
    runs = [("plain", {}), ("faster weights", {}), ("speculative", speculative_kwargs(args, speculator))]
    passes = max(args.repeats, -(-args.min_calls // len(batches)))
    for index, (input_ids, mask) in enumerate([batches[0]] + batches * passes):
        warmup = index == 0
        kwargs = dict(attention_mask=mask, do_sample=args.temperature is not None, pad_token_id=pad,
                      max_new_tokens=WARMUP_TOKENS * 2 if warmup else args.max_new_tokens)  # fmt: skip
        if args.temperature is not None:
            kwargs.update(temperature=args.temperature, top_k=None, top_p=None)
        outputs = {}
        # Each kind of call goes first in turn: a kind always run after another would inherit its warm caches.
        for name, extra in runs[index % 3 :] + runs[: index % 3]:
            if warmup and args.first_call and extra:
                continue
            faster = name == "faster weights"
            torch.manual_seed(index)
            start = time.perf_counter()
            with torch.no_grad(), fast_cpu_decoding(model) if faster else contextlib.nullcontext():
                with ForwardClock(model) as clock:
                    outputs[name] = model.generate(input_ids, **kwargs, **extra)
            if not warmup:
                calls[name].append(time.perf_counter() - start)
                forwards[name] += clock.forwards
        if not warmup:
            same &= torch.equal(outputs["plain"], outputs["speculative"])
            same &= torch.equal(outputs["plain"], outputs["faster weights"])
            call = speculator.speculation_metrics
            metrics = call if metrics is None else metrics + call
    return calls, same, metrics, forwards


def step_breakdown(size: int, calls: dict, forwards: dict) -> str:
    """
    Where the time of plain decoding on the faster weights and of speculative decoding went: the median forward of one
    token per row with the whole batch (a plain step; the speculative calls' k = 0 steps), and the seconds per call
    outside the verifier's forwards (the loop's host work, and the speculative calls' draft heads).
    """
    parts = []
    for name in ("faster weights", "speculative"):
        plain_steps = [f.end - f.start for f in forwards[name] if f.rows == size and f.tokens == 1]
        outside = (sum(calls[name]) - sum(f.end - f.start for f in forwards[name])) / len(calls[name])
        step = f"{statistics.median(plain_steps) * 1000:.1f} ms" if plain_steps else "none"
        parts.append(f"{name}: one-token forward of {size} rows {step}, outside the forwards {outside:.2f} s a call")
    return "; ".join(parts)


def report(size: int, calls: dict, same: bool, metrics, forwards: dict, sampled: bool) -> None:
    seconds = {name: sum(times) for name, times in calls.items()}
    # Per call, the ratio of neighbouring calls on the same prompts: a slow spell of a shared machine that hits one
    # call moves the median less than the sums.
    ratios = {base: [b / s for b, s in zip(calls[base], calls["speculative"])] for base in ("plain", "faster weights")}
    per_call = {base: statistics.median(r) for base, r in ratios.items()}
    # The middle half of the per-call ratios: how far apart neighbouring calls of this machine fell.
    low, _, high = statistics.quantiles(ratios["faster weights"], n=4) if len(calls["speculative"]) > 1 else [0.0] * 3
    print(
        f"batch {size}: speedup {seconds['plain'] / seconds['speculative']:.2f}x over plain generate(), "
        f"{seconds['faster weights'] / seconds['speculative']:.2f}x over it on the faster weights "
        f"(plain {seconds['plain']:.1f} s, faster weights {seconds['faster weights']:.1f} s, "
        f"speculative {seconds['speculative']:.1f} s, {len(calls['speculative'])} calls each; median per call "
        f"{per_call['plain']:.2f}x and {per_call['faster weights']:.2f}x, the middle half of the latter "
        f"{low:.2f}-{high:.2f}x), "
        f"identical: {'n/a (sampled)' if sampled else 'yes' if same else 'NO'}, "
        f"tokens/step {metrics.mean_tokens_per_step:.2f}, "
        f"steps by k {metrics.steps_by_depth}, verify ms by k "
        f"{ {k: round(s * 1000, 1) for k, s in metrics.mean_verify_seconds.items()} }; "
        f"{step_breakdown(size, calls, forwards)}",
        flush=True,
    )


def main():
    args = parse_args()
    model, tokenizer, speculator = load_pair(None, args.speculator)
    print(machine_description(), flush=True)
    prompts = [p[0].tolist() for p in encode_prompts(tokenizer, evaluation_prompts()[: args.num_prompts])]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    for size in [int(s) for s in args.batch_sizes.split(",")]:
        batches = [left_padded(prompts[i : i + size], pad) for i in range(0, len(prompts) - size + 1, size)]
        report(size, *time_calls(model, speculator, batches, args, pad), sampled=args.temperature is not None)


if __name__ == "__main__":
    main()
