"""Checkpoints that survive a kill at any moment, and the guard that keeps two runs from mixing in one folder.

Every write goes to a hidden folder or file that is fsynced and then renamed into place, so a run killed at any point
leaves either the complete checkpoint or none. `run.json` in the output folder records the settings that decide what
the run computes: a fresh run refuses a folder that holds another run, and a resumed run refuses to continue one with
other settings.
"""

import dataclasses
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..modeling_mlp_speculator import MLPSpeculatorPreTrainedModel

RUN_FILE = "run.json"


@dataclass
class TrainerState:
    """What a checkpoint needs besides weights and optimizer to continue exactly: the step (the data order follows
    from it and the seed) and the plan of the run (how many target files and steps it uses)."""

    step: int = 0
    total_steps: int = 0
    log_history: list = field(default_factory=list)


def fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(folder: Path) -> None:
    for path in [*folder.rglob("*"), folder]:
        fsync(path)


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".tmp-{path.name}")
    tmp.write_text(text)
    fsync(tmp)
    os.replace(tmp, path)


def checkpoints(output_dir) -> list[Path]:
    """The complete checkpoints in `output_dir`, oldest first (incomplete ones are never named checkpoint-*)."""
    found = [p for p in Path(output_dir).glob("checkpoint-*") if p.name.split("-")[-1].isdigit()]
    return sorted(found, key=lambda p: int(p.name.split("-")[-1]))


def latest_checkpoint(output_dir) -> Path | None:
    """The complete checkpoint of the highest step in `output_dir`."""
    return (checkpoints(output_dir) or [None])[-1]


def claim_output_dir(output_dir: Path, settings: dict, resume: bool) -> None:
    """
    Makes `output_dir` this run's: records `settings` in `run.json`, or, when the folder already holds a run that saved
    something, checks that this is its resumption with the same settings. Raises a `ValueError` naming the problem and
    the fix otherwise. A run that saved nothing (it stopped at a bad input, say) is simply replaced.
    """
    if output_dir.exists() and not output_dir.is_dir():
        raise ValueError(
            f"--output-dir {output_dir} is a file, not a folder: name a new folder, or a run's to resume."
        )
    run_file = output_dir / RUN_FILE
    earlier = json.loads(run_file.read_text()) if run_file.is_file() else None
    leftovers = [p.name for p in (*checkpoints(output_dir), output_dir / "model.safetensors") if p.exists()]
    if earlier is None and leftovers:
        raise ValueError(
            f"{output_dir} holds {', '.join(leftovers)} from a run that recorded no {RUN_FILE} (made by another version "
            "or by hand). Train into an empty folder, or remove them."
        )
    if earlier is not None and leftovers and not resume:
        raise ValueError(
            f"{output_dir} already holds a training run. Pass --resume to continue it, or choose another "
            "--output-dir (or delete the folder) to start a new one."
        )
    if earlier is not None and leftovers:
        changed = {k: (earlier.get(k), v) for k, v in settings.items() if earlier.get(k) != v}
        if changed:
            listing = "; ".join(f"{k}: {old!r} then, {new!r} now" for k, (old, new) in sorted(changed.items()))
            raise ValueError(
                f"--resume would continue the run in {output_dir} with other settings ({listing}), and mix two runs. "
                "Resume with the same settings, or train into another --output-dir."
            )
        return
    output_dir.mkdir(parents=True, exist_ok=True)
    write_atomically(run_file, json.dumps(settings, indent=1, sort_keys=True))


def save_checkpoint(speculator, optimizer_state: dict, state: TrainerState, output_dir: Path, keep: int) -> None:
    """
    Writes `checkpoint-{step}` atomically (a loadable speculator, the optimizer's state dict and the trainer's state),
    keeping `keep`.
    """
    final, tmp = output_dir / f"checkpoint-{state.step}", output_dir / f".tmp-checkpoint-{state.step}"
    for stale in output_dir.glob(".tmp-checkpoint-*"):
        shutil.rmtree(stale)
    tmp.mkdir(parents=True)
    speculator.save_pretrained(tmp)
    torch.save(optimizer_state, tmp / "optimizer.pt")
    (tmp / "trainer_state.json").write_text(json.dumps(dataclasses.asdict(state), indent=1))
    fsync_tree(tmp)
    os.replace(tmp, final)
    fsync(output_dir)
    old = [p for p in checkpoints(output_dir) if p != final]
    for stale in old[: max(len(old) - keep + 1, 0)]:
        # Renamed first, so that a kill halfway through the deletion leaves no partial checkpoint-* folder.
        trash = stale.with_name(f".tmp-{stale.name}")
        os.replace(stale, trash)
        shutil.rmtree(trash)


def load_checkpoint(path: Path) -> tuple[dict, dict, TrainerState]:
    """
    The weights, the optimizer's state dict and the trainer's state of a checkpoint of this run (`claim_output_dir`
    checked its shape).
    """
    weights = MLPSpeculatorPreTrainedModel.from_pretrained(path).state_dict()
    # On the CPU: loading the state into the optimizer moves it to the parameters' device.
    optimizer_state = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
    return weights, optimizer_state, TrainerState(**json.loads((path / "trainer_state.json").read_text()))


def save_final(speculator, state: TrainerState, output_dir: Path) -> None:
    """
    The final speculator into `output_dir` itself, in the published layout, with the run's log. Written into a hidden
    folder first and moved file by file, `config.json` last: until it is in place the folder does not load as a model.
    """
    tmp = output_dir / ".tmp-final"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    speculator.save_pretrained(tmp)
    (tmp / "trainer_state.json").write_text(json.dumps(dataclasses.asdict(state), indent=1))
    fsync_tree(tmp)
    for path in sorted(tmp.iterdir(), key=lambda p: p.name == "config.json"):
        os.replace(path, output_dir / path.name)
    fsync(output_dir)
    tmp.rmdir()
