"""Train an MLPSpeculator for a base model on your prompts within a time budget, measure its acceptance on held-out
prompts, reload it with `AutoModel.from_pretrained` and check that speculative greedy output equals plain output.

    python examples/train_speculator.py       # the default base model (SmolLM2-135M-Instruct), the package's prompts
    python examples/train_speculator.py --base-model Qwen/Qwen2.5-0.5B-Instruct --prompts my_prompts.txt \
        --max-train-minutes 60 --output-dir qwen-speculator

The prompt file holds one user prompt per line. The base model answers each prompt (rendered with its chat template)
and the speculator learns to predict those answers: it is distilled from the base model's own outputs, so prompts like
the ones it will serve matter more than any particular dataset. The last `--held-out` prompts of the file are never
trained on; the acceptance is measured on them.
"""

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

import hf_mlp_speculator
from hf_mlp_speculator import default_models
from hf_mlp_speculator.training import SpeculatorTrainingArguments, train

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--base-model", help="A folder or Hub id (default: SmolLM2-135M-Instruct, offline).")
parser.add_argument("--prompts", help="One prompt per line (default: the prompts the default speculator trains on).")
parser.add_argument("--held-out", type=int, default=16, help="Prompts at the end of the file kept out of training.")
parser.add_argument("--output-dir", default="my-speculator")
parser.add_argument("--max-train-minutes", type=float, default=10.0, help="The whole run's budget, targets included.")
parser.add_argument("--n-predict", type=int, default=4, help="Heads: tokens drafted per step.")
parser.add_argument("--draft-vocab-size", type=int, default=2048, help="Tokens the heads score; 0: all of them.")
parser.add_argument("--new-tokens", type=int, default=160, help="Tokens the base model writes per prompt.")
parser.add_argument("--batch-size", type=int, default=512, help="Answer tokens the heads train on per step.")
args = parser.parse_args()

base_model = str(args.base_model or default_models.default_base_model())
tokenizer = AutoTokenizer.from_pretrained(base_model)
output_dir = Path(args.output_dir)

# 1. The prompts: the last --held-out are set aside for evaluation, and none of them is trained on.
lines = (Path(args.prompts) if args.prompts else default_models.TRAIN_PROMPTS).read_text(encoding="utf-8").splitlines()
prompts = list(dict.fromkeys(line.strip() for line in lines if line.strip()))  # without blanks and repeats
if not 0 < args.held_out < len(prompts):
    parser.error(f"--held-out {args.held_out}: hold out 1 to {len(prompts) - 1} of the {len(prompts)} prompts.")
train_prompts, held_out_prompts = prompts[: -args.held_out], prompts[-args.held_out :]  # no prompt is in both
print(f"{len(train_prompts)} training prompts, {len(held_out_prompts)} held out")


def render(prompt: str) -> str:
    """A prompt as the base model sees it in a chat: a user turn, up to where the assistant's answer begins."""
    if not tokenizer.chat_template:
        return prompt
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)  # fmt: skip


# The trainer reads .jsonl files with a "text" field (also .txt, .parquet, `datasets` names: see --help).
data_dir = output_dir.with_name(output_dir.name + "-prompts")
data_dir.mkdir(parents=True, exist_ok=True)
for name, subset in (("train_prompts.jsonl", train_prompts), ("held_out_prompts.jsonl", held_out_prompts)):
    with open(data_dir / name, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": render(prompt)}) + "\n" for prompt in subset)

# 2. Train. The base model first continues the prompts (its hidden states and top-k next-token distributions are the
#    targets, cached for reruns), then the heads train on them until the budget is spent. Progress and the held-out
#    acceptance the trainer measures (teacher-forced) go to stderr; the final figures go into the model card.
training_args = SpeculatorTrainingArguments(
    base_model=base_model,
    prompts=[str(data_dir / "train_prompts.jsonl")],
    eval_data=[str(data_dir / "held_out_prompts.jsonl")],  # never trained on
    eval_prompts=len(held_out_prompts),
    output_dir=str(output_dir),
    max_train_minutes=args.max_train_minutes,
    n_predict=args.n_predict,
    tie_weights=True,  # the heads share weights (few parameters for little data)
    scale_input=True,  # RMS-normalise the base model's hidden state first
    draft_vocab_size=args.draft_vocab_size,  # heads score only the tokens the base model uses most: cheaper drafts
    new_tokens=args.new_tokens,
    eval_new_tokens=args.new_tokens,
    batch_size=args.batch_size,
    learning_rate=1e-2,
    report_to="none",  # or "tensorboard", "wandb", ...
)
# On several GPUs, run the trainer itself with these settings as flags (`hf-mlp-speculator train --help`) on the prompt
# files written above:
# DDP (one process per GPU, each holding the whole speculator):
#     torchrun --nproc-per-node 8 -m hf_mlp_speculator.training --base-model Qwen/Qwen2.5-0.5B-Instruct \
#         --prompts qwen-speculator-prompts/train_prompts.jsonl \
#         --eval-data qwen-speculator-prompts/held_out_prompts.jsonl \
#         --n-predict 4 --tie-weights --scale-input --draft-vocab-size 2048 --learning-rate 1e-2 \
#         --max-train-minutes 60 --output-dir qwen-speculator
#     accelerate launch --num-processes 8 -m hf_mlp_speculator.training (the same flags)
# FSDP, for a speculator whose weights, gradients and optimizer state do not fit one GPU: the same command with --fsdp
# (each process keeps 1/8 of them; see docs/training.md).
train(training_args)  # saves the speculator into output_dir in the published ibm-fms layout (vLLM and TGI read it)
print(f"Speculator saved to {output_dir}")

# 3. Reload it as any user would, and measure its acceptance on the held-out prompts in real generate() calls.
device = "cuda" if torch.cuda.is_available() else "cpu"
model = AutoModelForCausalLM.from_pretrained(base_model).to(device).eval()
speculator = AutoModel.from_pretrained(output_dir).to(device).eval()


def encode(prompt: str):
    """The prompt as a chat turn (plain text without a chat template): input_ids and attention_mask."""
    if not tokenizer.chat_template:
        return tokenizer(prompt, return_tensors="pt").to(device)
    messages = [{"role": "user", "content": prompt}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    return inputs.to(device)


calls = []
for prompt in held_out_prompts:
    model.generate(**encode(prompt), assistant_model=speculator, do_sample=False, max_new_tokens=args.new_tokens)
    calls.append(speculator.speculation_metrics)  # each call leaves its metrics on the speculator
metrics = sum(calls, hf_mlp_speculator.SpeculationMetrics())
heads = ", ".join(f"{rate:.2f}" for rate in metrics.head_acceptance_rates) or "nothing drafted"
print(f"Held-out prompts ({len(held_out_prompts)}, never trained on): {metrics.mean_tokens_per_step:.2f} tokens per "
      f"step, draft acceptance rate {metrics.draft_acceptance_rate:.2f}, per head: {heads}")  # fmt: skip

# 4. Lossless: greedy output with the speculator is the same as without it.
inputs = encode(held_out_prompts[0])
plain = model.generate(**inputs, do_sample=False, max_new_tokens=args.new_tokens)
speculative = model.generate(**inputs, assistant_model=speculator, do_sample=False, max_new_tokens=args.new_tokens)
print(f"\nPrompt: {held_out_prompts[0]}")
print(f"Answer: {tokenizer.decode(speculative[0, inputs['input_ids'].shape[1] :], skip_special_tokens=True)}")
print(f"Lossless: speculative output == plain output: {'yes' if torch.equal(plain, speculative) else 'NO'}")
