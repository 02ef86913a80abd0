"""Periodic checkpoints by default (`train.ckpt_minutes`, jaxpar.run.ckpt_clock) and
`train.keep_checkpoints`: the step interval planned from step and save times, the run that is
killed mid-way and resumes, the number of step dirs kept."""

import json
import os

import numpy as np
import pytest
from support.cli_helpers import run

from jaxpar import config as C
from jaxpar.run.ckpt_clock import CALIBRATION_STEPS, MAX_INTERVAL, SAVE_SHARE, CheckpointClock

TINY = ["model=gpt2-tiny", "train.seq_len=32", "train.batch_size=4", "train.eval_every=0", "progress=none"]


def _steps(out) -> list[int]:
    return [json.loads(ln)["step"] for ln in open(out / "metrics.jsonl")]


def test_the_defaults_checkpoint_every_ten_minutes_and_keep_two():
    t = C.Config().train
    assert (t.ckpt_minutes, t.ckpt_every, t.keep_checkpoints) == (10.0, 0, 2)
    with pytest.raises(C.ConfigError, match=r"^train.keep_checkpoints=0 must be positive$"):
        C.resolve(["train.keep_checkpoints=0"])
    with pytest.raises(C.ConfigError, match=r"^train.ckpt_minutes=-1.0 must be >= 0$"):
        C.resolve(["train.ckpt_minutes=-1"])


def test_interval_from_step_time_then_stretched_by_the_save_time():
    clock = CheckpointClock(1.0, start=5)  # 60 s
    assert clock.calibration_step == 5 + CALIBRATION_STEPS == 15
    for _ in range(10):
        clock.observe(0.5)
    assert not clock.due(15) and clock.boundary(15)
    clock.at_boundary(15)
    assert clock.next_step == 15 + 120  # 60 s / 0.5 s
    assert not clock.boundary(134) and clock.due(135)
    for _ in range(120):
        clock.observe(1.0)
    clock.saved(135, 3.0)  # a 3 s save waits for 3 / 0.02 = 150 s of steps
    assert SAVE_SHARE == 0.02 and clock.next_step == 135 + 150
    clock.observe(1.0)
    clock.saved(285, 0.1)  # a quick save: back to 60 s
    assert clock.next_step == 285 + 60


def test_a_save_before_calibration_plans_nothing_and_zero_minutes_is_off():
    clock = CheckpointClock(1.0, start=0)
    clock.observe(0.5)
    clock.saved(3, 1.0)  # train.ckpt_every=3: no interval yet
    assert clock.next_step is None and not clock.due(10**6)
    off = CheckpointClock(0.0, start=0)
    off.observe(0.5)
    off.at_boundary(CALIBRATION_STEPS)
    off.saved(CALIBRATION_STEPS, 1.0)
    assert not any(off.boundary(n) for n in range(1000))


def test_every_process_takes_process_zeros_interval():
    told = []
    clock = CheckpointClock(1.0, start=0, agree=lambda v: told.append(v) or 7)
    clock.observe(2.0)
    clock.at_boundary(CALIBRATION_STEPS)
    assert told == [30] and clock.next_step == CALIBRATION_STEPS + 7


def test_a_save_at_the_calibration_step_keeps_its_step_time():
    """A stop at the calibration step saves right after the plan, with no step timed since: the
    interval still comes from the calibration's 0.5 s steps (it was 600 s / 1e-9 s = 6e11 steps,
    which overflowed the int32 broadcast of a two-process run)."""
    told = []
    clock = CheckpointClock(10.0, start=0, agree=lambda v: told.append(np.int32(v)) or v)
    for _ in range(CALIBRATION_STEPS):
        clock.observe(0.5)
    clock.at_boundary(CALIBRATION_STEPS)
    clock.saved(CALIBRATION_STEPS, 0.1)
    assert told == [1200, 1200] and clock.next_step == CALIBRATION_STEPS + 1200


def test_the_interval_fits_the_int32_broadcast():
    clock = CheckpointClock(10.0, start=0)
    assert clock.interval_steps(0.0) == MAX_INTERVAL == 2**31 - 1
    assert clock.interval_steps(1e-7) == MAX_INTERVAL
    assert clock.interval_steps(600.0) == 1


def test_a_run_killed_mid_way_resumes_from_its_timed_checkpoint(tmp_path):
    """No train.ckpt_every: the time-based checkpoint alone (0.3 s here instead of 10 minutes)
    leaves a step to resume from when the run is killed at step 50."""
    out = tmp_path / "run"
    args = [*TINY, "train.steps=56", "train.ckpt_minutes=0.005"]
    r = run(["train", *args, f"out={out}"], JAXPAR_FAULT_SIGNAL="SIGKILL@50")
    assert r.returncode == -9 and _steps(out) == list(range(1, 51))
    kept = sorted(int(n) for n in os.listdir(out / "ckpt") if n.isdigit())
    assert kept and CALIBRATION_STEPS < kept[-1] <= 50, kept
    r = run(["train", f"out={out}", "resume=true", "progress=plain"])
    assert r.returncode == 0, r.stderr
    assert f"resumed from step {kept[-1]}" in r.stdout and _steps(out) == list(range(1, 57))


def test_keep_checkpoints_keeps_that_many_newest_steps(tmp_path):
    out = tmp_path / "run"
    r = run(["train", *TINY, "train.steps=12", "train.ckpt_every=3", "train.keep_checkpoints=3", f"out={out}"])
    assert r.returncode == 0, r.stderr
    assert sorted(int(n) for n in os.listdir(out / "ckpt") if n.isdigit()) == [6, 9, 12]
