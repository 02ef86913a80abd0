"""`jaxpar train` end to end on the built-in corpus: learning, resume, metrics, sample, eval."""

import json
import os

import numpy as np
import pytest
from support.cli_helpers import run

from gpt2common.model import PRESETS

TINY = ["model=gpt2-tiny", "train.seq_len=64", "train.batch_size=16", "train.lr=3e-3", "train.warmup_steps=10",
        "train.eval_every=0", "progress=plain"]


def losses(run_dir):
    return [json.loads(ln)["loss"] for ln in open(run_dir / "metrics.jsonl")]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """100 steps of gpt2-tiny on the built-in corpus (shared by the tests below)."""
    out = tmp_path_factory.mktemp("run") / "tiny"
    r = run(["train", *TINY, "train.steps=100", "train.eval_every=50", "train.eval_batches=4", f"out={out}"])
    assert r.returncode == 0, r.stderr
    return out, r


def test_loss_falls_30_percent_in_100_steps(trained):
    out, r = trained
    ls = losses(out)
    assert len(ls) == 100
    assert ls[-1] <= 0.7 * ls[0], (ls[0], ls[-1])
    recs = [json.loads(ln) for ln in open(out / "metrics.jsonl")]
    assert [r["step"] for r in recs] == list(range(1, 101))
    flops_per_token = PRESETS["gpt2-tiny"].flops_per_token(64)
    for rec in recs:
        # a CPU has no known peak (and no device_peak_flops= was given): FLOP/s, no MFU
        assert {"step", "loss", "tokens_per_s", "step_time_s", "flops_per_s"} <= rec.keys() and "mfu" not in rec
        assert rec["tokens_per_s"] > 0 and rec["step_time_s"] > 0
        assert abs(rec["tokens_per_s"] * rec["step_time_s"] - 16 * 64) < 1e-6 * 16 * 64
        assert rec["flops_per_s"] == pytest.approx(flops_per_token * rec["tokens_per_s"], rel=1e-12)
    assert [r["step"] for r in recs if "val_loss" in r] == [50, 100]


def test_run_dir_contents(trained):
    out, r = trained
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model"]["n_layer"] == 2 and cfg["train"]["steps"] == 100 and cfg["precision"] == "bf16"
    assert "config: " in r.stdout and "step    100/100" in r.stdout
    meta = json.loads((out / "data" / "meta.json").read_text())
    assert meta["tokenizer"] == "byte" and meta["vocab_size"] == 256 and meta["source"] == "tinyshakespeare"
    assert meta["train_tokens"] + meta["val_tokens"] == 1_115_394
    assert (out / "ckpt" / "100").is_dir()


def test_eval_checkpoint_matches_contract(trained, tmp_path):
    """Reference: HF transformers on the checkpoint's weights over windows k*64..k*64+64 of
    val.bin, k = 0..4 (the README's `jaxpar eval` contract), computed here by hand; then the same number
    from a raw .bin and another batching. Without data= eval reads the run's own prepared data
    (out/data, where the built-in corpus was tokenized)."""
    from support.claims_helpers import hf_mean_nll, hf_model

    from gpt2common.data import load_tokens
    from jaxpar.run.commands import load_model

    out, _ = trained
    r = run(["eval", f"checkpoint={out}", "eval.windows=5", "train.batch_size=2"])
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["tokens"] == 5 * 64
    cfg, params = load_model(str(out))
    val = np.asarray(load_tokens(str(out / "data" / "val.bin")), np.int64)
    windows = [(val[k * 64:k * 64 + 64][None], val[k * 64 + 1:k * 64 + 65][None]) for k in range(5)]
    want = hf_mean_nll(hf_model(cfg.model, params), windows)
    assert abs(res["loss"] - want) <= 1e-5 * want, (res["loss"], want)
    assert abs(res["perplexity"] - np.exp(res["loss"])) < 1e-9 * res["perplexity"]
    # Same windows, batched differently and from a raw .bin file: the same mean loss. A batch far
    # larger than the 5 windows is cut to them (it padded them to 100000 rows: 6.5 GB of logits).
    r2 = run(["eval", f"checkpoint={out}", f"data={out / 'data' / 'val.bin'}", "eval.windows=5",
              "train.batch_size=100000"])
    assert r2.returncode == 0, r2.stderr
    assert abs(json.loads(r2.stdout)["loss"] - res["loss"]) < 1e-5


def test_eval_without_data_names_what_it_looked_for(tmp_path):
    """A run dir with no out/data and a config naming raw text (not a prepared dir): one line."""
    from jaxpar.config import Config, ConfigError, dumps
    from jaxpar.run.commands import _run_data

    (tmp_path / "config.json").write_text(dumps(Config(data=str(tmp_path / "text.txt"))))
    with pytest.raises(ConfigError) as e:
        _run_data(str(tmp_path))
    assert str(e.value) == f"eval needs data=<prepared dir | .bin file> (checkpoint={str(tmp_path)!r} holds no prepared data)"
    prepared = tmp_path / "prep"
    prepared.mkdir()
    (prepared / "meta.json").write_text("{}")
    (prepared / "train.bin").write_bytes(b"")
    (tmp_path / "config.json").write_text(dumps(Config(data=str(prepared))))
    assert _run_data(str(tmp_path)) == str(prepared)


def test_sample_is_deterministic(trained):
    out, _ = trained
    args = ["sample", f"checkpoint={out}", "prompt=ROMEO:", "max_new_tokens=40", "seed=3"]
    a, b = run(args), run(args)
    assert a.returncode == 0, a.stderr
    assert a.stdout == b.stdout and a.stdout.startswith("ROMEO:") and len(a.stdout) >= 40


def test_plot_writes_png(trained):
    out, _ = trained
    r = run(["plot", f"run={out}"])
    assert r.returncode == 0, r.stderr
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_readers_work_on_a_held_run(trained):
    """eval, sample, plot and convert checkpoint= never look at the lock a running run holds on
    its out (here this process holds it): only writers are refused."""
    from gpt2common.outdir import hold

    out, _ = trained
    lock = hold(str(out))
    try:
        r = run(["eval", f"checkpoint={out}", f"data={out / 'data'}", "eval.windows=1"])
        assert r.returncode == 0 and json.loads(r.stdout)["tokens"] == 64, r.stderr
        r = run(["train", *TINY, "resume=true", f"out={out}"])
        assert r.returncode == 2 and f"(pid {os.getpid()})" in r.stderr
    finally:
        lock.release()


# The interrupted runs below: a checkpoint every 5 steps, and two micro-batches per step (their
# accumulation holds no state across steps, which resume relies on)
INTERRUPTED = [*TINY, "train.steps=20", "train.grad_accum=2", "train.ckpt_every=5"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference of the interrupted runs: INTERRUPTED from start to end, without a signal."""
    ref = tmp_path_factory.mktemp("ref") / "run"
    r = run(["train", *INTERRUPTED, f"out={ref}"])
    assert r.returncode == 0, r.stderr
    return ref


def _interrupt(tmp_path, fault):
    """INTERRUPTED with `JAXPAR_FAULT_SIGNAL=fault` (e.g. SIGTERM@5: the run signals itself once
    step 5's metrics are written). A signal at an exact step, not one sent when a poll happens
    to see the file: no race with a loaded host finishing the run first."""
    out = tmp_path / "killed"
    return out, run(["train", *INTERRUPTED, f"out={out}"], JAXPAR_FAULT_SIGNAL=fault)


def _resume(out):
    r = run(["train", *INTERRUPTED, f"out={out}", "resume=true"])
    assert r.returncode == 0, r.stderr
    return r


def test_sigterm_then_resume_is_bit_identical(tmp_path, uninterrupted):
    out, r = _interrupt(tmp_path, "SIGTERM@7")
    assert r.returncode == 0, r.stderr
    # Step 7's metrics are read (and the signal sent) while step 8 is in flight: the run finishes
    # step 8, checkpoints it and stops (between the periodic checkpoints at 5 and 10).
    assert "stopped by SIGTERM after step 8" in r.stdout
    assert len(losses(out)) == 8
    r = _resume(out)
    assert "resumed from step 8" in r.stdout
    assert losses(out) == losses(uninterrupted)  # bit-identical floats


def test_sigkill_resumes_from_last_complete_checkpoint(tmp_path, uninterrupted):
    out, r = _interrupt(tmp_path, "SIGKILL@12")
    assert r.returncode == -9 and len(losses(out)) == 12
    r = _resume(out)
    assert "resumed from step 10" in r.stdout
    assert losses(out) == losses(uninterrupted)


def test_inspect_compiles_the_model_of_init(tmp_path):
    """`jaxpar inspect init=DIR` (and `train dry_run=true`) reports the model train would build,
    the HF dir's shape; it compiled the preset's instead and took a missing dir without a word."""
    import dataclasses

    from gpt2common import hf
    from jaxpar.models import gpt2

    mc = dataclasses.replace(PRESETS["gpt2-tiny"], n_layer=1, n_embd=48, n_head=3)
    hf.save_hf(str(tmp_path / "hf"), mc, gpt2.init_params(mc, 0))
    r = run(["inspect", f"init={tmp_path / 'hf'}", "train.seq_len=16", "train.batch_size=2"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith(f"inspect: hf:{tmp_path / 'hf'} ({mc.num_params():,} params), mesh "), r.stdout[:300]
    r = run(["inspect", f"init={tmp_path / 'none'}"])
    assert (r.returncode, r.stderr) == (2, f"error: init='{tmp_path / 'none'}' is not an HF save_pretrained dir "
                                           "(no config.json)\n")
