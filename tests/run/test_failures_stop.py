"""A run ends well whatever its surroundings do while it trains: a SIGTERM/SIGINT that lands
while a periodic checkpoint is written (one complete checkpoint, exit 0, never the step saved
twice), and a reader of its stdout that goes away (`jaxpar train ... | head`: the run finishes
and checkpoints, its progress goes nowhere).

Independent reference: step numbers and file names written down by hand."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
from support.cli_helpers import clean_env, run

TINY = ["model=gpt2-tiny", "train.seq_len=16", "train.batch_size=2", "train.eval_every=0", "progress=plain",
        "train.log_every=1"]


def steps(out) -> list[int]:
    return [json.loads(ln)["step"] for ln in open(out / "metrics.jsonl")]


def test_a_signal_during_a_periodic_checkpoint_saves_it_once(tmp_path):
    """SIGTERM@2: the flag is set once step 2's metrics are written, just before step 2's
    periodic save; the stop path then finds step 2 saved and exits 0 without saving it again."""
    out = tmp_path / "run"
    r = run(["train", *TINY, "train.steps=6", "train.ckpt_every=2", f"out={out}"], JAXPAR_FAULT_SIGNAL="SIGTERM@2")
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    assert r.stdout.strip().splitlines()[-1] == (f"stopped by SIGTERM after step 2; checkpoint saved to "
                                                 f"{out / 'ckpt' / '2'}; continue with resume=true")
    assert steps(out) == [1, 2] and os.listdir(out / "ckpt") == ["2"]
    assert {"params", "opt_state", "meta"} <= set(os.listdir(out / "ckpt" / "2"))


def test_a_closed_stdout_never_stops_training(tmp_path):
    """The reader takes the first line and closes the pipe, as `| head -1` does."""
    out = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-m", "jaxpar.cli", "train", *TINY, "train.steps=6", "train.ckpt_every=2",
                          f"out={out}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=clean_env())
    assert p.stdout.readline().startswith(b"jaxpar train: gpt2-tiny")
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=300) == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err
    assert steps(out) == [1, 2, 3, 4, 5, 6] and sorted(os.listdir(out / "ckpt")) == ["4", "6"]


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(10))
def test_a_signal_at_a_random_moment_leaves_one_complete_checkpoint(tmp_path, seed):
    """SIGTERM or SIGINT at a random moment of a run that checkpoints every step (most of its
    time is spent saving): exit 0, the step it names is the newest checkpoint, complete."""
    rng = random.Random(seed)
    out = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-m", "jaxpar.cli", "train", *TINY, "train.steps=100000", "train.ckpt_every=1",
                          f"out={out}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env())
    metrics = out / "metrics.jsonl"
    while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
        assert p.poll() is None, p.communicate()[1][-2000:]
        time.sleep(0.05)
    time.sleep(rng.uniform(0, 1.5))
    p.send_signal(rng.choice([signal.SIGTERM, signal.SIGINT]))
    so, se = p.communicate(timeout=300)
    assert p.returncode == 0 and "Traceback" not in se, se
    last = so.strip().splitlines()[-1]
    assert last.startswith("stopped by SIG"), last  # 10^5 steps: the signal always finds it training
    k = int(last.split(" after step ")[1].split(";")[0])
    assert steps(out) == list(range(1, k + 1))
    assert max(int(n) for n in os.listdir(out / "ckpt") if n.isdigit()) == k
    assert {"params", "opt_state", "meta"} <= set(os.listdir(out / "ckpt" / str(k)))


# Ctrl-C's SIGINT must reach the run as it does from a terminal: a suite started in the background of
# a non-interactive shell (`python -m pytest ... &` in a script) gives every process it starts SIGINT
# ignored (POSIX), Python keeps it ignored, the CLI rightly notes nothing, the kill below is dropped
# and the run went on to step 5. So the script takes Python's own handler first, as a terminal's run has.
LOST_INTERRUPT = """
import gc, os, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
from jaxpar import cli
from jaxpar.run import loop

real = loop.prepare_config


def prepare(cfg):  # a Ctrl-C that lands while a gc callback runs, as JAX's _xla_gc_callback does
    fired = []

    def callback(phase, info):
        if not fired:
            fired.append(1)
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):  # the handler runs here, inside the callback: its exception is lost
                pass

    gc.callbacks.append(callback)
    try:
        gc.collect()
    finally:
        gc.callbacks.remove(callback)
    return real(cfg)


loop.prepare_config = prepare
sys.exit(cli.main(sys.argv[1:]))
"""


def test_a_ctrl_c_lost_in_a_gc_callback_still_stops_the_run(tmp_path):
    """A SIGINT whose KeyboardInterrupt is raised inside a gc callback is printed as "Exception
    ignored" and swallowed: the run went on to its last step (5 of 5). The CLI's handler notes the
    signal, so the run stops at its first boundary with a checkpoint, and no traceback is shown."""
    out = tmp_path / "r"
    r = subprocess.run([sys.executable, "-c", LOST_INTERRUPT, "train", *TINY, "train.steps=5", f"out={out}"],
                       capture_output=True, text=True, timeout=300, env=clean_env())
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stderr == ""
    assert r.stdout.splitlines()[-1] == f"stopped by SIGINT after step 0; checkpoint saved to {out}/ckpt/0; " \
                                        "continue with resume=true"
    assert sorted(os.listdir(out / "ckpt")) == ["0"]


def test_the_cli_gives_back_sigint_and_the_unraisable_hook(capsys):
    """cli.main installs its noting SIGINT handler and quiet unraisable hook for one command only:
    a program that calls it in-process gets its own back, after a refused command too."""
    from jaxpar import cli

    before = (signal.getsignal(signal.SIGINT), sys.unraisablehook)
    assert cli.main(["train", "train.steps=x"]) == 2
    assert capsys.readouterr().err == "error: train.steps='x' is not an integer\n"
    assert (signal.getsignal(signal.SIGINT), sys.unraisablehook) == before
