"""KV cache slots per generated token in batched speculative decoding, with and without freeing rejected drafts' slots.

    python benchmarks/cache_slots.py --batch-size 8 --max-new-tokens 256 --shares inf,0.2,0.1,0.05
    python benchmarks/cache_slots.py --batch-size 8 --max-new-tokens 1024 --shares inf,0.05 --schedule heuristic

One batch of held-out prompts (never trained on) on the default pair, plain greedy `generate()` and speculative
`generate()` taking turns, once per compaction threshold (`cache_slots.COMPACT_SHARE`; `inf`: never). By
default every step drafts all heads (`num_assistant_tokens_schedule="constant"`), which leaves the most rejected
slots. Prints the most slots per row the cache held, per generated token (`(cache_slots - prompt width) / new
tokens`), and the speed against plain `generate()` in the same run.
"""

import argparse
import time

import torch

from hf_mlp_speculator.generation import cache_slots
from hf_mlp_speculator.tools.default_models import evaluation_prompts
from hf_mlp_speculator.tools.runs import encode_prompts, load_pair
from hf_mlp_speculator.training.documents import left_padded


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--shares", default="inf,0.05", help="compaction thresholds to compare, comma-separated")
    parser.add_argument("--schedule", default="constant", help="num_assistant_tokens_schedule of the calls")
    args = parser.parse_args()
    model, tokenizer, speculator = load_pair(None, None)
    prompts = [p[0].tolist() for p in encode_prompts(tokenizer, evaluation_prompts()[: args.batch_size])]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    input_ids, mask = left_padded(prompts, pad)
    settings = dict(attention_mask=mask, max_new_tokens=args.max_new_tokens, do_sample=False)
    speculative = dict(assistant_model=speculator, num_assistant_tokens_schedule=args.schedule)
    model.generate(input_ids, **{**settings, "max_new_tokens": 8}, **speculative)  # one-time costs
    model.generate(input_ids, **{**settings, "max_new_tokens": 8})
    print(f"batch {args.batch_size}, {args.max_new_tokens} new tokens, schedule {args.schedule}, prompt width "
          f"{input_ids.shape[1]}")  # fmt: skip
    print("| COMPACT_SHARE | cache slots per generated token | tokens per step | speedup over plain generate() |")
    print("|---|---:|---:|---:|")
    for share in [float(s) for s in args.shares.split(",")]:
        cache_slots.COMPACT_SHARE = share
        start = time.perf_counter()
        plain = model.generate(input_ids, **settings)
        plain_seconds = time.perf_counter() - start
        start = time.perf_counter()
        output = model.generate(input_ids, **settings, **speculative)
        seconds = time.perf_counter() - start
        assert torch.equal(output, plain), "speculative output differs from plain greedy"
        metrics = speculator.speculation_metrics
        slots = (metrics.cache_slots - input_ids.shape[1]) / (plain.shape[1] - input_ids.shape[1])
        print(f"| {share:g} | {slots:.2f} | {metrics.mean_tokens_per_step:.2f} | {plain_seconds / seconds:.2f}x |")


if __name__ == "__main__":
    main()
