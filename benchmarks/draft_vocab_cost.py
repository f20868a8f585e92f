"""What a reduced draft vocabulary saves per draft head: the default speculator against its full-vocabulary copy.

    python benchmarks/draft_vocab_cost.py

The copy is `speculator.expand_draft_vocab()`: the same weights, with head rows of zeros outside the draft
vocabulary, so the two differ only in the width of the output layer. Prints each head's cost in milliseconds and as a
share of a plain verifier step, both measured in one run (`bench.measure_verify_cost`).
"""

from hf_mlp_speculator.tools.bench import measure_verify_cost
from hf_mlp_speculator.tools.runs import load_pair


def main():
    model, _, speculator = load_pair(None, None)
    full = speculator.expand_draft_vocab()
    print("| speculator | draft tokens | per-head cost (ms) | per head / plain step |\n|---|---:|---|---|")
    for name, candidate in (("default", speculator), ("expanded to the full vocabulary", full)):
        cost = measure_verify_cost(model, candidate, context_length=300, max_k=1, repeats=30)
        tokens = candidate.config.draft_vocab_size or candidate.config.vocab_size
        ms = ", ".join(f"{m:.2f}" for m in cost["draft_head_ms"])
        share = ", ".join(f"{s:.3f}" for s in cost["draft_cost_per_head"])
        print(f"| {name} | {tokens} | {ms} | {share} |")


if __name__ == "__main__":
    main()
