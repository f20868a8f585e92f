"""What one draft head costs on this CPU in float32 and in bfloat16, and whether bfloat16 heads keep their drafts.

    python benchmarks/head_dtype.py                # the default speculator, batch 1 and 8
    python benchmarks/head_dtype.py --speculator DIR

Drafts never change the output (the verifier checks them), so the heads may run in whatever dtype is cheapest where
their drafts hold. On CPUs with AVX-512 BF16 or AMX, oneDNN multiplies bfloat16 faster than float32, and a head reads
half the bytes. This times each head's step (projection, embedding, norm, activation, the head over the vocabulary,
the argmax and the draft's confidence) both ways, interleaved, and counts how often bfloat16 heads draft the tokens the
float32 ones draft, on the verifier's hidden states of held-out prompts.
"""

import argparse
import statistics
import time

import torch

from hf_mlp_speculator.drafting.drafts import draft_chain
from hf_mlp_speculator.tools.default_models import evaluation_prompts
from hf_mlp_speculator.tools.runs import encode_prompts, load_pair, machine_description


def head_chain(heads, hidden, token, depth):
    """A greedy chain of `depth` drafts, as decoding drafts it."""
    return draft_chain(heads, hidden, token, None, depth).tokens[:, 1:]


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--speculator", help="a folder (default: the default speculator)")
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    model, tokenizer, speculator = load_pair(None, args.speculator)
    print(machine_description())
    fp32 = speculator.speculator
    bf16 = type(speculator)(speculator.config).speculator
    bf16.load_state_dict(fp32.state_dict())
    bf16.to(torch.bfloat16)
    depth = speculator.config.n_predict
    # The verifier's hidden states and tokens of held-out prompts, as drafting sees them.
    prompts = encode_prompts(tokenizer, evaluation_prompts()[:16])
    states, tokens = [], []
    for ids in prompts:
        out = model(ids, output_hidden_states=True)
        states.append(out.hidden_states[-1][0])
        tokens.append(out.logits[0].argmax(dim=-1))
    states, tokens = torch.cat(states), torch.cat(tokens)
    same = (head_chain(fp32, states, tokens, depth) == head_chain(bf16, states.bfloat16(), tokens, depth)).float()
    print(f"bfloat16 heads draft the float32 heads' token, per head: "
          f"{', '.join(f'{x:.3f}' for x in same.mean(dim=0).tolist())} ({len(states)} positions)")
    for rows in (1, 8):
        index = torch.arange(rows)
        times = {"float32": [], "bfloat16": []}
        for _ in range(args.repeats):
            runs = (("float32", fp32, states[index]), ("bfloat16", bf16, states[index].bfloat16()))
            for name, heads, hidden in runs:
                start = time.perf_counter()
                head_chain(heads, hidden, tokens[index], depth)
                times[name].append((time.perf_counter() - start) / depth)
        fp, bf = (statistics.median(times[name]) * 1000 for name in ("float32", "bfloat16"))
        print(f"batch {rows}: one head {fp:.3f} ms in float32, {bf:.3f} ms in bfloat16 ({fp / bf:.2f}x)")


if __name__ == "__main__":
    main()
