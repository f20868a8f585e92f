"""Plain greedy vs prompt lookup vs MLPSpeculator (1..n heads) vs speculative sampling, in one run.

    python benchmarks/run_bench.py [--output-dir bench_results] [--num-prompts 8] [--max-new-tokens 128]
    python benchmarks/run_bench.py --verify-cost   # verify cost ratio by k and draft cost per head

The same as `hf-mlp-speculator bench`; writes bench.json, bench.md and bench.png (with matplotlib).
"""

import sys

from hf_mlp_speculator.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
