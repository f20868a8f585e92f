"""Progress that reads well where it is shown: a tqdm bar on a terminal, a line every few seconds in a log file.

Off a terminal (CI, `nohup`, a pipe) a bar's carriage returns pile up into one endless line, so there `Progress` prints
one plain line every `interval` seconds instead, with the same figures: how far, how fast, the latest metrics, ETA.
"""

import sys
import time

from tqdm.auto import tqdm


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


class Progress:
    """Counts `total` units (`unit`, e.g. steps; None if unknown); `update(n, **figures)` advances it and shows
    `figures`."""

    def __init__(self, total: int | None, description: str, unit: str, initial: int = 0, interval: float = 10.0,
                 disable: bool = False, stream=None):  # fmt: skip
        self.stream = stream or sys.stderr
        self.total, self.description, self.unit, self.interval = total, description, unit, interval
        self.count, self.figures = initial, {}
        self.disabled = disable
        self.bar = None
        if not disable and self.stream.isatty():
            self.bar = tqdm(total=total, initial=initial, desc=description, unit=unit, file=self.stream)
        self.start, self.start_count = time.monotonic(), initial
        self.last_line = self.start

    def update(self, n: int = 1, **figures) -> None:
        self.count += n
        self.figures.update(figures)
        if self.bar is not None:
            self.bar.set_postfix(self.figures, refresh=False)
            self.bar.update(n)
        elif not self.disabled and time.monotonic() - self.last_line >= self.interval:
            self.print_line()

    def write(self, message: str) -> None:
        """A line of its own (an evaluation result), above the bar on a terminal."""
        if self.disabled:
            return
        if self.bar is not None:
            self.bar.write(message, file=self.stream)
        else:
            print(message, file=self.stream, flush=True)

    def print_line(self) -> None:
        now = time.monotonic()
        self.last_line = now
        rate = (self.count - self.start_count) / max(now - self.start, 1e-9)
        figures = "".join(f", {key} {value}" for key, value in self.figures.items())
        count, eta = f"{self.count} {self.unit}", ""
        if self.total:
            count = f"{self.count}/{self.total} {self.unit} ({100 * self.count / self.total:.0f}%)"
            eta = f", ETA {_duration((self.total - self.count) / rate) if rate > 0 else '?'}"
        print(
            f"{self.description}: {count}, {rate:.1f} {self.unit}/s{figures}, elapsed {_duration(now - self.start)}"
            + eta,
            file=self.stream,
            flush=True,
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif not self.disabled:
            self.print_line()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
