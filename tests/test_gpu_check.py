"""The device check runs end to end (tiny shapes on the CPU), so that it is ready when a GPU is lent."""

import importlib.util
import json
from pathlib import Path


def test_gpu_check_dry_run(tmp_path):
    path = Path(__file__).parents[1] / "benchmarks" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [(row["base"], row["batch"]) for row in results["cost_profile"]] == [("tiny", 1), ("tiny", 8)]
    for row in results["cost_profile"]:
        assert set(row["verify_ms_by_new_tokens"]) == {"1", "2", "3", "4", "5"} and len(row["head_ms"]) == 4
        assert len(row["predicted_speedup"]) == 4 and all(x > 0 for x in row["predicted_speedup"])
    assert [row["batch"] for row in results["end_to_end"]] == [1, 8]
    for row in results["end_to_end"]:
        assert row["identical"] and row["tokens_per_step"] >= 1 and row["loop_efficiency"] > 0
    batched = results["end_to_end"][1]  # rows share one rectangular cache there
    assert 0 < batched["cache_slots"] <= batched["cache_slots_uncompacted"]
    table = (tmp_path / "gpu_check.md").read_text()
    assert "## Cost profile" in table and "| tiny | 8 |" in table and "## End to end" in table
