"""How much a batch could gain by verifying a draft only in the steps where its rows' first drafts look good.

    python benchmarks/gating_headroom.py                       # the default speculator, batch 8
    python benchmarks/gating_headroom.py --batch-size 32 --verify-costs 1.5,1.7

The controller plans each step's depth before drafting, from each head's mean acceptance; at batch 8 on a 2-core CPU
that is mostly depth 0. A step could instead always run head 0 (a probe), and verify its drafts only when the rows'
calibrated confidences say they pay. This measures the ceiling of that idea, with no timing at all: on the validation
prompts (held out from training; never the evaluation prompts), the base model writes greedy answers, head 0 drafts at
every position from the base's hidden state, and its confidence is calibrated (10 bins) on each half of the prompts for
the other: an offline calibration on thousands of drafts, finer than the controller's running one
(`AcceptanceEstimate`: 5 bins, about its last 50 steps), so that the figure is a ceiling. Steps of `--batch-size`
positions drawn at random from all of them, each with the other half's calibration, then verify one draft per row
always, or when the rows' mean calibrated acceptance beats the verify cost; each figure is tokens per unit of cost over
plain decoding (1.0), where verifying one draft per row costs `--verify-costs` plain steps and head 0 `--probe-cost`
(both ways draft it every step). Rows are independent draws here, so a real batch, which waits for its slowest row,
gains less.
"""

import argparse

import numpy as np
import torch

from hf_mlp_speculator.tools.runs import encode_prompts, load_pair
from hf_mlp_speculator.utils.package_data import VALIDATION_PROMPTS, read_prompts

BINS = 10


@torch.no_grad()
def head_zero_outcomes(model, tokenizer, heads, prompts, max_new_tokens: int) -> list[list[tuple[float, bool]]]:
    """Per prompt and position of the base's greedy answer: head 0's confidence in its draft, and if it was right."""
    outcomes = []
    for input_ids in encode_prompts(tokenizer, prompts):
        sequence = model.generate(input_ids, max_new_tokens=max_new_tokens, do_sample=False,
                                  pad_token_id=tokenizer.eos_token_id)  # fmt: skip
        hidden = model(sequence, output_hidden_states=True).hidden_states[-1][0]
        sequence = sequence[0]
        # Position i's state predicted token i + 1; head 0 takes both and drafts token i + 2.
        start, end = input_ids.shape[1] - 1, sequence.shape[0] - 2
        _, logits = heads.step(0, heads.input_state(hidden[start:end]), sequence[start + 1 : end + 1])
        probabilities = logits.float().softmax(-1)
        right = probabilities.argmax(-1) == sequence[start + 2 : end + 2]
        outcomes.append(list(zip(probabilities.amax(-1).tolist(), right.tolist())))
    return outcomes


def calibrated(fit, test) -> tuple[np.ndarray, np.ndarray]:
    """`test`'s calibrated acceptance (from `fit`'s per-bin rates, Laplace-smoothed) and its outcomes."""

    def binned(prompts):
        confidence, right = np.array([pair for prompt in prompts for pair in prompt], dtype=np.float64).T
        return np.clip((confidence * BINS).astype(int), 0, BINS - 1), right

    bins, right = binned(fit)
    rate = np.array([(right[bins == b].sum() + 1) / ((bins == b).sum() + 2) for b in range(BINS)])
    test_bins, test_right = binned(test)
    return rate[test_bins], test_right


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--speculator", help="a folder (default: the default speculator)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--verify-costs", default="1.22,1.27,1.31,1.38",
                        help="plain steps that verifying one draft per row costs (cost_aware_ratio.py's verify ms)")
    parser.add_argument("--probe-cost", type=float, default=0.014, help="plain steps head 0 costs (head_dtype.py)")
    parser.add_argument("--steps", type=int, default=20000)
    args = parser.parse_args()
    model, tokenizer, speculator = load_pair(None, args.speculator)
    prompts = read_prompts(VALIDATION_PROMPTS)
    outcomes = head_zero_outcomes(model, tokenizer, speculator.speculator, prompts, args.max_new_tokens)
    rng = np.random.default_rng(0)
    order = rng.permutation(len(outcomes))
    halves = [outcomes[i] for i in order[::2]], [outcomes[i] for i in order[1::2]]
    expected, right = map(np.concatenate, zip(calibrated(*halves), calibrated(*halves[::-1])))
    halves_right = " and ".join(f"{np.mean([r for prompt in half for _, r in prompt]):.3f}" for half in halves)
    print(f"{len(prompts)} validation prompts; head 0 right at {right.mean():.3f} of their positions ({halves_right} "
          f"in the two halves; calibrated {expected.mean():.3f}); batch {args.batch_size}, {args.steps} steps per "
          "figure")  # fmt: skip
    rows = rng.integers(len(right), size=(args.steps, args.batch_size))
    gains, chances = right[rows].mean(1), expected[rows].mean(1)
    for cost in map(float, args.verify_costs.split(",")):
        always = (1 + gains).sum() / ((cost + args.probe_cost) * args.steps)
        verify = chances > cost - 1
        gated = (1 + gains * verify).sum() / (1 + (cost - 1) * verify + args.probe_cost).sum()
        print(f"verify cost {cost:.2f}: always {always:.3f}x, gated with the probe {gated:.3f}x "
              f"(verifies {verify.mean():.0%} of steps)")  # fmt: skip


if __name__ == "__main__":
    main()
