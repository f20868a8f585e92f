"""The device check runs end to end (tiny shapes on the CPU), so that it is ready when a GPU is lent."""

import importlib.util
import json
import math
from pathlib import Path


def test_gpu_check_dry_run(tmp_path):
    path = Path(__file__).parents[1] / "benchmarks" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [(row["base"], row["batch"]) for row in results["loop"]] == [("tiny", 1), ("tiny", 8)]
    for row in results["loop"]:
        assert set(row["verify_ms_by_new_tokens"]) == {"1", "2", "3", "4", "5"} and len(row["head_ms"]) == 4
        assert len(row["predicted_speedup"]) == 4 and all(x > 0 for x in row["predicted_speedup"])
        assert set(row["depths"]) == {"0", "1", "2", "3", "4"}
        # A step's time is a difference of two calls' times, which a loaded CPU can make negative: the dry run checks
        # that each depth was measured, the device run what it measured.
        assert all(math.isfinite(d["plain_steps"]) and math.isfinite(d["efficiency"]) for d in row["depths"].values())
    assert [row["call"] for row in results["first_call"]] == ["first", "second"]
    assert all(row["identical"] for row in results["first_call"])
    assert [row["batch"] for row in results["end_to_end"]] == [1, 8]
    for row in results["end_to_end"] + results["compiled"]:
        assert row["identical"] and row["tokens_per_step"] >= 1 and row["loop_efficiency"] > 0
    # The learnable base is learnt: drafts are accepted on prompts the trainer never saw.
    assert results["end_to_end"][0]["tokens_per_step"] > 1.5
    # The verifier split over devices (here the CPU and disk) with a row that ends early gives plain's tokens.
    (split,) = results["split"]
    assert split["speculator_on"] == "cpu" and split["identical"] and split["row_ended_early"]
    assert split["device_map"]["model.layers.1"] == "disk" and split["device_map"]["model.layers.0"] == "cpu"
    # Model-only checkpoints: nothing the size of an optimizer's state is written.
    assert "the largest file written" in results["training"]
    table = (tmp_path / "gpu_check.md").read_text()
    for title in ("## Cost profile", "## The loop at forced depths", "## An untrained speculator", "## End to end",
                  "## Compiled verifier", "## A verifier split between CPU and disk"):  # fmt: skip
        assert title in table
