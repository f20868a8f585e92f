"""The device check: what speculative decoding costs and brings on a GPU, in one command, with nothing downloaded.

    python benchmarks/gpu_check.py --out "$OUT"              # on the device: about 6 minutes on an H200
    python benchmarks/gpu_check.py --dry-run --out /tmp/gpu  # the same steps, tiny shapes on the CPU, under a minute

1. Cost profile at real scale: random-init bases built on the device in bfloat16, one shaped as Llama-3-8B and one
   1B-class, with a random speculator of `ibm-fms/llama3-8b-accelerator`'s shape (4 heads, 3072 wide). At batch 1
   and 8, on a 512-token cache: a plain decoding step, a verify of k + 1 = 2..5 tokens, each draft head; from these,
   the speedup that 1.5, 2.0, 2.5 and 3.0 tokens per step would give.
2. End to end with real acceptance: this package's trainer trains a speculator for about 2 minutes on the 1B-class
   base's own greedy continuations (random-init models continue very regularly), then `generate()` runs with and
   without it at batch 1 and 8: tokens per step, speedup over plain `generate()`, greedy identity, the loop's own
   overhead per step (wall time minus forwards and heads), loop efficiency (the measured speedup over the one the
   measured tokens per step and costs predict), and the KV cache's most slots per row with and without freeing
   rejected drafts' slots, against the sequence's length.

Results go to `--out` as gpu_check.json and gpu_check.md. Times on CUDA are taken with CUDA events.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from hf_mlp_speculator import MLPSpeculatorConfig, MLPSpeculatorPreTrainedModel, speculative_decoding
from hf_mlp_speculator.kv_cache import cache_kwargs, output_cache
from hf_mlp_speculator.training import SpeculatorTrainingArguments, train

BASES = {
    "llama3-8b-shaped": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                             num_key_value_heads=8, vocab_size=128256),
    "1b-class": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256),
}  # fmt: skip
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=512)  # fmt: skip
HEADS, INNER, CONTEXT, TOKENS_PER_STEP = 4, 3072, 512, (1.5, 2.0, 2.5, 3.0)


def build(config_fields: dict, device, dtype, seed: int = 0):
    """A random-init Llama built directly on `device` in `dtype` (an 8B model never passes through host memory)."""
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(LlamaConfig(**config_fields, max_position_embeddings=4096))
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def random_speculator(base, inner: int, device, dtype):
    config = MLPSpeculatorConfig(vocab_size=base.config.vocab_size, emb_dim=base.config.hidden_size, inner_dim=inner,
                                 n_predict=HEADS)  # fmt: skip
    return MLPSpeculatorPreTrainedModel(config).to(device, dtype).eval()


def timed_ms(fn, device, repeats: int) -> float:
    """Median milliseconds of `fn()` after one warm-up call; on a GPU by CUDA events, so no call waits for another."""
    fn()
    if torch.device(device).type != "cuda":
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1000)
        return statistics.median(times)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return statistics.median(start.elapsed_time(end) for start, end in events)


@torch.no_grad()
def cost_profile(base, speculator, batch: int, context: int, device, repeats: int) -> dict:
    """Milliseconds of a plain step, of a verify over m = 2..5 new tokens, and of each head, on a `context` cache."""
    vocab = base.config.vocab_size
    prefill = base(torch.randint(vocab, (batch, context), device=device), use_cache=True, output_hidden_states=-1)
    cache = output_cache(prefill)

    def forward(m):
        tokens = torch.randint(vocab, (batch, m), device=device)

        def run():
            base(tokens, use_cache=True, output_hidden_states=-1, **cache_kwargs(base, cache))
            cache.crop(-m)  # back to the context, for the next repeat

        return run

    verify = {m: timed_ms(forward(m), device, repeats) for m in range(1, HEADS + 2)}
    heads = speculator.speculator
    token = torch.randint(vocab, (batch,), device=device)
    states = [heads.input_state(prefill.hidden_states[-1][:, -1].to(speculator.dtype))]
    for head in range(HEADS - 1):  # the state each head takes: the one the head before it made
        states.append(heads.step(head, states[-1], token)[0])
    head_ms = [timed_ms(lambda h=h: heads.step(h, states[h], token), device, repeats) for h in range(HEADS)]
    return {"plain_ms": verify[1], "verify_ms_by_new_tokens": verify, "head_ms": head_ms}


def predicted_speedup(profile: dict, tokens_per_step: float, depth: int = HEADS) -> float:
    """Plain steps' time for `tokens_per_step` tokens over one step that drafts `depth` heads and verifies them."""
    step = profile["verify_ms_by_new_tokens"][depth + 1] + sum(profile["head_ms"][:depth])
    return tokens_per_step * profile["plain_ms"] / step


def tokenizer_for(vocab_size: int) -> PreTrainedTokenizerFast:
    """Characters as tokens (ids below `vocab_size`): prompts need some tokenizer, and none is downloaded."""
    vocab = {"\x00": 0, **{chr(32 + i): i + 1 for i in range(min(95, vocab_size - 1))}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="\x00"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="\x00", pad_token="\x00")


def train_speculator(base, work: Path, minutes: float, inner: int, dtype_name: str) -> Path:
    """This package's trainer, on the base's own greedy continuations of random character prompts."""
    base.save_pretrained(work / "base")
    tokenizer_for(base.config.vocab_size).save_pretrained(work / "base")
    generator = torch.Generator().manual_seed(0)
    letters = [chr(97 + int(i)) for i in torch.randint(26, (400 * 24,), generator=generator)]
    (work / "prompts.txt").write_text("\n\n".join("".join(letters[i : i + 24]) for i in range(0, len(letters), 24)))
    args = SpeculatorTrainingArguments(
        base_model=str(work / "base"), prompts=[str(work / "prompts.txt")], output_dir=str(work / "speculator"),
        targets_cache=str(work / "targets"), n_predict=HEADS, inner_dim=inner, synthesize_prompts=0, new_tokens=64,
        eval_prompts=16, eval_new_tokens=32, max_train_minutes=minutes, dtype=dtype_name, report_to="none",
    )  # fmt: skip
    return Path(train(args))


@torch.no_grad()
def end_to_end(base, speculator, profile: dict, batch: int, new_tokens: int, device) -> dict:
    """Plain and speculative greedy `generate()` on the same random prompts; speedup, identity, loop efficiency."""
    prompts = torch.randint(1, 96, (batch, 32), generator=torch.Generator().manual_seed(batch)).to(device)
    kwargs = dict(attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens, do_sample=False)
    speculative = dict(assistant_model=speculator, num_assistant_tokens_schedule="constant")
    seconds, outputs = {}, {}
    for name, extra in (("plain", {}), ("speculative", speculative)):
        base.generate(prompts, **{**kwargs, "max_new_tokens": 8}, **extra)  # warm-up at this shape
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        outputs[name] = base.generate(prompts, **kwargs, **extra)
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)
        seconds[name] = time.perf_counter() - start
    metrics = speculator.speculation_metrics
    forwards = sum(metrics.steps_by_depth)  # verifier forwards (num_steps counts each row's)
    # The KV cache's most slots per row, and the same call without freeing rejected drafts' slots.
    compact_share = speculative_decoding.COMPACT_SHARE
    speculative_decoding.COMPACT_SHARE = float("inf")
    try:
        base.generate(prompts, **kwargs, **speculative)
        uncompacted = speculator.speculation_metrics.cache_slots
    finally:
        speculative_decoding.COMPACT_SHARE = compact_share
    modelled = forwards * (profile["verify_ms_by_new_tokens"][HEADS + 1] + sum(profile["head_ms"])) / 1000
    speedup = seconds["plain"] / seconds["speculative"]
    predicted = predicted_speedup(profile, metrics.mean_tokens_per_step)
    return {
        "batch": batch,
        "tokens_per_step": metrics.mean_tokens_per_step,
        "head_acceptance": metrics.head_acceptance_rates,
        "speedup": speedup,
        "predicted_speedup": predicted,
        "loop_efficiency": speedup / predicted,
        "loop_overhead_ms_per_step": max(0.0, seconds["speculative"] - modelled) / max(forwards, 1) * 1000,
        "identical": torch.equal(outputs["plain"], outputs["speculative"]),
        "cache_slots": metrics.cache_slots,
        "cache_slots_uncompacted": uncompacted,
        "sequence_slots": outputs["plain"].shape[1],
    }


def markdown(results: dict) -> str:
    at = " / ".join(f"{t}" for t in TOKENS_PER_STEP)
    lines = [f"# Device check, {results['device']} (torch {results['torch']}, transformers {results['transformers']})",
             "", "## Cost profile (ms; cache of {} tokens)".format(results["context"]), "",
             f"| base | batch | plain step | verify 2 / 3 / 4 / 5 tokens | heads | predicted speedup at {at} tokens "
             "per step |", "|---|---:|---:|---|---|---|"]  # fmt: skip
    for row in results["cost_profile"]:
        verify = " / ".join(f"{row['verify_ms_by_new_tokens'][m]:.2f}" for m in range(2, HEADS + 2))
        heads = " / ".join(f"{ms:.2f}" for ms in row["head_ms"])
        predicted = " / ".join(f"{x:.2f}x" for x in row["predicted_speedup"])
        lines.append(f"| {row['base']} | {row['batch']} | {row['plain_ms']:.2f} | {verify} | {heads} | {predicted} |")
    lines += ["", "## End to end (1B-class base, trained speculator, 4 heads every step)", "",
              "| batch | tokens/step | speedup | predicted | loop efficiency | loop overhead ms/step | identical "
              "| cache slots (uncompacted) / sequence |",
              "|---:|---:|---:|---:|---:|---:|---|---|"]  # fmt: skip
    for row in results["end_to_end"]:
        lines.append(f"| {row['batch']} | {row['tokens_per_step']:.2f} | {row['speedup']:.2f}x | "
                     f"{row['predicted_speedup']:.2f}x | {row['loop_efficiency']:.2f} | "
                     f"{row['loop_overhead_ms_per_step']:.2f} | {'yes' if row['identical'] else 'NO'} | "
                     f"{row['cache_slots']} ({row['cache_slots_uncompacted']}) / {row['sequence_slots']} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="Folder for gpu_check.json and gpu_check.md.")
    parser.add_argument("--dry-run", action="store_true", help="Tiny shapes on the CPU, to check the script.")
    parser.add_argument("--train-minutes", type=float, default=2.0)
    args = parser.parse_args(argv)
    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        print("gpu_check: error: no CUDA device; pass --dry-run to run the steps on the CPU", file=sys.stderr)
        return 2
    device, dtype = ("cpu", torch.float32) if dry else ("cuda", torch.bfloat16)
    bases = {"tiny": TINY} if dry else BASES
    inner, context, repeats = (48, 32, 3) if dry else (INNER, CONTEXT, 20)
    results = {"device": "CPU (dry run)" if dry else torch.cuda.get_device_name(), "torch": torch.__version__,
               "transformers": __import__("transformers").__version__, "context": context,
               "cost_profile": [], "end_to_end": []}  # fmt: skip
    profiles = {}
    for name, fields in bases.items():
        base = build(fields, device, dtype)
        speculator = random_speculator(base, inner, device, dtype)
        for batch in (1, 8):
            profile = cost_profile(base, speculator, batch, context, device, repeats)
            profile.update(base=name, batch=batch, predicted_speedup=[predicted_speedup(profile, t)
                                                                      for t in TOKENS_PER_STEP])  # fmt: skip
            results["cost_profile"].append(profile)
            profiles[name, batch] = profile
            print(json.dumps(profile), flush=True)
        if name != list(bases)[-1]:
            del base, speculator
            if not dry:
                torch.cuda.empty_cache()
    name = list(bases)[-1]  # the 1B-class base (the tiny one in a dry run) is the one still loaded
    with tempfile.TemporaryDirectory() as work:
        folder = train_speculator(base, Path(work), 0.2 if dry else args.train_minutes, inner,
                                  "float32" if dry else "bfloat16")  # fmt: skip
        trained = MLPSpeculatorPreTrainedModel.from_pretrained(folder).to(device, dtype).eval()
    for batch in (1, 8):
        row = end_to_end(base, trained, profiles[name, batch], batch, 16 if dry else 128, device)
        results["end_to_end"].append(row)
        print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(results, indent=2))
    (out / "gpu_check.md").write_text(markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
