"""`jaxpar plan sweep=` where no device count has a plan: one line, exit 2,
nothing written (it was matplotlib's ValueError on an empty plot). In-process, ~0.1 s."""

from __future__ import annotations

from jaxpar.planner import cli


def test_a_sweep_with_no_fitting_count_is_one_line_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "p" / "plan.json"
    assert cli.main(["model=gpt2", "devices=8", "memory_limit=2GB", "sweep=1", f"out={out}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: sweep=1: no device count has a plan (devices=1: no plan fits memory_limit=1.86 "
                          "GiB on 1 × h100: the smallest per-device memory any plan needs is 2.07 GiB") and \
        err.count("\n") == 1
    assert not (tmp_path / "p").exists()
