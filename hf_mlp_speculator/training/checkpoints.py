"""Checkpoints that survive a kill at any moment, and the guard that keeps two runs from mixing in one folder.

Every write goes to a hidden folder or file that is fsynced and then renamed into place, so a run killed at any point
leaves either the complete checkpoint or none, and a write that fails (a full disk) removes its hidden folder and stops
the run with the previous checkpoint intact. `run.json` in the output folder records the settings that decide what
the run computes: a fresh run refuses a folder that holds another run, and a resumed run refuses to continue one with
other settings. A checkpoint or `run.json` that cannot be read is an error that names the file.
"""

import dataclasses
import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..models.modeling_mlp_speculator import MLPSpeculatorPreTrainedModel

RUN_FILE = "run.json"
OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "trainer_state.json"


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


def _reason(error: Exception) -> str:
    """What went wrong, in a few words: torch's messages go on with advice that does not apply here (to load with
    weights_only=False, say), so only their first sentence is kept."""
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    text = re.split(r"\.\s+(?=[A-Z])", " ".join(str(error).split()))[0].rstrip(".")
    if "unexpected pos" in text:  # torch.save's words for a short write
        text += ", a short write (is the disk full?)"
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _read(file: Path, read, fix: str):
    """`read(file)`, or a one-line `ValueError` naming the file, what failed and `fix`."""
    try:
        return read(file)
    except Exception as error:
        raise ValueError(f"{file} cannot be read ({_reason(error)}). {fix}") from error


def _write_failed(what: str, error: Exception, output_dir: Path, optimizer_saved: bool) -> OSError:
    """The error of a write that failed and left nothing behind: what failed, the checkpoint kept, the fixes."""
    kept = latest_checkpoint(output_dir)
    resumable = kept is not None and (kept / OPTIMIZER_FILE).is_file()
    if kept is None:
        status = "No earlier checkpoint was written."
    else:
        status = f"The previous checkpoint, {kept.name}, is kept whole" + (
            "; --resume continues from it." if resumable else " (written with --save-only-model: not resumable)."
        )
    fixes = ["free space on that disk", "train into another --output-dir"]
    if optimizer_saved:
        fixes.append("pass --save-only-model to leave the optimizer's state, most of a checkpoint, out")
    return OSError(
        f"Writing {what} failed ({_reason(error)}), and nothing of it is left behind. {status} To finish the run, "
        f"{', '.join(fixes[:-1])} or {fixes[-1]}."
    )


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
    earlier = None
    if run_file.is_file():
        earlier = _read(run_file, lambda f: _json_object(f.read_text()), f"It records the settings of the run in "
                        f"{output_dir}: restore it, or train into another --output-dir.")  # fmt: skip
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


def _json_object(text: str) -> dict:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"a JSON {type(value).__name__}, not an object")
    return value


def save_checkpoint(speculator, optimizer_state: dict | None, state: TrainerState, output_dir: Path, keep: int):
    """
    Writes `checkpoint-{step}` atomically (a loadable speculator, the optimizer's state dict unless it is `None`
    (`save_only_model`), and the trainer's state), keeping `keep`. A failed write raises an `OSError` that says so.
    """
    final, tmp = output_dir / f"checkpoint-{state.step}", output_dir / f".tmp-checkpoint-{state.step}"
    for stale in output_dir.glob(".tmp-checkpoint-*"):
        shutil.rmtree(stale)
    try:
        tmp.mkdir(parents=True)
        speculator.save_pretrained(tmp)
        if optimizer_state is not None:
            torch.save(optimizer_state, tmp / OPTIMIZER_FILE)
        (tmp / STATE_FILE).write_text(json.dumps(dataclasses.asdict(state), indent=1))
        fsync_tree(tmp)
        os.replace(tmp, final)
    except Exception as error:
        # A full disk must not cost the previous checkpoint, nor leave a half-written folder taking space.
        shutil.rmtree(tmp, ignore_errors=True)
        raise _write_failed(f"checkpoint {final}", error, output_dir, optimizer_state is not None) from error
    fsync(output_dir)
    old = [p for p in checkpoints(output_dir) if p != final]
    for stale in old[: max(len(old) - keep + 1, 0)]:
        # Renamed first, so that a kill halfway through the deletion leaves no partial checkpoint-* folder.
        trash = stale.with_name(f".tmp-{stale.name}")
        os.replace(stale, trash)
        shutil.rmtree(trash)


def check_resumable(path: Path) -> None:
    """Refuses a checkpoint without the optimizer's state before the run spends time on anything else."""
    if not (path / OPTIMIZER_FILE).is_file():
        raise ValueError(
            f"--resume cannot continue from {path}: it holds no {OPTIMIZER_FILE} (checkpoints written with "
            "--save-only-model leave it out), and without the optimizer's state the run would not continue as it "
            "would have. Such checkpoints are for evaluating or picking a speculator (from_pretrained loads them): "
            "to train further, start a run into another --output-dir, without --save-only-model to resume it later."
        )


def _damaged(path: Path) -> str:
    """The fix for a damaged file of checkpoint `path`: fall back to the checkpoint before it."""
    earlier = [p for p in checkpoints(path.parent) if p != path]
    then = f"continue from {earlier[-1].name}" if earlier else "start the run over"
    return f"The checkpoint is damaged: delete {path} and --resume again to {then}, or train into another --output-dir."


def load_checkpoint(path: Path) -> tuple[dict, dict, TrainerState]:
    """
    The weights, the optimizer's state dict and the trainer's state of a checkpoint of this run (`claim_output_dir`
    checked its shape); a file that cannot be read is a `ValueError` naming it.
    """
    check_resumable(path)
    fix = _damaged(path)
    state = _read(path / STATE_FILE, lambda f: TrainerState(**_json_object(f.read_text())), fix)
    _read(path / "config.json", lambda f: _json_object(f.read_text()), fix)
    weights_file = next(path.glob("*.safetensors"), path)  # a sharded save is named by its folder
    weights = _read(weights_file, lambda _: MLPSpeculatorPreTrainedModel.from_pretrained(path).state_dict(), fix)
    # On the CPU: loading the state into the optimizer moves it to the parameters' device.
    optimizer_state = _read(
        path / OPTIMIZER_FILE, lambda f: torch.load(f, map_location="cpu", weights_only=True), fix
    )
    return weights, optimizer_state, state


def save_final(speculator, state: TrainerState, output_dir: Path) -> None:
    """
    The final speculator into `output_dir` itself, in the published layout, with the run's log. Written into a hidden
    folder first and moved file by file, `config.json` last: until it is in place the folder does not load as a model.
    A failed write raises an `OSError` that says so.
    """
    tmp = output_dir / ".tmp-final"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        speculator.save_pretrained(tmp)
        (tmp / STATE_FILE).write_text(json.dumps(dataclasses.asdict(state), indent=1))
        fsync_tree(tmp)
    except Exception as error:
        shutil.rmtree(tmp, ignore_errors=True)
        raise _write_failed(f"the final speculator into {output_dir}", error, output_dir, False) from error
    for path in sorted(tmp.iterdir(), key=lambda p: p.name == "config.json"):
        os.replace(path, output_dir / path.name)
    fsync(output_dir)
    tmp.rmdir()
