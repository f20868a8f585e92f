"""Plain, prompt lookup, speculator and hybrid greedy decoding side by side, on the grounded and the chat prompts.

    python benchmarks/hybrid_drafting.py --num-prompts 8 --max-new-tokens 96

The four modes take turns prompt by prompt (as in `hf-mlp-speculator bench`), on the default pair unless --model and
--speculator say otherwise, each on the weights as loaded: speculative modes take the fast verify path by themselves. Writes bench_results/hybrid_drafting.{json,md}.
"""

import argparse
import json
from pathlib import Path

from hf_mlp_speculator.tools.bench import Mode, markdown_table, run_modes, summarize
from hf_mlp_speculator.tools.default_models import evaluation_prompts, grounded_prompts
from hf_mlp_speculator.tools.runs import add_model_arguments, encode_prompts, load_pair


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--prompt-lookup-num-tokens", type=int, default=10)
    parser.add_argument("--output-dir", default="bench_results")
    args = parser.parse_args()
    model, tokenizer, speculator = load_pair(args.model, args.speculator, args.dtype)
    greedy = {"do_sample": False}
    lookup = {"prompt_lookup_num_tokens": args.prompt_lookup_num_tokens}
    modes = [
        Mode("plain greedy", greedy, "plain greedy"),
        Mode("prompt lookup", {**greedy, **lookup}, "plain greedy"),
        Mode("speculator", {**greedy, "assistant_model": speculator}, "plain greedy"),
        Mode("hybrid", {**greedy, "assistant_model": speculator, **lookup}, "plain greedy"),
    ]
    results, tables = {}, []
    for name, texts in (("grounded", grounded_prompts()), ("chat", evaluation_prompts())):
        prompts = encode_prompts(tokenizer, texts[: args.num_prompts])
        runs = run_modes(model, modes, prompts, args.max_new_tokens, seed=0)
        rows = summarize(modes, runs)
        for row, mode in zip(rows, modes):
            metrics = runs[mode.name].speculation_metrics
            if metrics is not None:
                row["lookup_drafts"], row["lookup_accepted"] = (
                    metrics.num_lookup_draft_tokens, metrics.num_lookup_accepted_tokens
                )
        results[name] = rows
        tables.append(f"### {name} prompts ({len(prompts)} x {args.max_new_tokens} tokens)\n\n" + markdown_table(rows))
        print(tables[-1])
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    settings = {"num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens,
                "prompt_lookup_num_tokens": args.prompt_lookup_num_tokens}
    (output_dir / "hybrid_drafting.json").write_text(json.dumps({"settings": settings, "results": results}, indent=2))
    (output_dir / "hybrid_drafting.md").write_text("\n".join(tables))


if __name__ == "__main__":
    main()
