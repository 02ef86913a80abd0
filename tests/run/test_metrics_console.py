"""What `jaxpar train` prints per step (jaxpar.run.metrics.MetricsLogger, no JAX): progress=plain prints
every train.log_every-th step and always the last one; progress=none prints nothing at all.

Reference: the lines written down by hand from the records logged."""

from __future__ import annotations

import json

from jaxpar.run.metrics import MetricsLogger


def _rec(step: int) -> dict:
    return {"step": step, "loss": 2.0 / step, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_s": 1000.0 * step,
            "step_time_s": 0.5, "mfu": 0.25}


def _line(step: int, total: int, eta: str = "") -> str:
    return (f"step {step:>6}/{total} | loss {2.0 / step:.4f} | {1000 * step:,} tok/s | 500.0 ms | mfu 25.00%"
            + (f" | eta {eta}" if eta else ""))


def test_plain_prints_every_log_every_th_step_and_the_last(tmp_path, capsys):
    m = MetricsLogger(str(tmp_path), 5, 0, "plain", print_every=2)
    for s in range(1, 6):
        m.log(_rec(s))
    m.message("done")
    m.close()
    # ETA: 0.5 s per step times the steps left (3, then 1), rounded up; none on the last step
    assert capsys.readouterr().out.splitlines() == [_line(2, 5, "2s"), _line(4, 5, "1s"), _line(5, 5), "done"]
    assert [json.loads(ln)["step"] for ln in open(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 5]


def test_none_prints_nothing_but_writes_the_metrics(tmp_path, capsys):
    m = MetricsLogger(str(tmp_path), 2, 0, "none")
    m.log(_rec(1))
    m.log(_rec(2))
    m.message("resumed from step 0")
    m.close()
    assert capsys.readouterr().out == ""
    assert [json.loads(ln)["step"] for ln in open(tmp_path / "metrics.jsonl")] == [1, 2]


def test_without_a_known_peak_the_line_shows_flops_and_no_percentage(tmp_path, capsys):
    m = MetricsLogger(str(tmp_path), 3, 0, "plain")
    for step, flops in ((1, 4.21e10), (2, 1.5e12), (3, 999.0)):
        rec = {k: v for k, v in _rec(step).items() if k != "mfu"}
        m.log({**rec, "flops_per_s": flops})
    m.close()
    tail = [ln.split(" ms | ")[1].split(" | eta")[0] for ln in capsys.readouterr().out.splitlines()]
    assert tail == ["42.1 GFLOP/s", "1.5 TFLOP/s", "999 FLOP/s"]
    assert [json.loads(ln).get("mfu") for ln in open(tmp_path / "metrics.jsonl")] == [None, None, None]


def test_eta_is_the_median_step_time_times_the_steps_left(tmp_path, capsys):
    """A slow first step (compilation) does not skew it: median of 9.0, 0.5, 0.5 is 0.5."""
    from jaxpar.run.metrics import eta_text

    m = MetricsLogger(str(tmp_path), 1003, 0, "plain")
    for step, t in ((1, 9.0), (2, 0.5), (3, 0.5)):
        m.log({**_rec(step), "step_time_s": t})
    m.close()
    assert capsys.readouterr().out.splitlines()[2].endswith(" | eta 8m20s")  # 1000 steps x 0.5 s
    assert [eta_text(x) for x in (0.01, 59.0, 59.5, 60.0, 3599.2, 3600.0, 7620.0)] == [
        "1s", "59s", "1m00s", "1m00s", "1h00m", "1h00m", "2h07m"]
