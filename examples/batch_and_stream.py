"""A batch of chat prompts with an MLPSpeculator: streamed as a chat server streams them, then generated all at once,
then through a transformers `pipeline`.

    python examples/batch_and_stream.py                      # offline, on the default pair
    python examples/batch_and_stream.py --model meta-llama/Meta-Llama-3-8B-Instruct \
        --speculator ibm-ai-platform/llama3-8b-accelerator --dtype bfloat16 --device cuda

The default pair (SmolLM2-135M-Instruct and its speculator) is built on the first run and cached (about 12 minutes on
2 CPU cores).
"""

import argparse
from threading import Thread

import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer, TextIteratorStreamer, pipeline

import hf_mlp_speculator  # noqa: F401 (lets generate() and pipelines take an MLPSpeculator as assistant_model)
from hf_mlp_speculator import default_models

CHATS = [
    [{"role": "user", "content": "Explain how a rainbow forms."}],
    [{"role": "user", "content": "Write a short poem about autumn leaves."}],
    [{"role": "user", "content": "What are the benefits of learning a second language?"}],
    [{"role": "user", "content": "Describe how a refrigerator keeps food cold."}],
]

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--model", help="Base model: a folder or Hub id (default: SmolLM2-135M-Instruct, offline).")
parser.add_argument("--speculator", help="MLPSpeculator trained for --model (default: the default speculator).")
parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
parser.add_argument("--max-new-tokens", type=int, default=64)
args = parser.parse_args()
if args.model and not args.speculator:
    parser.error("--model needs --speculator: the default speculator drafts for SmolLM2-135M-Instruct only.")

model_name = args.model or default_models.default_base_model()
speculator_name = args.speculator or default_models.default_speculator(model_name)
dtype = getattr(torch, args.dtype)
model = AutoModelForCausalLM.from_pretrained(model_name, dtype=dtype).to(args.device).eval()
speculator = AutoModel.from_pretrained(speculator_name, dtype=dtype).to(args.device).eval()
tokenizer = AutoTokenizer.from_pretrained(model_name)
if not tokenizer.chat_template:
    parser.error(f"{model_name} has no chat template: this example needs a chat (instruct) model.")
# A batch of decoder-only prompts is padded on the left, so that every row's next token comes right after its prompt.
tokenizer.padding_side = "left"
if tokenizer.pad_token is None:
    tokenizer.pad_token = tokenizer.eos_token
generation = {"do_sample": False, "max_new_tokens": args.max_new_tokens, "pad_token_id": tokenizer.pad_token_id}

# 1. Streaming, as a chat server does: generate() runs in a thread and the streamer hands over text as it is decoded.
#    transformers' streamers take one sequence per generate() call, so each chat gets its own call. A speculative step
#    emits several tokens at once, so the text arrives in chunks of one or more tokens.
for chat in CHATS:
    inputs = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    # The timeout ends the loop below with an error, instead of waiting forever, if generate() fails in its thread.
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True, timeout=600)
    kwargs = dict(**inputs.to(args.device), streamer=streamer, assistant_model=speculator, **generation)
    thread = Thread(target=model.generate, kwargs=kwargs)
    thread.start()
    print(f"\nUser: {chat[-1]['content']}\nAssistant: ", end="", flush=True)
    for text in streamer:
        print(text, end="", flush=True)
    thread.join()
    # The call's metrics are on the speculator once the thread is done.
    print(f"\n[streamed; {speculator.speculation_metrics.mean_tokens_per_step:.2f} tokens per step]")

# 2. The whole batch in one generate() call: the chat template renders every chat, padded on the left.
batch = tokenizer.apply_chat_template(CHATS, add_generation_prompt=True, padding=True, return_tensors="pt",
                                      return_dict=True).to(args.device)  # fmt: skip
output = model.generate(**batch, assistant_model=speculator, **generation)
replies = tokenizer.batch_decode(output[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
for chat, reply in zip(CHATS, replies):
    print(f"\nUser: {chat[-1]['content']}\nAssistant: {reply}")
# `speculation_metrics` adds up the rows; `speculation_metrics_per_row` has one `SpeculationMetrics` per row.
metrics = speculator.speculation_metrics
per_row = ", ".join(f"{row.mean_tokens_per_step:.2f}" for row in speculator.speculation_metrics_per_row)
print(f"\n[batch of {len(CHATS)}: {metrics.mean_tokens_per_step:.2f} tokens per step; per row: {per_row}]")
plain = model.generate(**batch, **generation)
plain_replies = tokenizer.batch_decode(plain[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
print(f"Batch replies identical to plain generate()'s: {'yes' if plain_replies == replies else 'NO'}")

# 3. A pipeline passes assistant_model to every generate() call it makes; batch_size chats go into each call.
chat_pipeline = pipeline("text-generation", model=model, tokenizer=tokenizer, assistant_model=speculator)
results = chat_pipeline(CHATS, batch_size=len(CHATS), **generation)
pipeline_replies = [result[0]["generated_text"][-1]["content"] for result in results]  # the chat + the reply
print(f"\nPipeline, first reply: {pipeline_replies[0]}")
print(f"[pipeline: {speculator.speculation_metrics.mean_tokens_per_step:.2f} tokens per step]")
print(f"Pipeline replies identical to the batch's: {'yes' if pipeline_replies == replies else 'NO'}")
