"""The device check: what speculative decoding costs and brings on a GPU, in one command, with nothing downloaded.

    python benchmarks/gpu_check.py --out "$OUT"              # on the device: about 6 minutes on an H200
    python benchmarks/gpu_check.py --dry-run --out /tmp/gpu  # every section, tiny shapes on the CPU, under a minute

Each section is added to `--out`/gpu_check.json and gpu_check.md as soon as it ends, so that a run cut short keeps
what it measured. Times on CUDA are taken with CUDA events, or a synchronize around a whole call.

1. `loop`: random-init bases built on the device in bfloat16, shaped as Llama-3-8B and 1B-class, with a random
   speculator of `ibm-fms/llama3-8b-accelerator`'s shape (4 heads, 3072 wide), at batch 1 and 8 on a 512-token
   cache. The cost profile (a plain step, a verify of m = 1..5 tokens, each head) and the decoding loop at forced
   depths k = 0..4: a step's measured time in plain steps, and its loop efficiency, the profile's verify of k + 1
   tokens and k heads over the step's measured time. A random speculator is never accepted, so every step is a
   rejection: what the loop costs, apart from what acceptance brings.
2. `first_call`: `generate(assistant_model=speculator)` with an untrained speculator, as a user calls it (cost-aware
   depths), on a fresh 8B-shaped model: the process's first call and its second, each against plain `generate()`.
3. `end_to_end`: a base whose continuations a speculator can learn, the 1B-class shape with its residual branches
   damped so that its next token is mostly a function of the current one (a random base's text is noise, which no
   speculator learns in minutes). This package's trainer trains a speculator on its continuations for
   `--train-minutes` (model-only checkpoints: no optimizer state on disk), then `generate()` runs with and without it
   at batch 1 and 8 on held-out prompts: tokens per step, speedup, greedy identity, loop efficiency.
4. `compiled`: the same pair with a static cache and the verifier compiled as plain `generate()` compiles it
   (transformers' `compile_config`): plain compiled `generate()` against speculative, at batch 1.
5. `split`: the same base loaded as one too large for the GPU runs, half its layers on `cuda:0` and the other half
   and its output layer on the CPU (accelerate's `dispatch_model` with the CPU as main device; in a dry run, the CPU
   and disk), with the trained speculator on the GPU, then on the CPU: batch 2 with a row that ends early, identical
   tokens, and the speedup over plain `generate()` on the same split.
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
from transformers import CompileConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from hf_mlp_speculator import FixedDepth, MLPSpeculatorConfig, MLPSpeculatorPreTrainedModel, speculation_state
from hf_mlp_speculator.drafting.drafts import scored_step
from hf_mlp_speculator.generation.transformers_hooks import cache_kwargs, output_cache
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
# The residual branches' output projections are scaled by this in the learnable base (section 3).
DAMPING = 0.05


def build(config_fields: dict, device, dtype, seed: int = 0, damping: float = 1.0):
    """A random-init Llama built directly on `device` in `dtype` (an 8B model never passes through host memory)."""
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(LlamaConfig(**config_fields, max_position_embeddings=4096))
    finally:
        torch.set_default_dtype(default)
    if damping != 1.0:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.mul_(damping)
                layer.mlp.down_proj.weight.mul_(damping)
    model.generation_config.pad_token_id = 0
    return model.eval()


def random_speculator(base, inner: int, device, dtype):
    config = MLPSpeculatorConfig(vocab_size=base.config.vocab_size, emb_dim=base.config.hidden_size, inner_dim=inner,
                                 n_predict=HEADS)  # fmt: skip
    return MLPSpeculatorPreTrainedModel(config).to(device, dtype).eval()


def synchronize(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


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
    synchronize(device)
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
    head_ms = [timed_ms(lambda h=h: scored_step(heads, h, states[h], token), device, repeats) for h in range(HEADS)]
    return {"plain_ms": verify[1], "verify_ms_by_new_tokens": verify, "head_ms": head_ms}


def predicted_speedup(profile: dict, tokens_per_step: float, depth: int = HEADS) -> float:
    """Plain steps' time for `tokens_per_step` tokens over one step that drafts `depth` heads and verifies them."""
    return tokens_per_step * profile["plain_ms"] / modelled_step_ms(profile, depth)


def modelled_step_ms(profile: dict, depth: int) -> float:
    """What a step at depth `depth` costs in the profile: its verify of `depth + 1` tokens and its heads."""
    return profile["verify_ms_by_new_tokens"][depth + 1] + sum(profile["head_ms"][:depth])


@torch.no_grad()
def call_seconds(base, prompts, new_tokens: int, device, **kwargs) -> tuple[float, object]:
    """Seconds of one greedy `generate()` call (the device drained before and after), and its output."""
    synchronize(device)
    start = time.perf_counter()
    output = base.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                           do_sample=False, **kwargs)  # fmt: skip
    synchronize(device)
    return time.perf_counter() - start, output


def step_ms(base, speculator, prompts, depth: int | None, new_tokens: int, device) -> float:
    """
    Milliseconds per verifier forward of the decode steps: plain `generate()` (`depth` None) or the speculative loop
    at a forced depth, as a long call's time less a short one's over their difference in forwards.
    """
    kwargs = {}
    if depth is not None:
        kwargs = dict(assistant_model=speculator, num_assistant_tokens=max(depth, 1),
                      num_assistant_tokens_schedule="constant" if depth else "heuristic")  # fmt: skip
    call_seconds(base, prompts, 8, device, **kwargs)  # warm-up at this shape
    runs = []
    for tokens in (4, 4 + new_tokens):
        seconds, _ = call_seconds(base, prompts, tokens, device, **kwargs)
        forwards = tokens - 1 if depth is None else sum(speculator.speculation_metrics.steps_by_depth)
        runs.append((seconds, forwards))
    (short, short_forwards), (long, long_forwards) = runs
    return (long - short) / (long_forwards - short_forwards) * 1000


def loop_section(bases: dict, device, dtype, inner: int, context: int, repeats: int, new_tokens: int) -> list:
    rows = []
    for name, fields in bases.items():
        base = build(fields, device, dtype)
        speculator = random_speculator(base, inner, device, dtype)
        # k = 0 where the call's schedule is cost-aware: its host work runs, and decides nothing.
        speculation_state(base, speculator).policy = FixedDepth(0)
        for batch in (1, 8):
            profile = cost_profile(base, speculator, batch, context, device, repeats)
            prompts = torch.randint(1, base.config.vocab_size, (batch, context), device=device,
                                    generator=torch.Generator(device).manual_seed(batch))  # fmt: skip
            plain = step_ms(base, speculator, prompts, None, new_tokens, device)
            depths = {}
            for depth in range(HEADS + 1):
                measured = step_ms(base, speculator, prompts, depth, new_tokens, device)
                depths[depth] = {"step_ms": measured, "plain_steps": measured / plain,
                                 "efficiency": modelled_step_ms(profile, depth) / measured}  # fmt: skip
            row = dict(base=name, batch=batch, **profile, generate_plain_step_ms=plain, depths=depths,
                       predicted_speedup=[predicted_speedup(profile, t) for t in TOKENS_PER_STEP])  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
        del base, speculator
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
    return rows


def first_call_section(fields: dict, device, dtype, inner: int, context: int, new_tokens: int) -> list:
    """A fresh model and speculator: no timing or acceptance of this process's earlier calls carries over."""
    base = build(fields, device, dtype, seed=1)
    speculator = random_speculator(base, inner, device, dtype)
    prompts = torch.randint(1, base.config.vocab_size, (1, context), device=device,
                            generator=torch.Generator(device).manual_seed(0))  # fmt: skip
    call_seconds(base, prompts, 8, device)  # plain decoding's own warm-up (kernels, allocator)
    rows = []
    for call in ("first", "second"):
        plain, expected = call_seconds(base, prompts, new_tokens, device)
        speculative, output = call_seconds(base, prompts, new_tokens, device, assistant_model=speculator)
        metrics = speculator.speculation_metrics
        row = {"call": call, "speedup": plain / speculative, "identical": torch.equal(output, expected),
               "steps_by_depth": metrics.steps_by_depth, "plain_s": plain, "speculative_s": speculative}  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)
    del base, speculator
    return rows


def tokenizer_for(vocab_size: int) -> PreTrainedTokenizerFast:
    """Characters as tokens (ids below `vocab_size`): prompts need some tokenizer, and none is downloaded."""
    vocab = {"\x00": 0, **{chr(32 + i): i + 1 for i in range(min(95, vocab_size - 1))}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="\x00"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="\x00", pad_token="\x00")


def letter_prompts(count: int, seed: int, length: int = 24) -> list[str]:
    generator = torch.Generator().manual_seed(seed)
    letters = torch.randint(26, (count, length), generator=generator)
    return ["".join(chr(97 + int(i)) for i in row) for row in letters]


def train_speculator(base, work: Path, minutes: float, inner: int, dtype_name: str) -> Path:
    """This package's trainer, on the base's own greedy continuations of prompts no evaluation uses."""
    base.save_pretrained(work / "base", max_shard_size="1GB")  # no multi-GB file
    tokenizer_for(base.config.vocab_size).save_pretrained(work / "base")
    (work / "prompts.txt").write_text("\n\n".join(letter_prompts(400, seed=0)))
    args = SpeculatorTrainingArguments(
        base_model=str(work / "base"), prompts=[str(work / "prompts.txt")], output_dir=str(work / "speculator"),
        targets_cache=str(work / "targets"), n_predict=HEADS, inner_dim=inner, tie_weights=True, scale_input=True,
        draft_vocab_size=min(8192, base.config.vocab_size), synthesize_prompts=0, new_tokens=64, eval_prompts=16,
        eval_new_tokens=32, max_train_minutes=minutes, dtype=dtype_name, report_to="none", save_only_model=True,
    )  # fmt: skip
    return Path(train(args))


def held_out_prompts(batch: int, device) -> torch.Tensor:
    """Letter prompts the trainer never saw (another seed), as token ids."""
    tokenizer = tokenizer_for(96)
    texts = letter_prompts(batch, seed=1000 + batch)
    return torch.tensor([tokenizer(text).input_ids for text in texts], device=device)


def end_to_end(base, speculator, profile: dict, batch: int, new_tokens: int, device, **kwargs) -> dict:
    """
    Plain and speculative greedy `generate()` on held-out prompts; speedup, identity, loop efficiency. Each is run
    once before it is timed, so that a compiled verifier has compiled every shape the timed call meets.
    """
    prompts = held_out_prompts(batch, device)
    for extra in ({}, {"assistant_model": speculator}):
        call_seconds(base, prompts, new_tokens, device, **kwargs, **extra)
    plain, expected = call_seconds(base, prompts, new_tokens, device, **kwargs)
    speculative, output = call_seconds(base, prompts, new_tokens, device, assistant_model=speculator, **kwargs)
    metrics = speculator.speculation_metrics
    forwards = sum(metrics.steps_by_depth)
    # What the steps would cost in the profile, each at the depth it ran (prefill and per-call work left out).
    modelled = sum(count * modelled_step_ms(profile, depth) for depth, count in enumerate(metrics.steps_by_depth))
    return {
        "batch": batch,
        "tokens_per_step": metrics.mean_tokens_per_step,
        "head_acceptance": metrics.head_acceptance_rates,
        "steps_by_depth": metrics.steps_by_depth,
        "speedup": plain / speculative,
        "identical": torch.equal(output, expected),
        "loop_efficiency": modelled / 1000 / speculative,
        "ms_per_step": speculative / forwards * 1000,
        "plain_ms_per_token": plain / new_tokens * 1000,
        "cache_slots": metrics.cache_slots,
    }


def split_map(layers: int, dry: bool) -> dict:
    """The embedding and the first half of the layers on the GPU, the rest on the CPU (dry run: the CPU, then disk)."""
    first, second = ("cpu", "disk") if dry else (0, "cpu")
    return {"model.embed_tokens": first, "model.rotary_emb": first,
            **{f"model.layers.{i}": first if i < layers // 2 else second for i in range(layers)},
            "model.norm": second, "lm_head": second}  # fmt: skip


def early_end(output: torch.Tensor, width: int) -> int | None:
    """An id that ends row 0 of a greedy batch of two early (in its first half) and never occurs in row 1."""
    first, second = output[0, width:].tolist(), set(output[1, width:].tolist())
    for position, token in enumerate(first[1 : len(first) // 2], start=1):
        if token not in second and token not in first[:position]:
            return token
    return None


def split_section(folder: Path, trained, dtype, dry: bool, new_tokens: int, offload: Path) -> list:
    from accelerate import dispatch_model

    base = LlamaForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    device_map = split_map(base.config.num_hidden_layers, dry)
    base = dispatch_model(base, device_map, main_device="cpu", offload_dir=str(offload))
    sync = "cpu" if dry else "cuda"
    prompts = held_out_prompts(2, "cpu")
    options = dict(pad_token_id=0)
    options["eos_token_id"] = early_end(call_seconds(base, prompts, new_tokens, sync)[1], prompts.shape[1])
    rows = []
    for side in ["cpu"] if dry else ["cuda:0", "cpu"]:
        speculator = trained.to(side)
        for extra in ({}, {"assistant_model": speculator}):  # warm-up
            call_seconds(base, prompts, new_tokens, sync, **options, **extra)
        plain, expected = call_seconds(base, prompts, new_tokens, sync, **options)
        speculative, output = call_seconds(base, prompts, new_tokens, sync, assistant_model=speculator, **options)
        ended = options["eos_token_id"] is not None and int((expected[0] == options["eos_token_id"]).sum()) > 0
        metrics = speculator.speculation_metrics
        rows.append({"speculator_on": side, "device_map": {k: str(v) for k, v in device_map.items()},
                     "speedup": plain / speculative, "identical": torch.equal(output, expected),
                     "row_ended_early": ended, "tokens_per_step": metrics.mean_tokens_per_step,
                     "steps_by_depth": metrics.steps_by_depth,
                     "plain_s": plain, "speculative_s": speculative})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    return rows


def markdown(results: dict) -> str:
    lines = [f"# Device check, {results['device']} (torch {results['torch']}, transformers {results['transformers']})"]
    if results.get("loop"):
        at = " / ".join(f"{t}" for t in TOKENS_PER_STEP)
        lines += ["", f"## Cost profile (ms; cache of {results['context']} tokens)", "",
                  f"| base | batch | plain step | verify 2 / 3 / 4 / 5 tokens | heads | predicted speedup at {at} "
                  "tokens per step |", "|---|---:|---:|---|---|---|"]  # fmt: skip
        for row in results["loop"]:
            verify = " / ".join(f"{row['verify_ms_by_new_tokens'][m]:.2f}" for m in range(2, HEADS + 2))
            heads = " / ".join(f"{ms:.2f}" for ms in row["head_ms"])
            predicted = " / ".join(f"{x:.2f}x" for x in row["predicted_speedup"])
            lines.append(f"| {row['base']} | {row['batch']} | {row['plain_ms']:.2f} | {verify} | {heads} | "
                         f"{predicted} |")  # fmt: skip
        lines += ["", "## The loop at forced depths (random speculator: every draft rejected)", "",
                  "A step's time in plain `generate()` steps, and its loop efficiency (the profile's verify of k + 1 "
                  "tokens and k heads over the step's measured time).", "",
                  "| base | batch | plain generate() step ms | "
                  + " | ".join(f"k={k}" for k in range(HEADS + 1)) + " |",
                  "|---|---:|---:|" + "---|" * (HEADS + 1)]  # fmt: skip
        for row in results["loop"]:
            cells = [f"{d['plain_steps']:.2f} plain, {d['efficiency']:.2f} eff." for d in row["depths"].values()]
            lines.append(f"| {row['base']} | {row['batch']} | {row['generate_plain_step_ms']:.2f} | "
                         + " | ".join(cells) + " |")  # fmt: skip
    if results.get("first_call"):
        lines += ["", "## An untrained speculator, as users call it (8B shape, batch 1)", "",
                  "| call of the process | speedup over plain generate() | identical | steps by depth |",
                  "|---|---:|---|---|"]  # fmt: skip
        for row in results["first_call"]:
            lines.append(f"| {row['call']} | {row['speedup']:.2f}x | {'yes' if row['identical'] else 'NO'} | "
                         f"{row['steps_by_depth']} |")  # fmt: skip
    for section, title in (("end_to_end", "End to end (1B-class learnable base, trained speculator)"),
                           ("compiled", "Compiled verifier, static cache (same pair)")):  # fmt: skip
        if results.get(section):
            lines += ["", f"## {title}", "",
                      "| batch | tokens/step | speedup | identical | loop efficiency | ms/step | plain ms/token |",
                      "|---:|---:|---:|---|---:|---:|---:|"]  # fmt: skip
            for row in results[section]:
                lines.append(f"| {row['batch']} | {row['tokens_per_step']:.2f} | {row['speedup']:.2f}x | "
                             f"{'yes' if row['identical'] else 'NO'} | {row['loop_efficiency']:.2f} | "
                             f"{row['ms_per_step']:.2f} | {row['plain_ms_per_token']:.2f} |")  # fmt: skip
    if results.get("split"):
        where = "CPU and disk" if results["device"].startswith("CPU") else "cuda:0 and the CPU"
        lines += ["", f"## A verifier split between {where} (same pair, batch 2, one row ends early)", "",
                  "| speculator on | speedup over plain generate() on the split | identical | a row ended early | "
                  "tokens/step |", "|---|---:|---|---|---:|"]  # fmt: skip
        for row in results["split"]:
            lines.append(f"| {row['speculator_on']} | {row['speedup']:.2f}x | {'yes' if row['identical'] else 'NO'} | "
                         f"{'yes' if row['row_ended_early'] else 'no'} | {row['tokens_per_step']:.2f} |")  # fmt: skip
    if results.get("training"):
        lines += ["", f"Training: {results['training']}"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="Folder for gpu_check.json and gpu_check.md.")
    parser.add_argument("--dry-run", action="store_true", help="Tiny shapes on the CPU, to check the script.")
    parser.add_argument("--train-minutes", type=float, default=1.5)
    parser.add_argument("--sections", default="loop,first_call,end_to_end,compiled,split")
    args = parser.parse_args(argv)
    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        print("gpu_check: error: no CUDA device; pass --dry-run to run the steps on the CPU", file=sys.stderr)
        return 2
    sections = args.sections.split(",")
    device, dtype = ("cpu", torch.float32) if dry else ("cuda", torch.bfloat16)
    bases = {"tiny": TINY} if dry else BASES
    inner, context, repeats, new_tokens = (48, 32, 3, 16) if dry else (INNER, CONTEXT, 20, 64)
    results = {"device": "CPU (dry run)" if dry else torch.cuda.get_device_name(), "torch": torch.__version__,
               "transformers": __import__("transformers").__version__, "context": context}  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def save(section, value):
        results[section] = value
        (out / "gpu_check.json").write_text(json.dumps(results, indent=2))
        (out / "gpu_check.md").write_text(markdown(results))

    if "loop" in sections:
        save("loop", loop_section(bases, device, dtype, inner, context, repeats, new_tokens))
    if "first_call" in sections:
        save("first_call", first_call_section(list(bases.values())[0], device, dtype, inner, context, 2 * new_tokens))
    if {"end_to_end", "compiled", "split"} & set(sections):
        fields = list(bases.values())[-1]  # the 1B-class shape (the tiny one in a dry run)
        base = build(fields, device, dtype, damping=DAMPING)
        speculator = random_speculator(base, inner, device, dtype)
        profiles = {batch: cost_profile(base, speculator, batch, 64, device, repeats) for batch in (1, 8)}
        with tempfile.TemporaryDirectory() as work:
            started = time.perf_counter()
            folder = train_speculator(base, Path(work), 0.2 if dry else args.train_minutes, inner,
                                      "float32" if dry else "bfloat16")  # fmt: skip
            trained = MLPSpeculatorPreTrainedModel.from_pretrained(folder).to(device, dtype).eval()
            files = sorted((p.relative_to(work).as_posix(), p.stat().st_size) for p in Path(work).rglob("*")
                           if p.is_file())  # fmt: skip
            largest = max(files, key=lambda f: f[1])
            results["training"] = (f"{time.perf_counter() - started:.0f} s in all; the largest file written: "
                                   f"{largest[0]}, {largest[1] / 2**20:.0f} MiB")  # fmt: skip
            if "end_to_end" in sections:
                rows = []
                for batch in (1, 8):
                    rows.append(end_to_end(base, trained, profiles[batch], batch, 2 * new_tokens, device))
                    print(json.dumps(rows[-1]), flush=True)
                save("end_to_end", rows)
            if "compiled" in sections:
                config = CompileConfig(backend="eager", fullgraph=False, mode=None) if dry else CompileConfig()
                config._compile_all_devices = dry  # transformers compiles on GPUs alone unless told
                row = end_to_end(base, trained, profiles[1], 1, 2 * new_tokens, device, cache_implementation="static",
                                 compile_config=config)  # fmt: skip
                print(json.dumps(row), flush=True)
                save("compiled", [row])
            if "split" in sections:
                del base, speculator  # the split base is loaded again from the folder the trainer read
                if not dry:
                    torch.cuda.empty_cache()
                save("split", split_section(Path(work) / "base", trained, dtype, dry, 2 * new_tokens,
                                            Path(work) / "offload"))  # fmt: skip
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
