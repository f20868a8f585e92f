"""The cost-aware controller's host time per step: its plan, the chain's cut and what it records, with no model.

    python benchmarks/controller_cost.py                  # batch 1, 8 and 32, a few seconds
    python benchmarks/controller_cost.py --steps 5000 --batch-sizes 8

A step of the package's loop runs the controller in Python on the host whatever the device: on the default pair on
a 2-core CPU a plain step costs 45-50 ms at batch 1 (measured 2026-12-06), so 0.3 ms of planning is under 1% of it,
and on a GPU, where a small model's step takes a few ms, more. The cost model here is filled as a CPU fills it
(`filled_cost_model` of the tests: verifying k + 1 tokens costs 1 + 0.1 k plain steps, a head 2% of one), the
acceptance is that of a fair speculator (0.7, 0.5, 0.35, 0.25 per head) with each row's confidences drawn at random,
so the controller drafts at varying depths and cuts chains, as on a real pair. Prints microseconds per step (median
of `--repeats`) and the depths it chose.
"""

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_cost_aware import filled_cost_model  # noqa: E402

from hf_mlp_speculator.drafting.controller import AcceptanceEstimate, SpeculationController  # noqa: E402

HEADS, CACHE, STEP_SECONDS = 4, 300, 0.025


def kept(rng: random.Random, rates: list[float], depth: int) -> int:
    """How many of a row's `depth` drafts the verifier keeps: head `h` with chance `rates[h]` after those before."""
    return next((h for h in range(depth) if rng.random() >= rates[h]), depth)


def run(rows: int, steps: int) -> tuple[float, list[int]]:
    """Seconds per step of the controller's own work, and how many steps chose each depth."""
    verify = [STEP_SECONDS * (1 + 0.1 * k) for k in range(HEADS + 1)]
    costs = filled_cost_model(verify, draft=0.02 * STEP_SECONDS, cache_length=CACHE)
    acceptance, rng = AcceptanceEstimate(HEADS), random.Random(0)
    rates = [0.7, 0.5, 0.35, 0.25]
    confidences = [[rng.random() for _ in range(HEADS)] for _ in range(256)]
    acceptance.record(confidences, [HEADS] * 256, [kept(rng, rates, HEADS) for _ in range(256)])
    controller = SpeculationController(lambda r: costs, acceptance, HEADS)
    start = time.perf_counter()
    for _ in range(steps):
        planned = controller.start_step(CACHE, rows, remaining=64)
        depth = controller.chain_depth(planned)
        if depth:
            drafted = [[rng.random() for _ in range(depth)] for _ in range(rows)]
            if controller.cuts:
                depth = controller.chain_end(drafted, [depth] * rows)
            acceptance.record(drafted, [depth] * rows, [kept(rng, rates, depth) for _ in range(rows)])
            controller.record_drafts(controller.step, depth, depth * 0.02 * STEP_SECONDS)
        controller.end_step(controller.step, depth, STEP_SECONDS * (1 + 0.1 * depth))
    return (time.perf_counter() - start) / steps, controller.depth_counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    for rows in map(int, args.batch_sizes.split(",")):
        runs = [run(rows, args.steps) for _ in range(args.repeats)]
        seconds = statistics.median(s for s, _ in runs)
        print(f"batch {rows:>2}: {seconds * 1e6:6.1f} us per step, steps by depth {runs[0][1]}")


if __name__ == "__main__":
    main()
