"""Weights & Biases logging (`log.wandb=true`): one run id per run dir, continued on resume.

The curve content is checked in-process against a recording stand-in for the `wandb` module (the
offline run file is W&B's own binary log, read only by `wandb sync`); one real offline run shows
that W&B itself writes under out/wandb without a network and reuses the id on resume."""

import importlib.machinery
import importlib.util
import os
import re
import subprocess
import sys
import types

import pytest

from jaxpar.config import Config, ConfigError, LogConfig, validate
from jaxpar.run import metrics
from jaxpar.run.metrics import MetricsLogger, start_wandb


class _Run:
    def __init__(self, calls, **kw):
        self.calls, self.kw = calls, kw
        calls.append(("init", kw))

    def define_metric(self, name, step_metric=None):
        self.calls.append(("define_metric", name, step_metric))

    def log(self, rec):
        self.calls.append(("log", rec))

    def finish(self):
        self.calls.append(("finish",))


@pytest.fixture
def fake_wandb(monkeypatch):
    calls = []
    mod = types.ModuleType("wandb")
    mod.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    mod.init = lambda **kw: _Run(calls, **kw)
    mod.Settings = lambda **kw: kw
    monkeypatch.setitem(sys.modules, "wandb", mod)
    return calls


def _rec(step, loss):
    return {"step": step, "loss": loss, "tokens_per_s": 8.0, "step_time_s": 0.5, "flops_per_s": 4.0,
            "note": "not a number"}


def _run(out, start, steps, calls, loss0):
    run = start_wandb(str(out), LogConfig(wandb=True, wandb_project="p"), start, {"seed": 3})
    m = MetricsLogger(str(out), 4, start, "none", wandb_run=run)
    for s in steps:
        m.log(_rec(s, loss0 + s))
    m.close()


def test_resume_continues_the_same_run_and_plots_against_the_logged_step(tmp_path, fake_wandb):
    _run(tmp_path, 0, (1, 2, 3), fake_wandb, 10.0)
    first_id = (tmp_path / metrics.WANDB_ID_FILE).read_text().strip()
    _run(tmp_path, 2, (3, 4), fake_wandb, 20.0)  # resumed from the checkpoint at step 2
    inits = [c[1] for c in fake_wandb if c[0] == "init"]
    assert [i["id"] for i in inits] == [first_id, first_id] and len(first_id) == 8
    assert all(i["resume"] == "allow" and i["dir"] == str(tmp_path) and i["mode"] == "offline"
               and i["project"] == "p" and i["config"] == {"seed": 3} for i in inits)
    # `step` is every metric's x axis, so step 3 of the resumed run lands on step 3's point
    assert fake_wandb.count(("define_metric", "*", "step")) == 2
    logged = [c[1] for c in fake_wandb if c[0] == "log"]
    assert [(r["step"], r["loss"]) for r in logged] == [(1, 11.0), (2, 12.0), (3, 13.0), (3, 23.0), (4, 24.0)]
    assert all(set(r) == {"step", "loss", "tokens_per_s", "step_time_s", "flops_per_s"} for r in logged)
    assert [c[0] for c in fake_wandb].count("finish") == 2


def test_a_fresh_run_in_a_used_dir_gets_a_new_id(tmp_path, fake_wandb):
    _run(tmp_path, 0, (1,), fake_wandb, 0.0)
    _run(tmp_path, 0, (1,), fake_wandb, 0.0)
    a, b = [c[1]["id"] for c in fake_wandb if c[0] == "init"]
    assert a != b and (tmp_path / metrics.WANDB_ID_FILE).read_text().strip() == b


def test_wandb_settings_are_checked_before_anything_runs(monkeypatch):
    with pytest.raises(ConfigError, match=r"^log\.wandb_mode='cloud' must be offline or online$"):
        validate(Config(log=LogConfig(wandb_mode="cloud")))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)  # wandb not installed
    with pytest.raises(ConfigError, match=r"^log\.wandb=true needs the wandb package: pip install -e '\.\[wandb\]'$"):
        validate(Config(log=LogConfig(wandb=True)))


REAL = """
import sys
from jaxpar.config import LogConfig
from jaxpar.run.metrics import MetricsLogger, start_wandb
for start in (0, 1):
    run = start_wandb(sys.argv[1], LogConfig(wandb=True), start, {})
    m = MetricsLogger(sys.argv[1], 2, start, "none", wandb_run=run)
    m.log({"step": start + 1, "loss": 1.0, "tokens_per_s": 1.0, "step_time_s": 1.0, "flops_per_s": 1.0})
    m.close()
"""


def test_real_offline_run_writes_under_out_and_reuses_its_id(tmp_path):
    pytest.importorskip("wandb", reason="needs the [dev] extra (wandb)")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run([sys.executable, "-c", REAL, str(tmp_path)], capture_output=True, text=True, timeout=180,
                       env=env)
    assert r.returncode == 0, r.stderr
    run_id = (tmp_path / metrics.WANDB_ID_FILE).read_text().strip()
    runs = sorted(p.name for p in (tmp_path / "wandb").glob("offline-run-*"))
    # offline-run-<time>-<id>; wandb adds "-1" to the second when both start within one second
    assert len(runs) == 2 and all(re.fullmatch(rf"offline-run-\d{{8}}_\d{{6}}-{run_id}(-\d+)?", n) for n in runs), runs
    assert all((tmp_path / "wandb" / name / f"run-{run_id}.wandb").stat().st_size > 0 for name in runs)
