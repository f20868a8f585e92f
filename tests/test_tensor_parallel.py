"""A tensor-parallel verifier (transformers' `tp_plan="auto"` and `DistributedConfig`) on two CPU processes with gloo:
every rank takes the same decision each step however its own timings differ, greedy output equals plain
tensor-parallel generate(), and a seeded sampled call gives the same tokens on both ranks and on every run."""

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import GLOO_EXIT_ABORT, make_speculator, make_verifier
from transformers import PreTrainedModel

SCRIPT = r'''
import json, os, random, sys
import torch
import hf_mlp_speculator
from hf_mlp_speculator.drafting import cost_model
from transformers import AutoModel, AutoModelForCausalLM

folder, way, out = sys.argv[1], sys.argv[2], sys.argv[3]
if way == "tp_plan":
    verifier = AutoModelForCausalLM.from_pretrained(f"{folder}/verifier", tp_plan="auto")
else:
    from transformers.distributed import DistributedConfig
    verifier = AutoModelForCausalLM.from_pretrained(f"{folder}/verifier",
                                                    distributed_config=DistributedConfig(tp_size=2))
verifier.eval().generation_config.assistant_confidence_threshold = 0.0
rank = torch.distributed.get_rank()
speculator = AutoModel.from_pretrained(f"{folder}/speculator").eval()
# One rank's timings are random values: its own controller would pick other depths than the other rank's.
if rank == 1:
    jitter = random.Random(0)
    record = cost_model.CostModel.record_verify
    cost_model.CostModel.record_verify = lambda self, length, tokens, _, *steady: record(
        self, length, tokens, jitter.random() / 50, *steady)
prompts = torch.tensor([[5, 9, 14, 3, 7, 21, 30, 2], [8, 8, 40, 12, 6, 17, 19, 4]])
mask = torch.ones_like(prompts)
results = {}
plain = verifier.generate(prompts, attention_mask=mask, max_new_tokens=24, do_sample=False)
eos = int(plain[0, 11])  # the first row ends early
results["plain"] = plain.tolist()
results["plain, early end"] = verifier.generate(prompts, attention_mask=mask, max_new_tokens=24, do_sample=False,
                                                eos_token_id=eos, pad_token_id=0).tolist()
modes = {"chain": {}, "tree": {"n_candidates": 3}, "hybrid": {"prompt_lookup_num_tokens": 2}}
for name, options in modes.items():
    results[name] = verifier.generate(prompts, attention_mask=mask, max_new_tokens=24, do_sample=False,
                                      assistant_model=speculator, **options).tolist()
results["chain, early end"] = verifier.generate(prompts, attention_mask=mask, max_new_tokens=24, do_sample=False,
                                                eos_token_id=eos, pad_token_id=0, assistant_model=speculator).tolist()
results["one prompt"] = verifier.generate(prompts[:1], max_new_tokens=24, do_sample=False,
                                          assistant_model=speculator).tolist()
results["plain one prompt"] = verifier.generate(prompts[:1], max_new_tokens=24, do_sample=False).tolist()
for call in range(2):
    torch.manual_seed(100 + rank)  # each rank its own generator: the call's key comes from the first rank
    results[f"sampled {call}"] = verifier.generate(prompts, attention_mask=mask, max_new_tokens=24, do_sample=True,
                                                   top_k=8, assistant_model=speculator).tolist()
results["depths"] = speculator.speculation_metrics.steps_by_depth
with open(f"{out}.{rank}.json", "w") as f:
    json.dump(results, f)
'''


def ways() -> list[str]:
    """The ways of asking for tensor parallelism that the installed transformers has."""
    parameters = inspect.getsource(PreTrainedModel.from_pretrained)
    found = [way for way in ("tp_plan", "distributed_config") if way in parameters]
    assert found, "this transformers has neither way of asking for tensor parallelism"
    return found


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tp")
    make_verifier().save_pretrained(folder / "verifier")
    make_speculator().save_pretrained(folder / "speculator")
    return folder


@pytest.mark.parametrize("way", ways())
def test_tensor_parallel_ranks_agree_and_match_plain(pair, way, tmp_path):
    script = tmp_path / "tp.py"
    script.write_text(SCRIPT)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(script), str(pair), way,
               str(tmp_path / "out")]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:  # a rank that hangs in a collective fails the test, not CI
        result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"the ranks hung: {str(error.stderr)[-2000:]}")
    outputs = [Path(f"{tmp_path / 'out'}.{rank}.json") for rank in (0, 1)]
    # gloo may abort a worker at interpreter exit, after both ranks wrote everything.
    exited_after_finishing = GLOO_EXIT_ABORT in result.stderr and all(path.is_file() for path in outputs)
    assert result.returncode == 0 or exited_after_finishing, result.stderr[-3000:]
    first, second = (json.loads(path.read_text()) for path in outputs)
    assert first == second  # every call, plain and speculative, gave the same tokens on both ranks
    for mode in ("chain", "tree", "hybrid"):
        assert first[mode] == first["plain"], mode
    assert first["chain, early end"] == first["plain, early end"]
    assert first["one prompt"] == first["plain one prompt"]
    assert first["sampled 0"] == first["sampled 1"]  # the same seed on the first rank: the same tokens
    assert sum(first["depths"]) > 0
