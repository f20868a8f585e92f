"""Timing work on a device without waiting for it: what the cost model's timings come from."""

import time
from typing import NamedTuple

import torch


class Timing(NamedTuple):
    """A span of work: its `seconds` where known at once (the wall clock, off CUDA), else the CUDA events around it."""

    seconds: float | None
    events: tuple | None = None


class Stopwatch:
    """
    Times work on a device without waiting for it. `start()` marks the beginning, `stop(mark)` the end, and
    `report(timing, done)` calls `done(seconds)` once the time is known. On CUDA the marks are events, read once the
    device has passed them (a step or so later) and never waited for; elsewhere the work is done when the call returns,
    so the wall clock is exact at once.
    """

    def __init__(self, device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.pending = []  # (start event, end event, done) not read yet, in the order the device runs them

    def start(self):
        if not self.cuda:
            return time.perf_counter()
        mark = torch.cuda.Event(enable_timing=True)
        mark.record(torch.cuda.current_stream(self.device))  # the model's device, not the current one
        return mark

    def stop(self, mark) -> Timing:
        if not self.cuda:
            return Timing(time.perf_counter() - mark)
        end = torch.cuda.Event(enable_timing=True)
        end.record(torch.cuda.current_stream(self.device))
        return Timing(None, (mark, end))

    def report(self, timing: Timing, done) -> None:
        if timing.seconds is not None:
            done(timing.seconds)
            return
        self.pending.append((*timing.events, done))
        self.poll()

    def poll(self, wait: bool = False) -> None:
        """Hands over the timings whose work has finished (all of them, waiting for the device, if `wait`)."""
        while self.pending and (wait or self.pending[0][1].query()):
            start, end, done = self.pending.pop(0)
            end.synchronize()
            done(start.elapsed_time(end) / 1000)
