"""Speculative decoding with an MLPSpeculator: load a base model and its speculator, generate greedy and sampled text,
read the metrics, and measure the speedup over plain `generate()` on the same prompts.

Run it offline on the default pair (SmolLM2-135M-Instruct and a speculator trained for it; both are built on the first
run and cached, which takes about 12 minutes on 2 CPU cores):

    python examples/generate_with_speculator.py

Or on a published accelerator and the model it was trained for (needs the Hub, or both in your HF cache):

    python examples/generate_with_speculator.py --model meta-llama/Meta-Llama-3-8B-Instruct \
        --speculator ibm-ai-platform/llama3-8b-accelerator --dtype bfloat16 --device cuda
    python examples/generate_with_speculator.py --model JackFram/llama-160m --speculator ibm-fms/llama-160m-accelerator

(The ibm-fms accelerators are mirrored under ibm-ai-platform/.) In bfloat16 or float16 compare speculative output with
plain output in the same dtype: the verifier scores several tokens per forward and may round differently from one token
at a time.
"""

import argparse
import time

import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

# Importing the package registers `mlp_speculator` with AutoConfig/AutoModel and lets every model's `generate()` take
# an MLPSpeculator as `assistant_model`.
import hf_mlp_speculator
from hf_mlp_speculator import default_models

# Prompts the default speculator never saw in training.
PROMPTS = [
    "Explain how a rainbow forms.",
    "Write a short poem about autumn leaves.",
    "What are the benefits of learning a second language?",
    "Describe how a refrigerator keeps food cold.",
]

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--model", help="Base model: a folder or Hub id (default: SmolLM2-135M-Instruct, offline).")
parser.add_argument("--speculator", help="MLPSpeculator trained for --model (default: the default speculator).")
parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
parser.add_argument("--max-new-tokens", type=int, default=128)
parser.add_argument("--prompt", action="append", help="A prompt of your own (repeat for several).")
args = parser.parse_args()
if args.model and not args.speculator:
    parser.error("--model needs --speculator: the default speculator drafts for SmolLM2-135M-Instruct only.")
prompts = args.prompt or PROMPTS

# 1. Load both with from_pretrained. The speculator is a small model of its own (a few MLP heads) that reads the base
#    model's last hidden state; any folder or Hub id in the published `*-accelerator` layout loads with AutoModel.
model_name = args.model or default_models.default_base_model()
speculator_name = args.speculator or default_models.default_speculator(model_name)
dtype = getattr(torch, args.dtype)
tokenizer = AutoTokenizer.from_pretrained(model_name)
model = AutoModelForCausalLM.from_pretrained(model_name, dtype=dtype).to(args.device).eval()
speculator = AutoModel.from_pretrained(speculator_name, dtype=dtype).to(args.device).eval()
print(f"Base model: {model_name}\nSpeculator: {speculator_name} ({speculator.config.n_predict} heads)")


def encode(prompt):
    """The prompt as a chat turn when the tokenizer has a chat template, else as plain text."""
    if tokenizer.chat_template:
        messages = [{"role": "user", "content": prompt}]
        inputs = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
    else:
        inputs = tokenizer(prompt, return_tensors="pt")
    return inputs.to(args.device)


def new_text(inputs, output):
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


# 2. Greedy speculative decoding: pass the speculator as `assistant_model`. Greedy output is the same as without it.
inputs = encode(prompts[0])
output = model.generate(**inputs, assistant_model=speculator, do_sample=False, max_new_tokens=args.max_new_tokens)
print(f"\nPrompt: {prompts[0]}\nGreedy: {new_text(inputs, output)}")

# After each call the speculator holds that call's metrics (a `hf_mlp_speculator.SpeculationMetrics`), with vLLM's
# names: accepted / drafted tokens, tokens per verifier forward, acceptance per head, ...
metrics = speculator.speculation_metrics
heads = ", ".join(f"{rate:.2f}" for rate in metrics.head_acceptance_rates) or "nothing drafted"
print(f"Tokens per step: {metrics.mean_tokens_per_step:.2f} (draft acceptance rate "
      f"{metrics.draft_acceptance_rate:.2f}, per head: {heads})")  # fmt: skip
print(metrics)  # all of them on one line

# 3. Sampling. The output follows the base model's distribution exactly, and a seed set before the call gives the same
#    tokens every time, whatever the speculator drafted (other tokens than plain sampling with that seed, which draws
#    its random numbers differently).
samples = []
for _ in range(2):
    torch.manual_seed(0)
    output = model.generate(**inputs, assistant_model=speculator, do_sample=True, temperature=0.7, top_p=0.9,
                            max_new_tokens=args.max_new_tokens)  # fmt: skip
    samples.append(new_text(inputs, output))
print(f"\nSampled (seed 0, temperature 0.7): {samples[0]}")
print(f"Tokens per step: {speculator.speculation_metrics.mean_tokens_per_step:.2f}")
print(f"Sampled twice with seed 0, same text: {'yes' if samples[0] == samples[1] else 'NO'}")


# 4. The speedup: plain and speculative greedy generate() on the same prompts, timed in this run. Speed is counted in
#    tokens per second, not in steps: a speculative step emits several tokens at once.
def timed_generate(inputs, **kwargs):
    """The new tokens of one greedy generate() call, and its duration in seconds."""
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    output = model.generate(**inputs, do_sample=False, max_new_tokens=args.max_new_tokens, **kwargs)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    return output[0, inputs["input_ids"].shape[1] :].tolist(), time.perf_counter() - start


encoded = [encode(prompt) for prompt in prompts]
# A first call pays one-time costs (allocations, kernel choice) that are no part of the speed.
model.generate(**encoded[0], do_sample=False, max_new_tokens=8)
model.generate(**encoded[0], do_sample=False, max_new_tokens=8, assistant_model=speculator)
plain, speculative, seconds, calls = [], [], {"plain": 0.0, "speculative": 0.0}, []
for inputs in encoded:  # the two take turns, so that a busy spell of the machine slows both alike
    tokens, elapsed = timed_generate(inputs)
    plain.append(tokens)
    seconds["plain"] += elapsed
    tokens, elapsed = timed_generate(inputs, assistant_model=speculator)
    speculative.append(tokens)
    seconds["speculative"] += elapsed
    calls.append(speculator.speculation_metrics)
plain_speed = sum(map(len, plain)) / seconds["plain"]
speculative_speed = sum(map(len, speculative)) / seconds["speculative"]
metrics = sum(calls, hf_mlp_speculator.SpeculationMetrics())  # the metrics of several calls add up
same = sum(a == b for a, b in zip(plain, speculative))
print(f"\nPlain generate():    {plain_speed:.1f} tokens/s ({sum(map(len, plain))} tokens in {seconds['plain']:.1f} s)")
print(f"With the speculator: {speculative_speed:.1f} tokens/s ({sum(map(len, speculative))} tokens in "
      f"{seconds['speculative']:.1f} s, {metrics.mean_tokens_per_step:.2f} tokens per step)")  # fmt: skip
print(f"Speedup: {speculative_speed / plain_speed:.2f}x over plain generate() ({len(prompts)} prompts, greedy)")
print(f"Greedy outputs identical: {'yes' if same == len(prompts) else 'NO'} ({same}/{len(prompts)} prompts)")
# On CPU, speculative generate() runs each forward on the kind of weights (plain, transposed or packed) that measured
# fastest. To tell what the drafts bring from what the faster weights bring, time plain decoding on them as well
# (`hf-mlp-speculator demo` does both):
#     with hf_mlp_speculator.fast_cpu_decoding(model):
#         model.generate(...)
