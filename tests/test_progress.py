"""Progress in a log (plain lines every `interval` seconds, by a fake clock) and on a terminal (tqdm)."""

import io
import re
import types

from tqdm.auto import tqdm

from hf_mlp_speculator.utils import progress as progress_module
from hf_mlp_speculator.utils.progress import Progress


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def fake_clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(progress_module, "time", types.SimpleNamespace(monotonic=clock))
    return clock


def test_off_a_terminal_a_plain_line_every_interval(monkeypatch):
    clock, stream = fake_clock(monkeypatch), io.StringIO()
    progress = Progress(10, "Training the speculator", "steps", interval=10.0, stream=stream)
    assert progress.bar is None
    clock.now = 3.0
    progress.update(1, loss="1.500")
    assert stream.getvalue() == ""  # not yet `interval` seconds
    clock.now = 10.0
    progress.update(1, loss="1.250", acceptance="0.50/0.25")
    # 2 steps in 10 s: 0.2 steps/s, and 8 steps to go take 40 s.
    assert stream.getvalue() == (
        "Training the speculator: 2/10 steps (20%), 0.2 steps/s, loss 1.250, acceptance 0.50/0.25, elapsed 0m10s, "
        "ETA 0m40s\n"
    )
    clock.now = 19.0
    progress.update(1)
    assert stream.getvalue().count("\n") == 1  # 9 s after the last line
    clock.now = 20.0
    progress.update(1)
    lines = stream.getvalue().splitlines()
    # 4 steps in 20 s, 6 to go: 30 s; the figures are the latest ones.
    assert lines[1] == (
        "Training the speculator: 4/10 steps (40%), 0.2 steps/s, loss 1.250, acceptance 0.50/0.25, elapsed 0m20s, "
        "ETA 0m30s"
    )
    clock.now = 21.0
    progress.update(6)
    progress.close()  # the final line, whatever the interval
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3 and lines[2].startswith("Training the speculator: 10/10 steps (100%)")
    assert lines[2].endswith("elapsed 0m21s, ETA 0m00s")
    assert "\r" not in stream.getvalue()


def test_resumed_progress_counts_its_rate_from_where_it_resumed(monkeypatch):
    clock, stream = fake_clock(monkeypatch), io.StringIO()
    progress = Progress(100, "Training", "steps", initial=60, interval=5.0, stream=stream)
    clock.now = 3600.0
    progress.update(10)
    # 10 steps in an hour (not 70), 30 to go: 3 hours.
    assert stream.getvalue() == "Training: 70/100 steps (70%), 0.0 steps/s, elapsed 1h00m, ETA 3h00m\n"


def test_unknown_total_has_no_eta_and_write_prints_its_own_line(monkeypatch):
    clock, stream = fake_clock(monkeypatch), io.StringIO()
    progress = Progress(None, "Computing the base model's targets", "batches", interval=10.0, stream=stream)
    progress.write("step 3: held-out loss 1.0")
    clock.now = 12.0
    progress.update(3, positions=480)
    assert stream.getvalue().splitlines() == [
        "step 3: held-out loss 1.0",
        "Computing the base model's targets: 3 batches, 0.2 batches/s, positions 480, elapsed 0m12s",
    ]


def test_disabled_progress_prints_nothing(monkeypatch):
    clock, stream = fake_clock(monkeypatch), io.StringIO()
    with Progress(10, "Training", "steps", interval=0.0, disable=True, stream=stream) as progress:
        clock.now = 100.0
        progress.update(5, loss=1)
        progress.write("hello")
    assert stream.getvalue() == ""


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_on_a_terminal_a_tqdm_bar():
    stream = Terminal()
    with Progress(10, "Training", "steps", stream=stream) as progress:
        assert isinstance(progress.bar, tqdm)
        for _ in range(3):
            progress.update(1, loss="0.5")
        progress.write("step 3: held-out loss 1.0")
    output = stream.getvalue()
    assert "\r" in output  # a bar redrawn in place
    assert re.search(r"Training: +30%\|.*\| 3/10 \[.*loss=0\.5\]", output)
    assert "step 3: held-out loss 1.0\n" in output
