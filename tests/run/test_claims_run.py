"""Claims of `jaxpar train` checked with numbers, in this process (one CPU device, gpt2-tiny):

* dropout > 0 is deterministic across runs and a SIGINT-stopped run resumes bit-exactly, which
  needs the state's step restored (the dropout key is `fold_in(seed, step)`);
* `val_loss` equals HF transformers' loss on the same weights and validation batches;
* `progress=bar` draws the bar with the step count and the last loss.

Three short runs (`run_train`, fp32, 6 steps of 4x32 tokens) share one prepared corpus.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal

import numpy as np
import pytest

from gpt2common import data as data_lib
from jaxpar.config import resolve
from jaxpar.run import loop

pytest.importorskip("torch")
pytest.importorskip("transformers")
from support.claims_helpers import hf_mean_nll, hf_model, xla_cache  # noqa: E402

STEPS, STOP_AT = 6, 3
ARGS = ["model=gpt2-tiny", "model.dropout=0.1", "precision=fp32", f"train.steps={STEPS}", "train.seq_len=32",
        "train.batch_size=4", "train.lr=3e-3", "train.warmup_steps=2", f"train.eval_every={STEPS}",
        "train.eval_batches=2", "device_peak_flops=1e12"]


def records(out) -> list[dict]:
    return [json.loads(ln) for ln in open(os.path.join(out, "metrics.jsonl"))]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{"ref": (out, stdout) of the uninterrupted run (progress=bar),
    "stopped": (out, stdout, resume stdout, metrics lines when stopped) of the run that a SIGINT
    stops after step 3 and `resume=true` continues}. The three compile one step (XLA cache)."""
    root = tmp_path_factory.mktemp("claims_run")
    prepared = str(root / "data")
    data_lib.prepare(data_lib.builtin_text()[:100_000], prepared, "byte", source="tinyshakespeare[:100000]")

    handlers = []  # (SIGINT, SIGTERM) handlers before and after each run

    def train(name, *extra):
        buf = io.StringIO()
        before = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
        with contextlib.redirect_stdout(buf):
            rc = loop.run_train(resolve([*ARGS, f"data={prepared}", f"out={root / name}", *extra]))
        handlers.append((before, (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))))
        assert rc == 0
        return buf.getvalue()

    # A real SIGINT to this process, sent from inside step 3's metrics write: the handler of
    # `jaxpar train` must let step 3 finish, checkpoint it and return 0.
    log = loop.MetricsLogger.log

    def log_then_interrupt(self, rec):
        log(self, rec)
        if rec["step"] == STOP_AT:
            os.kill(os.getpid(), signal.SIGINT)

    mp = pytest.MonkeyPatch()
    with xla_cache(root / "xla"):
        ref = (root / "ref", train("ref", "progress=bar"))
        mp.setattr(loop.MetricsLogger, "log", log_then_interrupt)
        try:
            first = train("stopped", "progress=plain")
        except KeyboardInterrupt:  # no handler: a failed test, not an interrupted pytest run
            pytest.fail("jaxpar train did not handle SIGINT (KeyboardInterrupt reached the caller)")
        finally:
            mp.undo()
        lines = len(records(root / "stopped"))
        resumed = train("stopped", "progress=plain", "resume=true")
        step1 = {s: step_one_loss(prepared, s) for s in (0, 1)}  # the run's step (cached compile)
    return {"ref": ref, "stopped": (root / "stopped", first, resumed, lines), "data": prepared, "step1": step1,
            "handlers": handlers}


def test_the_callers_signal_handlers_are_back_after_each_run(runs):
    """run_train handles SIGINT/SIGTERM only while it runs: a program that trains in-process (a
    notebook, a sweep) gets its own Ctrl-C back, also after a run that a SIGINT stopped."""
    assert len(runs["handlers"]) == 3
    for before, after in runs["handlers"]:
        assert after == before


def step_one_loss(prepared: str, step_count: int) -> float:
    """Loss of the train step on the initial weights and step 1's batch, with the state's step
    counter set to `step_count` (it selects the dropout key)."""
    import jax
    import jax.numpy as jnp

    from jaxpar.models import gpt2
    from jaxpar.parallel.layout import build_layout
    from jaxpar.train import build_trainer

    cfg = resolve([*ARGS, f"data={prepared}"])
    tr = build_trainer(build_layout(cfg, jax.device_count()))
    state = tr.init_state(gpt2.init_params(cfg.model, cfg.seed))
    state["step"] = jax.device_put(jnp.int32(step_count), tr.state_shardings["step"])
    x, y = data_lib.train_batch(data_lib.Dataset.open(prepared, 256, 32), 32, 4, cfg.seed, 0)
    return float(tr.step_fn(state, tr.put_batch(x), tr.put_batch(y))[1]["loss"])


def test_sigint_stops_at_step_boundary_with_checkpoint(runs):
    """Reference: hand count (the signal is sent while step 3's metrics are written; the loop is
    asynchronous, so step 4 is already in flight: the run finishes step 4 and stops there)."""
    out, first, _, lines = runs["stopped"]
    stopped = STOP_AT + 1
    assert lines == stopped
    assert f"stopped by SIGINT after step {stopped}; checkpoint saved to {out}/ckpt/{stopped}" in first
    assert sorted(os.listdir(out / "ckpt")) == [str(stopped), str(STEPS)]


def test_dropout_resume_is_bit_exact_and_restores_the_step(runs):
    """Reference: the uninterrupted run. With dropout 0.1 the masks of step s come from
    fold_in(seed, state.step), so a resume that restored step 0 would redraw step 1's masks."""
    ref, stopped = records(runs["ref"][0]), records(runs["stopped"][0])
    assert f"resumed from step {STOP_AT + 1}" in runs["stopped"][2]
    assert [r["step"] for r in stopped] == list(range(1, STEPS + 1))
    for key in ("loss", "grad_norm", "lr"):
        assert [r[key] for r in stopped] == [r[key] for r in ref], key  # bit-identical floats
    assert stopped[-1]["val_loss"] == ref[-1]["val_loss"]


def test_dropout_is_active_and_deterministic(runs):
    """Reference: HF transformers (eval mode: no dropout) on the initial weights and step 1's batch,
    and the closed form of inverted dropout (keep 0.9, scale 1/0.9). Determinism: the stopped
    run's first 3 steps are an independent fresh run of the same config, and the train step
    recomputed outside the loop."""
    import jax
    import jax.numpy as jnp

    from jaxpar.models import gpt2

    ref, stopped = records(runs["ref"][0]), records(runs["stopped"][0])
    assert [r["loss"] for r in stopped[:STOP_AT]] == [r["loss"] for r in ref[:STOP_AT]]
    # the masks follow the state's step: same weights and batch, step counter 0 (= the run's
    # step 1, bit for bit) vs 1 (other masks: another loss)
    assert runs["step1"][0] == ref[0]["loss"]
    assert abs(runs["step1"][1] - runs["step1"][0]) > 1e-4, runs["step1"]
    cfg = resolve(ARGS)
    ds = data_lib.Dataset.open(runs["data"], 256, 32)
    no_dropout = hf_mean_nll(hf_model(cfg.model, gpt2.init_params(cfg.model, cfg.seed)),
                             [data_lib.train_batch(ds, 32, 4, cfg.seed, 0)])
    # fp32 jaxpar == HF to ~1e-6 without dropout (test_model.py); dropout 0.1 moves the loss by more
    assert abs(ref[0]["loss"] - no_dropout) > 1e-3, (ref[0]["loss"], no_dropout)
    # Inverted dropout on 10^6 ones: a fraction 0.1 zeroed (binomial sd 3e-4), the rest 1/0.9.
    d = np.asarray(gpt2._dropout(jnp.ones((1000, 1000)), 0.1, jax.random.PRNGKey(1)))
    assert abs((d == 0).mean() - 0.1) < 5 * (0.1 * 0.9 / d.size) ** 0.5
    assert np.all((d == 0) | (np.abs(d - 1 / 0.9) < 1e-6))


def test_val_loss_equals_hf_transformers_on_the_same_weights(runs):
    """Reference: HF transformers GPT2LMHeadModel (eval mode, fp32) on the final checkpoint's
    weights and the run's validation batches (`data.val_batch`, indices 0..eval_batches-1)."""
    from jaxpar.run.commands import load_model

    out = runs["ref"][0]
    cfg, params = load_model(str(out))
    ds = data_lib.Dataset.open(runs["data"], 256, 32)
    want = hf_mean_nll(hf_model(cfg.model, params),
                       [data_lib.val_batch(ds, 32, 4, cfg.seed, i) for i in range(cfg.train.eval_batches)])
    got = records(out)[-1]["val_loss"]
    # fp32 both sides: logits agree within MODEL.logits_abs = 1e-5 (parity_tests/tolerances.py),
    # so a token's NLL moves by < 2e-5 absolute; relative to a loss of ~3 that is < 1e-5
    assert abs(got - want) <= 1e-5 * want, (got, want)
    # the validation batches are not the training ones: the last train loss is a different number
    assert abs(records(out)[-1]["loss"] - want) > 1e-3


def test_progress_bar_shows_steps_and_last_loss(runs):
    """Reference: the run's own metrics.jsonl (step count and last loss, formatted by hand)."""
    _, stdout = runs["ref"]
    last = records(runs["ref"][0])[-1]
    assert f"{STEPS}/{STEPS}" in stdout
    assert f"loss {last['loss']:.4f}" in stdout and f"val {last['val_loss']:.4f}" in stdout
    assert "step      6/6 |" not in stdout  # the bar replaces the plain per-step lines


def test_mfu_counts_the_palm_flops_against_the_given_peak(runs):
    """README (Output): MFU counts 6N + 12·L·H·Q·T FLOPs per token against the device peak
    (`device_peak_flops=1e12` here, one device). Reference, by hand for gpt2-tiny at T = 32:
    N = 256·128 (wte) + 2·(12·128² + 13·128) + 2·128 (ln_f) = 428,800 (wpe not counted)."""
    n = 256 * 128 + 2 * (12 * 128 * 128 + 13 * 128) + 2 * 128
    flops_per_token = 6 * n + 12 * 2 * 4 * 32 * 32
    for rec in records(runs["ref"][0]):
        assert rec["mfu"] == pytest.approx(flops_per_token * rec["tokens_per_s"] / 1e12, rel=1e-12), rec
