"""How much an MLPSpeculator speeds up generation on your own prompts: tokens per step, acceptance per head and the
speedup over plain `generate()`, one prompt at a time and in batches of a size you choose.

    python examples/measure_on_your_prompts.py                          # the default pair, on held-out chat prompts
    python examples/measure_on_your_prompts.py --prompts my_prompts.txt --batch-size 16 \
        --model meta-llama/Meta-Llama-3-8B-Instruct --speculator ibm-ai-platform/llama3-8b-accelerator \
        --dtype bfloat16 --device cuda

The prompt file holds one prompt per line; each is sent as a user turn with the tokenizer's chat template (as plain
text if it has none). Acceptance depends on what is asked: measure on prompts like the ones you will serve.
For every decoding mode and more figures (latency, trees, prompt lookup, sampling) use `hf-mlp-speculator bench
--prompts FILE` (which reads a .txt file as prompts separated by blank lines, or a .jsonl file).
"""

import argparse
import time
from pathlib import Path

import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

import hf_mlp_speculator
from hf_mlp_speculator import default_models

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--model", help="Base model: a folder or Hub id (default: SmolLM2-135M-Instruct, offline).")
parser.add_argument("--speculator", help="MLPSpeculator trained for --model (default: the default speculator).")
parser.add_argument("--prompts", help="One prompt per line (default: prompts the default speculator never saw).")
parser.add_argument("--num-prompts", type=int, default=16, help="Use the first N prompts of the file.")
parser.add_argument("--batch-size", type=int, default=8, help="Batch size of the batched measurement.")
parser.add_argument("--max-new-tokens", type=int, default=128)
parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
args = parser.parse_args()
if args.model and not args.speculator:
    parser.error("--model needs --speculator: the default speculator drafts for SmolLM2-135M-Instruct only.")

model_name = args.model or default_models.default_base_model()
speculator_name = args.speculator or default_models.default_speculator(model_name)
dtype = getattr(torch, args.dtype)
model = AutoModelForCausalLM.from_pretrained(model_name, dtype=dtype).to(args.device).eval()
speculator = AutoModel.from_pretrained(speculator_name, dtype=dtype).to(args.device).eval()
tokenizer = AutoTokenizer.from_pretrained(model_name)
tokenizer.padding_side = "left"  # batches of decoder-only prompts are padded on the left
if tokenizer.pad_token is None:
    tokenizer.pad_token = tokenizer.eos_token

if args.prompts:
    lines = Path(args.prompts).read_text(encoding="utf-8").splitlines()
    prompts = [line.strip() for line in lines if line.strip()]
else:
    prompts = default_models.evaluation_prompts()
prompts = prompts[: args.num_prompts]
eos = model.generation_config.eos_token_id
eos_ids = set([eos] if isinstance(eos, int) else eos or [])


def encode(batch: list[str]):
    """A left-padded batch of prompts, each a user turn of a chat (or plain text without a chat template)."""
    if tokenizer.chat_template:
        chats = [[{"role": "user", "content": prompt}] for prompt in batch]
        inputs = tokenizer.apply_chat_template(chats, add_generation_prompt=True, padding=True, return_tensors="pt",
                                               return_dict=True)  # fmt: skip
    else:
        inputs = tokenizer(batch, padding=True, return_tensors="pt")
    return inputs.to(args.device)


def generate(inputs, **kwargs):
    """One greedy generate() call: its new tokens (a row's end at its first EOS), the count of them, its seconds."""
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    output = model.generate(**inputs, do_sample=False, max_new_tokens=args.max_new_tokens,
                            pad_token_id=tokenizer.pad_token_id, **kwargs)  # fmt: skip
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    new = output[:, inputs["input_ids"].shape[1] :].tolist()
    # A row that ended is padded until the longest is done: count each row's tokens up to its EOS.
    rows = [row[: next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))] for row in new]
    return rows, sum(map(len, rows)), seconds


def measure(batch_size: int) -> None:
    batches = [encode(prompts[i : i + batch_size]) for i in range(0, len(prompts), batch_size)]
    # A first call of each kind pays one-time costs (allocations, kernel choice) that are no part of the speed.
    generate(batches[0])
    generate(batches[0], assistant_model=speculator)
    tokens, seconds, same, calls = {"plain": 0, "speculative": 0}, {"plain": 0.0, "speculative": 0.0}, 0, []
    for inputs in batches:  # plain and speculative take turns, so that a busy spell slows both alike
        plain_rows, count, elapsed = generate(inputs)
        tokens["plain"] += count
        seconds["plain"] += elapsed
        speculative_rows, count, elapsed = generate(inputs, assistant_model=speculator)
        tokens["speculative"] += count
        seconds["speculative"] += elapsed
        # After each call, the speculator holds its metrics (for a batch, all its rows added up).
        calls.append(speculator.speculation_metrics)
        same += sum(a == b for a, b in zip(plain_rows, speculative_rows))
    metrics = sum(calls, hf_mlp_speculator.SpeculationMetrics())
    plain_speed = tokens["plain"] / seconds["plain"]
    speculative_speed = tokens["speculative"] / seconds["speculative"]
    print(f"\nBatch size {batch_size} ({len(prompts)} prompts, {len(batches)} generate() calls each, greedy):")
    print(f"  plain generate():     {plain_speed:8.1f} tokens/s")
    print(f"  with the speculator:  {speculative_speed:8.1f} tokens/s")
    print(f"  speedup:              {speculative_speed / plain_speed:.2f}x")
    print(f"  tokens per step:      {metrics.mean_tokens_per_step:.2f} (draft acceptance rate "
          f"{metrics.draft_acceptance_rate:.2f})")  # fmt: skip
    # Empty when the speculator drafted nothing: its drafts were measured not to pay (the cost-aware controller).
    heads = ", ".join(f"{rate:.2f}" for rate in metrics.head_acceptance_rates) or "nothing drafted"
    print(f"  acceptance per head:  {heads}")
    print(f"  outputs identical:    {'yes' if same == len(prompts) else 'NO'} ({same}/{len(prompts)} prompts)")


print(f"Base model: {model_name}\nSpeculator: {speculator_name}\nPrompts: {args.prompts or 'held-out chat prompts'}")
measure(1)
if args.batch_size > 1:
    measure(args.batch_size)
