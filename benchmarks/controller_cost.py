"""The cost-aware controller's host time per step: its plan, the chain's cut and what it records, with no model.

    python benchmarks/controller_cost.py                  # batch 1, 8 and 32, a few seconds
    python benchmarks/controller_cost.py --steps 5000 --batch-sizes 8

A step of the package's loop runs the controller in Python on the host whatever the device: on the default pair on
a CPU a plain step costs about 25 ms at batch 1, so 0.1 ms of planning is 0.4% of it, and on a GPU, where a small
model's step takes a few ms, more. The cost model here is filled as a CPU fills it (verifying k + 1 tokens costs
1 + 0.1 k plain steps, a head 2% of one), the acceptance is that of a fair speculator (0.7, 0.5, 0.35, 0.25 per head)
with each row's confidences drawn at random, so the controller drafts at varying depths and cuts chains, as on a real
pair. Prints microseconds per step (median of `--repeats`) and the depths it chose.
"""

import argparse
import random
import statistics
import time

from hf_mlp_speculator.drafting.controller import AcceptanceEstimate, SpeculationController
from hf_mlp_speculator.drafting.cost_model import CostModel

HEADS, CACHE, STEP_SECONDS = 4, 300, 0.025


def filled_cost_model() -> CostModel:
    costs = CostModel()
    for tokens in range(1, HEADS + 2):
        for seconds in (1.0, STEP_SECONDS * (1 + 0.1 * (tokens - 1))):  # a first timing is left out: one-time costs
            costs.record_verify(CACHE, tokens, seconds)
    for head in range(HEADS):
        for seconds in (1.0, 0.02 * STEP_SECONDS):
            costs.record_draft(head, seconds)
    return costs


def kept(rng: random.Random, rates: list[float], depth: int) -> int:
    """How many of a row's `depth` drafts the verifier keeps: head `h` with chance `rates[h]` after those before."""
    return next((h for h in range(depth) if rng.random() >= rates[h]), depth)


def run(rows: int, steps: int) -> tuple[float, list[int]]:
    """Seconds per step of the controller's own work, and how many steps chose each depth."""
    acceptance, costs, rng = AcceptanceEstimate(HEADS), filled_cost_model(), random.Random(0)
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
