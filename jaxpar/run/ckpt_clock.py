"""When a run checkpoints by time (`train.ckpt_minutes`), as a step interval all processes share.

A kill -9 or an out-of-memory then loses at most about `ckpt_minutes` of training, whatever the
model and hardware, without `train.ckpt_every` being tuned per run. Wall-clock checks differ
between processes, and a checkpoint is a collective save, so the time is turned into a step
interval: at calibration (CALIBRATION_STEPS after the start) and after every save, process 0
computes the next checkpoint step from the mean step time and the last save's duration, and
broadcasts it; every process then checkpoints at that same step.

The interval is stretched so that saving costs at most SAVE_SHARE of training time: a save of
s seconds waits for at least s / SAVE_SHARE seconds of steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable

CALIBRATION_STEPS = 10  # steps timed before the first interval is fixed
SAVE_SHARE = 0.02  # the most of training time checkpoints may take
MAX_INTERVAL = 2**31 - 1  # process 0 broadcasts the interval as an int32


class CheckpointClock:
    """`due(n)`: checkpoint after step n. `agree(v)` returns process 0's v on every process."""

    def __init__(self, minutes: float, start: int, agree: Callable[[int], int] = lambda v: v):
        self.seconds, self.agree = minutes * 60.0, agree
        self.calibration_step = start + CALIBRATION_STEPS if minutes > 0 else None
        self.next_step: int | None = None
        self.save_s = 0.0
        self.step_s = 0.0  # the mean step time the last plan used
        self._times: list[float] = []  # step times since the last plan

    def observe(self, step_time_s: float) -> None:
        self._times.append(step_time_s)

    def boundary(self, n: int) -> bool:
        """Whether the loop must stop at step n (read its metrics): calibration or a checkpoint."""
        return n == self.calibration_step or self.due(n)

    def due(self, n: int) -> bool:
        return self.next_step is not None and n >= self.next_step

    def at_boundary(self, n: int) -> None:
        """Called at every boundary after step n's metrics were observed."""
        if n == self.calibration_step:
            self._plan(n)

    def saved(self, n: int, seconds: float) -> None:
        """A checkpoint of step n took `seconds` (any checkpoint: by time, by step or at the end)."""
        self.save_s = seconds
        if self.calibration_step is not None and n >= self.calibration_step:
            self._plan(n)

    def interval_steps(self, step_s: float) -> int:
        """Steps until the next checkpoint at `step_s` seconds per step."""
        wait = max(self.seconds, self.save_s / SAVE_SHARE)
        return min(MAX_INTERVAL, max(1, math.ceil(wait / max(step_s, 1e-9))))

    def _plan(self, n: int) -> None:
        # A save right after a plan (a stop or train.ckpt_every at the calibration step) saw no
        # step since: the last plan's step time still holds.
        if self._times:
            self.step_s = sum(self._times) / len(self._times)
            self._times = []
        self.next_step = n + self.agree(self.interval_steps(self.step_s))
