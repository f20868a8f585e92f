"""How good a default speculator N minutes of training buy, and what each piece of the recipe brings.

    python benchmarks/training_curve.py curve [--minutes 5 10 20 40]
    python benchmarks/training_curve.py ablation [--minutes 10]
    python benchmarks/training_curve.py architecture [--minutes 10]

`curve` trains the default recipe (`default_models.SPECULATOR_TRAINING`) with each `--max-train-minutes` budget;
`ablation` trains it at one budget as it is and with one piece changed at a time; `architecture` trains it at one
budget with MLP heads and with Arctic's LSTM heads. Every speculator is then measured
where it counts: `generate(assistant_model=speculator)` on the held-out evaluation prompts (which no training step and
no tuning saw), greedy, 64 new tokens, every head drafting every step (`assistant_confidence_threshold=0`): tokens per
verifier step and per-head acceptance, against the trainer's own held-out figure (on the validation prompts).

Runs share the target cache, so a longer budget reuses what a shorter one computed; budgets count cached targets at
the time they took to compute, so each run trains as it would from scratch. Results go to
`bench_results/training_curve.{json,md,png}`, `bench_results/ablation.{json,md}` or
`bench_results/architecture.{json,md}`.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

import hf_mlp_speculator  # noqa: F401  (lets generate() take the speculator)
from hf_mlp_speculator.tools.default_models import (
    SPECULATOR_TRAINING,
    TRAIN_PROMPTS,
    VALIDATION_PROMPTS,
    default_base_model,
    evaluation_prompts,
    write_chat_prompts,
)
from hf_mlp_speculator.tools.runs import encode_prompts
from hf_mlp_speculator.training import SpeculatorTrainingArguments, train

# One piece of the recipe changed at a time (issue 11's items 1-4).
ABLATIONS = {
    "default recipe": {},
    "1. hard labels instead of soft distillation": {"loss": "hard"},
    "2. heads start from the base's embeddings": {"init_from_base": True},
    "3. full vocabulary instead of 2048 draft tokens": {"draft_vocab_size": 0},
    "4. no prompts written by the base (Magpie)": {"synthesize_prompts": 0},
}
ARCHITECTURES = {"MLP heads": {"architecture": "mlp"}, "LSTM heads": {"architecture": "lstm"}}


def measure(base, tokenizer, speculator_dir: Path, num_prompts: int, new_tokens: int = 64) -> dict:
    speculator = AutoModel.from_pretrained(speculator_dir).eval()
    total = None
    # This measures the drafts, not the speed: every step drafts every head (transformers' constant schedule).
    for input_ids in encode_prompts(tokenizer, evaluation_prompts()[:num_prompts]):
        base.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                      do_sample=False, assistant_model=speculator, num_assistant_tokens_schedule="constant",
                      assistant_confidence_threshold=0.0)  # fmt: skip
        metrics = speculator.speculation_metrics
        total = metrics if total is None else total + metrics
    history = json.loads((speculator_dir / "trainer_state.json").read_text())["log_history"]
    log = history[-1]
    speeds = [entry["train/positions_per_second"] for entry in history if "train/positions_per_second" in entry]
    return {
        "tokens_per_step": total.mean_tokens_per_step,
        "head_acceptance": total.head_acceptance_rates,
        "validation_tokens_per_step": log["eval/tokens_per_step"],
        "positions_trained": log["step"] * SPECULATOR_TRAINING["batch_size"],
        "positions_per_second": speeds[-1] if speeds else None,
    }


def run(name: str, minutes: float, overrides: dict, work: Path, base, tokenizer, num_prompts: int) -> dict:
    prompts = write_chat_prompts(tokenizer, TRAIN_PROMPTS, work / "chat_prompts.jsonl")
    validation = write_chat_prompts(tokenizer, VALIDATION_PROMPTS, work / "validation_prompts.jsonl")
    # Named by what it trains, so that the curve's point at the ablation's budget is the ablation's default run, reused.
    output_dir = work / ("-".join([f"{minutes:g}min", *(f"{k}={v}" for k, v in sorted(overrides.items()))]))
    settings = {**SPECULATOR_TRAINING, "max_train_minutes": minutes, **overrides}
    args = SpeculatorTrainingArguments(
        base_model=str(default_base_model()), prompts=[str(prompts)], eval_data=[str(validation)],
        output_dir=str(output_dir), resume=(output_dir / "run.json").is_file(), report_to="none", **settings,
    )  # fmt: skip
    result = {"name": name, "minutes": minutes, **overrides}
    state_file = output_dir / "trainer_state.json"
    state = json.loads(state_file.read_text()) if state_file.is_file() else {}
    if not state or state["step"] < state["total_steps"]:  # a finished run (of the other mode) is measured as it is
        start = time.perf_counter()
        train(args)
        result["wall_seconds"] = time.perf_counter() - start
    result.update(measure(base, tokenizer, output_dir, num_prompts))
    print(json.dumps(result), flush=True)
    return result


def table(rows: list[dict], first: str) -> str:
    lines = [
        f"| {first} | tokens/step on evaluation prompts | per-head acceptance | validation tokens/step "
        "| positions trained | positions/s |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        key = f"{r['minutes']:g} min" if first == "budget" else r["name"]
        heads = ", ".join(f"{a:.2f}" for a in r["head_acceptance"])
        speed = f"{r['positions_per_second']:.0f}" if r.get("positions_per_second") else "-"
        lines.append(f"| {key} | {r['tokens_per_step']:.2f} | {heads} | {r['validation_tokens_per_step']:.2f} | "
                     f"{r['positions_trained']} | {speed} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(5, 3.5))
    minutes = [r["minutes"] for r in rows]
    axis.plot(minutes, [r["tokens_per_step"] for r in rows], "o-", label="evaluation prompts (generate)")
    axis.plot(minutes, [r["validation_tokens_per_step"] for r in rows], "s--", label="validation prompts (trainer)")
    axis.set(xscale="log", xticks=minutes, xticklabels=[f"{m:g}" for m in minutes], xlabel="training minutes (2 CPU cores)",
             ylabel="tokens per verifier step")  # fmt: skip
    axis.minorticks_off()  # a log axis would label its minor ticks between the budgets
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["curve", "ablation", "architecture"])
    parser.add_argument("--minutes", type=float, nargs="+")
    parser.add_argument("--num-prompts", type=int, default=32, help="Evaluation prompts measured (default: 32).")
    parser.add_argument("--work-dir", default="bench_results/training_runs")
    parser.add_argument("--output-dir", default="bench_results")
    args = parser.parse_args(argv)
    work, output_dir = Path(args.work_dir), Path(args.output_dir)
    work.mkdir(parents=True, exist_ok=True)
    base_dir = default_base_model()
    base, tokenizer = AutoModelForCausalLM.from_pretrained(base_dir).eval(), AutoTokenizer.from_pretrained(base_dir)
    if args.mode == "curve":
        rows = [run(f"{m:g} min", m, {}, work, base, tokenizer, args.num_prompts) for m in args.minutes or [5, 10, 20, 40]]
        markdown, name = table(rows, "budget"), "training_curve"
        plot(rows, output_dir / "training_curve.png")
    else:
        minutes = (args.minutes or [SPECULATOR_TRAINING["max_train_minutes"]])[0]
        variants, name = (ABLATIONS, "ablation") if args.mode == "ablation" else (ARCHITECTURES, "architecture")
        rows = [run(f"{variant} ({minutes:g} min)", minutes, overrides, work, base, tokenizer, args.num_prompts)
                for variant, overrides in variants.items()]  # fmt: skip
        markdown = table(rows, "recipe")
    (output_dir / f"{name}.json").write_text(json.dumps(rows, indent=2))
    (output_dir / f"{name}.md").write_text(markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
