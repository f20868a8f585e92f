"""The demo's and the benchmark's measurements: token counting, latency and speedup arithmetic, and both commands end
to end on a tiny random model pair."""

import functools
import json
import re
import time
from types import SimpleNamespace

import pytest
import torch
from conftest import make_oracle, make_prompt, make_speculator, make_verifier
from tiny_tokenizer import char_tokenizer
from transformers import LlamaForCausalLM

from hf_mlp_speculator import SpeculationMetrics, cli
from hf_mlp_speculator.models.modeling_mlp_speculator import MLPSpeculator
from hf_mlp_speculator.tools.bench import (
    Mode,
    markdown_table,
    measure_verify_cost,
    new_tokens_per_row,
    summarize,
)
from hf_mlp_speculator.tools.runs import GenerationRun, cpu_features, load_pair, machine_description, token_latencies
from hf_mlp_speculator.training.documents import left_padded


@pytest.fixture
def clock(monkeypatch):
    """
    A clock (`time.perf_counter`) that only the tiny Llama verifier's forwards and the draft heads move: a forward
    over `m` new tokens takes `clock.forward(m)` seconds (1 s unless set), a head step `clock.head` seconds (0 unless
    set). What the demo and the benchmark measure under it is known exactly, independently of their own arithmetic.
    """
    clock = SimpleNamespace(now=0.0, forward=lambda new_tokens: 1.0, head=0.0)
    forward, step = LlamaForCausalLM.forward, MLPSpeculator.step

    @functools.wraps(forward)
    def timed_forward(self, *args, **kwargs):
        clock.now += clock.forward((args[0] if args else kwargs["input_ids"]).shape[1])
        return forward(self, *args, **kwargs)

    def timed_step(self, *args, **kwargs):
        clock.now += clock.head
        return step(self, *args, **kwargs)

    monkeypatch.setattr(LlamaForCausalLM, "forward", timed_forward)
    monkeypatch.setattr(MLPSpeculator, "step", timed_step)
    monkeypatch.setattr(time, "perf_counter", lambda: clock.now)
    return clock


def test_token_latencies_share_each_forward_among_its_tokens():
    # Forwards at 0.5 s (1 token), 0.6 s (3 tokens) and 0.9 s (2 tokens) after a call that started at 0.
    latencies = token_latencies(0.0, [0.5, 0.6, 0.9], [1, 3, 2])
    assert latencies == pytest.approx([0.5, 0.1 / 3, 0.1 / 3, 0.1 / 3, 0.15, 0.15])
    assert sum(latencies) == pytest.approx(0.9)


def test_merged_metrics_equal_one_call_with_all_the_steps():
    steps = [[(3, 3), (3, 1)], [(2, 0), (1, 1)], []]
    separate = []
    for call in steps:
        separate.append(SpeculationMetrics())
        for drafted, accepted in call:
            separate[-1].record_step(drafted, accepted)
    together = SpeculationMetrics()
    for drafted, accepted in (step for call in steps for step in call):
        together.record_step(drafted, accepted)
    merged = sum(separate, SpeculationMetrics())
    assert merged == together
    assert merged.draft_acceptance_rate == pytest.approx(5 / 9)
    assert merged.head_acceptance_rates == pytest.approx([3 / 4, 1 / 3, 1 / 2])


def test_speed_counts_tokens_not_chunks(clock):
    verifier, prompt = make_verifier(), make_prompt()
    oracle = make_oracle(verifier, prompt, num_tokens=12)  # every draft right: 4 tokens per verify forward
    plain, speculative = GenerationRun("plain"), GenerationRun("speculative")
    plain.generate(verifier, prompt, do_sample=False, max_new_tokens=12)
    speculative.generate(verifier, prompt, assistant_model=oracle, do_sample=False, max_new_tokens=12)

    assert plain.outputs == speculative.outputs and plain.num_tokens == speculative.num_tokens == 12
    assert plain.chunk_sizes == [1] * 12 and plain.tokens_per_step == 1
    # Prefill emits 1 token, then 11 tokens in forwards of 4, 4 and 3: 4 forwards of 1 s for 12 tokens.
    assert speculative.chunk_sizes == [1, 4, 4, 3] and speculative.tokens_per_step == 3
    assert (plain.seconds, speculative.seconds) == (12.0, 4.0)
    assert (plain.tokens_per_second, speculative.tokens_per_second) == (1.0, 3.0)
    assert plain.latencies == [1.0] * 12
    assert speculative.latencies == pytest.approx([1.0] + [0.25] * 8 + [1 / 3] * 3)
    assert speculative.speculation_metrics.draft_acceptance_rate == 1.0


def _run(name, outputs, seconds, chunk_sizes=None, metrics=None):
    run = GenerationRun(name, outputs=outputs, seconds=seconds, metrics=metrics or [])
    run.chunk_sizes = chunk_sizes or [1] * sum(map(len, outputs))
    run.latencies = [seconds / run.num_tokens] * run.num_tokens
    return run


def test_summary_ratios_against_each_modes_baseline():
    metrics = SpeculationMetrics()
    metrics.record_step(2, 1)
    runs = {
        "plain greedy": _run("plain greedy", [[1, 2, 3, 4]], seconds=2.0),
        "speculator k=2": _run(
            "speculator k=2", [[1, 2, 3, 4]], seconds=0.5, chunk_sizes=[1, 2, 1], metrics=[metrics]
        ),
        "plain sampling": _run("plain sampling", [[5, 6]], seconds=1.0),
        "speculative sampling k=2": _run("speculative sampling k=2", [[7, 8, 9]], seconds=1.0),
    }
    modes = [
        Mode("plain greedy", {"do_sample": False}, "plain greedy"),
        Mode("speculator k=2", {"do_sample": False}, "plain greedy", heads=2),
        Mode("plain sampling", {"do_sample": True}, "plain sampling"),
        Mode("speculative sampling k=2", {"do_sample": True}, "plain sampling"),
    ]
    rows = {row["mode"]: row for row in summarize(modes, runs)}
    assert rows["plain greedy"]["speedup"] == 1.0 and rows["plain greedy"]["tokens_per_second"] == 2.0
    assert rows["speculator k=2"]["speedup"] == 4.0 and rows["speculator k=2"]["identical_to_baseline"] is True
    assert rows["speculator k=2"]["tokens_per_step"] == pytest.approx(4 / 3)
    assert rows["speculator k=2"]["acceptance_rate"] == 0.5 and rows["speculator k=2"]["latency_ms_median"] == 125
    assert rows["speculative sampling k=2"]["speedup"] == 1.5
    assert rows["speculative sampling k=2"]["identical_to_baseline"] is None  # samples need not match
    table = markdown_table(list(rows.values()))
    assert "| speculator k=2 | 8.0 | 4.00x | - | 125.0 | 125.0 | 1.33 | 0.50 | 1.00, 0.00 | yes |" in table
    # With plain greedy decoding on the faster weights measured, greedy modes are also compared with it.
    runs["plain greedy, faster weights"] = _run("plain greedy, faster weights", [[1, 2, 3, 4]], seconds=1.0)
    modes.insert(1, Mode("plain greedy, faster weights", {"do_sample": False}, "plain greedy", fast_cpu=True))
    rows = {row["mode"]: row for row in summarize(modes, runs)}
    assert rows["speculator k=2"]["speedup_over_faster_weights"] == 2.0 and rows["speculator k=2"]["speedup"] == 4.0
    assert rows["plain greedy, faster weights"]["speedup"] == 2.0
    assert rows["speculative sampling k=2"]["speedup_over_faster_weights"] is None
    assert "| speculator k=2 | 8.0 | 4.00x | 2.00x |" in markdown_table(list(rows.values()))


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """A tiny random Llama with a character tokenizer, and a random 3-head speculator for it, saved as folders."""
    folder = tmp_path_factory.mktemp("tiny")
    make_verifier().save_pretrained(folder / "model")
    char_tokenizer().save_pretrained(folder / "model")
    make_speculator(n_predict=3).save_pretrained(folder / "speculator")
    return str(folder / "model"), str(folder / "speculator")


def run_bench(tiny_pair, output_dir, *flags, results="bench.json") -> list[dict]:
    """`hf-mlp-speculator bench` on the tiny pair; returns the results it wrote."""
    model, speculator = tiny_pair
    argv = ["bench", "--model", model, "--speculator", speculator, "--max-new-tokens", "6", "--output-dir",
            str(output_dir), *flags]  # fmt: skip
    assert cli.main(argv) == 0
    return json.loads((output_dir / results).read_text())["results"]


@pytest.mark.parametrize("prompt_set", ["chat", "grounded"])
def test_bench_end_to_end(tiny_pair, tmp_path, clock, prompt_set):
    results = run_bench(tiny_pair, tmp_path, "--num-prompts", "2", "--prompt-set", prompt_set)
    rows = {row["mode"]: row for row in results}
    assert list(rows) == ["plain greedy", "plain greedy, faster weights", "prompt lookup", "speculator k=1",
                          "speculator k=2", "speculator k=3",
                          "hybrid (speculator + prompt lookup)", "speculator tree [2, 2, 2] n=5", "plain sampling",
                          "speculative sampling k=3"]  # fmt: skip
    assert rows["speculator tree [2, 2, 2] n=5"]["identical_to_baseline"] is True
    assert rows["hybrid (speculator + prompt lookup)"]["identical_to_baseline"] is True
    assert rows["plain greedy"]["speedup"] == 1.0 and rows["plain greedy"]["tokens_per_step"] == 1.0
    assert rows["plain greedy, faster weights"]["identical_to_baseline"] is True
    for k in (1, 2, 3):
        row = rows[f"speculator k={k}"]
        # Lossless: every head count reproduces plain greedy decoding (tiny models never emit an end token).
        assert row["identical_to_baseline"] is True and row["tokens"] == 12
        assert len(row["head_acceptance_rates"]) == k and 0 <= row["acceptance_rate"] <= 1
    # Every forward takes 1 s and emits one chunk, and plain decoding emits 1 token per forward: each mode's tokens/s
    # and speedup are its tokens per forward, counted from the chunks the streamer saw.
    for row in results:
        assert row["tokens_per_second"] == pytest.approx(row["tokens_per_step"])
        assert row["speedup"] == pytest.approx(row["tokens_per_step"])
        assert row["seconds"] == pytest.approx(row["tokens"] / row["tokens_per_step"])
    assert rows["speculative sampling k=3"]["baseline"] == "plain sampling"
    assert rows["speculative sampling k=3"]["acceptance_rate"] is not None
    table = (tmp_path / "bench.md").read_text()
    assert all(f"| {mode} |" in table for mode in rows)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert not (tmp_path / "bench.png").exists()
    else:
        assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"


def test_left_padding_and_token_counts():
    input_ids, attention_mask = left_padded([[5, 6, 7], [8]], pad_token_id=2)
    assert input_ids.tolist() == [[5, 6, 7], [2, 2, 8]] and attention_mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    sequences = torch.tensor([[5, 6, 7, 9, 1, 2, 2], [2, 2, 8, 4, 4, 4, 4]])
    assert new_tokens_per_row(sequences, 3, eos_token_ids=[1]) == [2, 4]  # up to and including the first EOS


def test_batch_bench_end_to_end(tiny_pair, tmp_path, clock):
    rows = run_bench(tiny_pair, tmp_path, "--batch-sizes", "1,3", results="bench_batch.json")
    assert [row["batch_size"] for row in rows] == [1, 3]
    for row in rows:
        assert row["identical"] is True and row["tokens"] == 6 * row["batch_size"]
        # Plain decoding: 6 forwards of 1 s, one token per row each.
        assert row["plain_tokens_per_second"] == pytest.approx(row["batch_size"])
        assert row["plain_per_user_tokens_per_second"] == pytest.approx(1.0)
        # Speculative decoding: a whole number of 1-s forwards (prefill, then one per step), at most plain's 6.
        forwards = row["tokens"] / row["speculative_tokens_per_second"]
        assert forwards == pytest.approx(round(forwards)) and 1 <= round(forwards) <= 6
        assert row["speedup"] == pytest.approx(6 / round(forwards))
        # The faster weights' forwards take the clock's 1 s too: plain decoding on them runs at the same speed.
        assert row["faster_weights_tokens_per_second"] == pytest.approx(row["batch_size"])
        assert row["speedup_over_faster_weights"] == pytest.approx(row["speedup"])
        assert row["speculative_per_user_tokens_per_second"] == pytest.approx(6 / round(forwards))
    table = (tmp_path / "bench_batch.md").read_text()
    assert "| 3 |" in table and machine_description() in table


def test_verify_cost_ratios(tiny_pair, tmp_path, clock):
    model, _, speculator = load_pair(*tiny_pair)
    clock.forward = lambda new_tokens: 0.050 + 0.010 * new_tokens  # 60 ms for one token, 10 ms more per token
    clock.head = 0.005
    cost = measure_verify_cost(model, speculator, context_length=20, max_k=3, repeats=2)
    assert cost["forward_ms_by_new_tokens"] == pytest.approx({m: 50 + 10 * m for m in (1, 2, 3, 4)})
    assert cost["verify_ratio_by_k"] == pytest.approx({1: 70 / 60, 2: 80 / 60, 3: 90 / 60})
    assert cost["draft_head_ms"] == pytest.approx([5.0] * 3)
    assert cost["draft_cost_per_head"] == pytest.approx([5 / 60] * 3)

    argv = ["bench", "--verify-cost", "--model", tiny_pair[0], "--speculator", "untrained", "--context-length", "20",
            "--repeats", "2", "--output-dir", str(tmp_path)]  # fmt: skip
    assert cli.main(argv) == 0
    results = json.loads((tmp_path / "verify_cost.json").read_text())
    # The tiny model is an fp32 CPU one: each kind of weights that speculative generate() may verify with is measured.
    for kind in ("verify_cost", "verify_cost_transposed", "verify_cost_packed"):
        assert set(results[kind]["verify_ratio_by_k"]) == {"1", "2", "3", "4"}, kind


def test_demo_end_to_end(tiny_pair, capsys, clock):
    model, speculator = tiny_pair
    argv = ["demo", "--model", model, "--speculator", speculator, "--num-prompts", "2", "--max-new-tokens", "5"]
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert "Greedy outputs identical: yes (2/2 prompts)" in out
    assert "Speculative metrics: Draft acceptance rate:" in out and "Per-head acceptance rate: [" in out
    # Forwards of 1 s: plain decoding runs at 1 token/s, and the speedup is the tokens per verifier forward.
    assert "Without speculation:    1.0 toks/s (10 tokens in 10.0 s)" in out
    faster = "Faster weights:         1.0 toks/s (10 tokens in 10.0 s, plain generate() on the kind of weights that"
    assert faster + " measured fastest)" in out
    tokens_per_forward = re.search(r"([\d.]+) tokens per verifier forward", out).group(1)
    assert f"Speedup: {tokens_per_forward}x over plain generate(), {tokens_per_forward}x over it on the faster" in out
    assert machine_description() in out and "CPU: " in out
    # Off a terminal, progress comes as plain lines, not a bar's carriage returns; it counts tokens: 2 prompts x 5
    # tokens in each run, at the speed of the run so far (1 token/s by the clock).
    assert "\r" not in err
    lines = re.findall(r"(Without speculation|With MLPSpeculator): (\d+) tokens, .*speed ([\d.]+) tok/s", err)
    finals = {name: (tokens, speed) for name, tokens, speed in lines}
    assert finals["Without speculation"] == ("10", "1.0") and finals["With MLPSpeculator"][0] == "10"


def test_bench_on_the_users_prompts(tiny_pair, tmp_path, clock):
    """`bench --prompts FILE` reads a prompt file as `train` does (here: two prompts separated by a blank line)."""
    prompts = tmp_path / "mine.txt"
    prompts.write_text("Say hello.\n\nCount to three,\nslowly.\n")
    rows = run_bench(tiny_pair, tmp_path / "out", "--prompts", str(prompts), "--num-prompts", "5")
    written = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert written["environment"]["prompts"] == str(prompts)
    plain = next(row for row in rows if row["mode"] == "plain greedy")
    assert plain["tokens"] == 2 * 6  # both prompts of the file, and only they, 6 tokens each


def test_cpu_features_name_the_vector_width():
    """A CPU without AVX-512 says so, and which width it has: which kind of weights wins follows from it."""
    assert cpu_features({"fma", "avx", "avx2"}) == ["AVX2", "no AVX-512", "no AMX"]
    assert cpu_features({"avx2", "avx512f", "avx512_vnni"}) == ["AVX-512", "no AMX"]
    assert cpu_features({"avx2", "avx512f", "avx512_bf16", "amx_tile"}) == ["AVX-512", "AVX-512 BF16", "AMX"]
    assert cpu_features({"neon"}) == ["no AMX"] and cpu_features(set()) == []
