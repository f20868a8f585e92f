"""Host-device synchronisations per verifier forward, per decoding mode, on a tiny random model (CPU, seconds).

    python benchmarks/host_syncs.py [--cost-aware]

Counts what `tests/test_host_syncs.py` bounds: this package's reads of device values and tensors built from host
values, which on a GPU each wait for all queued work. By default every step drafts every head (the constant schedule);
`--cost-aware` lets the controller choose.
"""

import argparse
import contextlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_host_syncs import CASES, count_syncs  # noqa: E402

from hf_mlp_speculator import FixedDepth, SpeculationState  # noqa: E402
from hf_mlp_speculator.generation import mixin as generation


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cost-aware", action="store_true", help="let the controller choose each step's depth")
    args = parser.parse_args()
    if not args.cost_aware:
        SpeculationState.policy = FixedDepth()  # every pair drafts all its heads
    generation.adaptive_weights = contextlib.nullcontext  # no timing forwards on other weights in the counts
    print("| case | ours per forward | transformers' per forward | forwards |\n|---|---:|---:|---:|")
    for name, (rows, kwargs, _) in CASES.items():
        torch.manual_seed(0)
        ours, forwards, _, others = count_syncs(rows, max_new_tokens=40, **kwargs)
        print(f"| {name} | {ours / forwards:.1f} | {others / forwards:.1f} | {forwards} |")


if __name__ == "__main__":
    main()
