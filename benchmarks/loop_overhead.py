"""Where a speculative step's host time goes, on a model whose forward is dispatch-bound, as a big model's is on a GPU.

    python benchmarks/loop_overhead.py                 # batch 1 and 8, our loop and transformers' loop, ~3 minutes
    python benchmarks/loop_overhead.py --batch-sizes 1 --repeats 3
    python benchmarks/loop_overhead.py --real-model    # the default pair at batch 1, 8 and 32, ~10 minutes

On a GPU, HF eager decoding of an 8B model is bound by the host launching kernels, not by the GPU running them: every
tensor operation the decoding loop adds around the verifier's forward costs about what it costs on a CPU. A Llama 64
wide with 32 layers, on one CPU thread, is such a model: its forward is ~2,300 small operations. So this measures the
loop's own cost on the CPU, per step:

- time: a plain `generate()` step, a step of the speculative loop at each forced depth k = 0..4, and the verifier's
  bare forward over k + 1 tokens and the speculator's k heads on a cache of the same length; from these, a k = 0 step
  in plain steps and what a depth-k step costs beyond its forward and heads (both want to be ~1 and ~0);
- the operations dispatched outside the verifier's forward (aten ops: on a GPU each is a launch or a view), and the
  reads of device values on the host (each waits for the GPU), per step, all of them, transformers' own included;
- each phase's milliseconds per step in the package's loop (draft, verify, accept and emit, the cache, the rest).

Depths are forced (`num_assistant_tokens_schedule="constant"` for k >= 1; k = 0 by fixing the controller's choice)
and the speculator is random: it accepts nothing, so every step crops its rejected drafts, the worst case. Times are
medians over `--repeats` runs in this process; the ratios are what to read, not the milliseconds.

`--real-model` measures the same k = 0 step on the offline default pair (SmolLM2-135M-Instruct, two threads), on
left-padded batches of the held-out chat prompts, against plain `generate()` on the fastest kind of weights
(`fast_cpu_decoding`), which is what a speculative call that decides not to draft must cost. End-of-sequence
is off, so that every row decodes every token in both calls.
"""

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_host_syncs import HostSyncs  # noqa: E402
from test_loop_overhead import OperationCount  # noqa: E402

from hf_mlp_speculator import FixedDepth, MLPSpeculatorConfig, MLPSpeculatorPreTrainedModel, speculation_state  # noqa: E402
from hf_mlp_speculator.drafting.drafts import scored_step  # noqa: E402
from hf_mlp_speculator.generation import mixin as generation
from hf_mlp_speculator.generation.cache_slots import CacheSlots  # noqa: E402
from hf_mlp_speculator.generation.speculative_decoding import SpeculativeBatch  # noqa: E402
from hf_mlp_speculator.generation.transformers_hooks import cache_kwargs, output_cache  # noqa: E402
from hf_mlp_speculator.tools.runs import ForwardClock  # noqa: E402

VOCAB, PROMPT, NEW_TOKENS, HEADS = 512, 32, 48, 4
# Each phase of a step: the methods it runs, on the loop (`SpeculativeBatch`) or on its cache slots (`CacheSlots`).
PHASES = {"draft": [(SpeculativeBatch, "draft")], "verify": [(SpeculativeBatch, "verify")],
          "accept": [(SpeculativeBatch, name) for name in ("accept_chain", "accept_tree", "emit")],
          "cache": [(CacheSlots, "keep")], "next_step": [(SpeculativeBatch, "next_step")]}  # fmt: skip


def proxy_pair(layers: int = 32):
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=4096, pad_token_id=0,
                         eos_token_id=None, bos_token_id=0)  # fmt: skip
    verifier = LlamaForCausalLM(config).eval()
    speculator = MLPSpeculatorPreTrainedModel(
        MLPSpeculatorConfig(vocab_size=VOCAB, emb_dim=64, inner_dim=64, n_predict=HEADS, top_k_tokens_per_head=[1] * 4)
    ).eval()
    return verifier, speculator


def generate_call(verifier, speculator, prompts, depth: int | None, loop: str, new_tokens: int, mask=None):
    """One greedy call: plain (`depth` None), or speculative at a forced depth in `loop`."""
    mask = torch.ones_like(prompts) if mask is None else mask
    kwargs = dict(attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)
    if depth is not None:
        kwargs.update(assistant_model=speculator, num_assistant_tokens=max(depth, 1),
                      num_assistant_tokens_schedule="constant" if depth else "heuristic")  # fmt: skip
        if loop == "transformers":  # per-token scores are what sends a call to transformers' loop
            kwargs.update(return_dict_in_generate=True, output_scores=True)
    with torch.no_grad():
        return verifier.generate(prompts, **kwargs)


def forwards_of(speculator, depth):
    if depth is None:
        return None
    return sum(speculator.speculation_metrics.steps_by_depth)


def per_step(verifier, speculator, prompts, depth, loop, mask=None, new_tokens=NEW_TOKENS):
    """
    (seconds per decode step, of which outside the verifier's forward) of one call, from the end of its prefill
    forward to its return: both per verifier forward of the decode steps, measured in the same run, so that a slow
    spell of the machine scales both.
    """
    with ForwardClock(verifier) as clock:
        generate_call(verifier, speculator, prompts, depth, loop, 1 + new_tokens, mask)
        end = time.perf_counter()
    decode, steps = end - clock.forwards[0].end, clock.forwards[1:]
    inside = sum(step.end - step.start for step in steps)
    return decode / len(steps), (decode - inside) / len(steps)


def counts_per_step(verifier, speculator, prompts, depth, loop):
    """(operations outside the verifier's forward, host reads) per verifier forward of the decode steps."""
    results = []
    for new_tokens in (4, 4 + NEW_TOKENS):
        with OperationCount(verifier) as operations, HostSyncs() as reads:
            generate_call(verifier, speculator, prompts, depth, loop, new_tokens)
        forwards = forwards_of(speculator, depth) or new_tokens - 1
        results.append((operations.outside, sum(reads.ours.values()) + reads.others, forwards))
    (ops_a, reads_a, fa), (ops_b, reads_b, fb) = results
    return (ops_b - ops_a) / (fb - fa), (reads_b - reads_a) / (fb - fa)


@torch.no_grad()
def bare_costs(verifier, speculator, rows: int, repeats: int = 10) -> dict:
    """Median seconds of the verifier's forward over m = 1..5 new tokens per row, and of one head, on a cache."""
    generator = torch.Generator().manual_seed(1)
    context = torch.randint(1, VOCAB, (rows, PROMPT + NEW_TOKENS // 2), generator=generator)
    prefill = verifier(context, use_cache=True, output_hidden_states=-1)
    cache = output_cache(prefill)
    out = {}
    for m in range(1, HEADS + 2):
        tokens = torch.randint(1, VOCAB, (rows, m), generator=generator)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            verifier(tokens, use_cache=True, output_hidden_states=-1, **cache_kwargs(verifier, cache))
            times.append(time.perf_counter() - start)
            cache.crop(-m)
        out[m] = statistics.median(times)
    heads, token = speculator.speculator, torch.randint(1, VOCAB, (rows,), generator=generator)
    state = heads.input_state(prefill.hidden_states[-1][:, -1])
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        _, logits, _ = scored_step(heads, 0, state, token)
        logits.softmax(dim=-1).gather(1, logits.argmax(dim=-1)[:, None])  # what greedy drafting does with them
        times.append(time.perf_counter() - start)
    out["head"] = statistics.median(times)
    return out


def phase_times(verifier, speculator, prompts, depth, repeats) -> dict:
    """Milliseconds per step of each phase of the package's loop (`PHASES`), medians over runs."""
    spent = {name: [] for name in PHASES}
    originals = {(owner, method): getattr(owner, method) for methods in PHASES.values() for owner, method in methods}

    def timed(phase, method):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                totals[phase] += time.perf_counter() - start

        return wrapper

    try:
        for name, methods in PHASES.items():
            for owner, method in methods:
                setattr(owner, method, timed(name, originals[owner, method]))
        for _ in range(repeats):
            totals = dict.fromkeys(PHASES, 0.0)
            start = time.perf_counter()
            generate_call(verifier, speculator, prompts, depth, "ours", 4 + NEW_TOKENS)
            total = time.perf_counter() - start
            forwards = forwards_of(speculator, depth)
            for name in PHASES:
                spent[name].append(totals[name] / forwards * 1000)
            spent.setdefault("whole call", []).append(total / forwards * 1000)
    finally:
        for (owner, method), original in originals.items():
            setattr(owner, method, original)
    # `step` wraps draft, verify, accept and the cache slots' keep: what is left of a call is prefill and the loop's glue.
    return {name: statistics.median(values) for name, values in spent.items()}


def real_model(batch_sizes: list[int], repeats: int, new_tokens: int = 64) -> None:
    """A k = 0 step of the package's loop against plain `generate()` on the faster weights, on the default pair."""
    from hf_mlp_speculator import fast_cpu_decoding
    from hf_mlp_speculator.tools.runs import encode_prompts, load_pair, machine_description
    from hf_mlp_speculator.utils.batching import left_padded
    from hf_mlp_speculator.utils.package_data import evaluation_prompts

    verifier, tokenizer, speculator = load_pair(None, None)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    verifier.generation_config.update(eos_token_id=None, pad_token_id=pad)
    speculation_state(verifier, speculator).policy = FixedDepth(0)
    prompts = [p[0].tolist() for p in encode_prompts(tokenizer, evaluation_prompts())]
    print(f"{machine_description()}\n\n| batch | plain step on the faster weights, ms | k = 0 step, plain steps "
          "| outside the forward, ms: plain / k = 0 |\n|---:|---:|---:|---:|")  # fmt: skip
    for rows in batch_sizes:
        input_ids, mask = left_padded([prompts[i % len(prompts)] for i in range(rows)], pad)

        def plain():
            with fast_cpu_decoding(verifier):
                return per_step(verifier, speculator, input_ids, None, "ours", mask, new_tokens)

        plain()  # warm-up: the weights' choice of each shape, the first timings of each kind
        per_step(verifier, speculator, input_ids, 0, "ours", mask, new_tokens)
        rounds = [(plain(), per_step(verifier, speculator, input_ids, 0, "ours", mask, new_tokens))
                  for _ in range(repeats)]  # fmt: skip
        step = statistics.median(p[0] for p, _ in rounds)
        ratio = statistics.median(k[0] / p[0] for p, k in rounds)
        outside = [statistics.median(r[i][1] for r in rounds) * 1000 for i in (0, 1)]
        print(f"| {rows} | {step * 1000:.1f} | {ratio:.3f} | {outside[0]:.2f} / {outside[1]:.2f} |", flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--loops", default="ours,transformers", help="which loops to measure at batch 1")
    parser.add_argument("--real-model", action="store_true", help="the k = 0 step on the default pair (batch 1,8,32)")
    args = parser.parse_args(argv)
    if args.real_model:
        batch_sizes = "1,8,32" if args.batch_sizes == parser.get_default("batch_sizes") else args.batch_sizes
        return real_model([int(b) for b in batch_sizes.split(",")], args.repeats)
    torch.set_num_threads(1)
    generation.adaptive_weights = contextlib.nullcontext  # the weights as they are: their choice is measured elsewhere
    verifier, speculator = proxy_pair(args.layers)
    verifier.generation_config.assistant_confidence_threshold = 0.0
    # k = 0 steps where the call's schedule is cost-aware: the controller's host work runs, and decides nothing.
    speculation_state(verifier, speculator).policy = FixedDepth(0)
    for rows in [int(b) for b in args.batch_sizes.split(",")]:
        prompts = torch.randint(1, VOCAB, (rows, PROMPT), generator=torch.Generator().manual_seed(rows))
        loops = [loop for loop in args.loops.split(",") if rows == 1 or loop == "ours"]
        configs = [(loop, depth) for loop in loops for depth in range(HEADS + 1)]
        # Every configuration once per round, rounds repeated: a slow spell of the machine hits all of them.
        rounds = []
        for _ in range(args.repeats):
            bare = bare_costs(verifier, speculator, rows)
            plain = per_step(verifier, speculator, prompts, None, "ours")
            steps = {config: per_step(verifier, speculator, prompts, config[1], config[0]) for config in configs}
            rounds.append((plain, bare, steps))

        def median(value):
            return statistics.median(value(*r) for r in rounds)

        plain_ops, plain_reads = counts_per_step(verifier, speculator, prompts, None, "ours")
        print(f"\n## batch {rows}: plain generate() step {median(lambda p, b, s: p[0]) * 1000:.2f} ms, of which "
              f"{median(lambda p, b, s: p[1]) * 1000:.2f} ms outside the forward: {plain_ops:.0f} operations, "
              f"{plain_reads:.1f} host reads; bare forward over 1 / 5 tokens "
              f"{median(lambda p, b, s: b[1] / p[0]):.2f} / "
              f"{median(lambda p, b, s: b[5] / p[0]):.2f} plain steps, "
              f"one head {median(lambda p, b, s: b['head'] / p[0]):.3f} (medians of {args.repeats} rounds)\n")
        print("| loop | k | step, plain steps | beyond plain step's host time, plain steps | beyond its forward "
              "and heads, plain steps | loop efficiency | operations / step | host reads / step |\n"
              "|---|---:|---:|---:|---:|---:|---:|---:|")
        for loop, depth in configs:
            step = median(lambda p, b, s: s[loop, depth][0] / p[0])
            # Host time outside the verifier's forward against plain generate()'s: the loop's own cost.
            host = median(lambda p, b, s: (s[loop, depth][1] - p[1]) / p[0])
            # Everything outside the forward but the heads (the bare heads' cost, from the cost profile).
            beyond = median(lambda p, b, s: (s[loop, depth][1] - depth * b["head"]) / p[0])
            # The cost profile's forward and heads over the step measured: the verifier's bare forward over
            # k + 1 tokens, timed apart, and k heads.
            efficiency = median(lambda p, b, s: (b[depth + 1] + depth * b["head"]) / s[loop, depth][0])
            ops, reads = counts_per_step(verifier, speculator, prompts, depth, loop)
            print(f"| {loop} | {depth} | {step:.3f} | {host:+.3f} | {beyond:.3f} | {efficiency:.2f} | {ops:.0f} | "
                  f"{reads:.1f} |", flush=True)
        print("\nms per step in the package's loop, by phase (draft includes the heads, verify the forward):\n")
        print("| k | " + " | ".join(PHASES) + " | whole call |\n|---:|" + "---:|" * (len(PHASES) + 1))
        for depth in (0, HEADS):
            times = phase_times(verifier, speculator, prompts, depth, args.repeats)
            print(f"| {depth} | " + " | ".join(f"{times[name]:.2f}" for name in [*PHASES, "whole call"]) + " |")


if __name__ == "__main__":
    main()
