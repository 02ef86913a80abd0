"""torchref's out dir (issue 13, case 11): a finished run or a foreign dir is refused, never
overwritten; an unfinished run's leftovers may be run over. In-process, no training.
Independent reference: the files on disk and hand-written messages."""

from __future__ import annotations

from pathlib import Path

import pytest

from jaxpar.config import ConfigError
from torchref.launch import check_out


def test_finished_run_is_refused_and_left_alone(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "summary.json").write_text("{}")
    with pytest.raises(ConfigError) as e:
        check_out(tmp_path)
    assert str(e.value) == f"out={str(tmp_path)!r} holds a finished torchref run (summary.json); choose another out"
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_foreign_dir_is_refused_unfinished_run_is_accepted(tmp_path):
    for name in ("metrics.jsonl", "job.json", "config.json"):
        (tmp_path / name).write_text("{}")
    for name in ("procs", "logs", "data"):
        (tmp_path / name).mkdir()
    (tmp_path / "grads_step1.safetensors").write_bytes(b"")
    check_out(tmp_path)  # a crashed run: no summary.json
    (tmp_path / "ckpt").mkdir()  # e.g. a jaxpar run dir
    with pytest.raises(ConfigError) as e:
        check_out(tmp_path)
    assert str(e.value) == (f"out={str(tmp_path)!r} is not empty and not a torchref run dir (holds ckpt); "
                            "choose another out")
    check_out(Path(tmp_path / "new" / "run"))  # missing dirs are fine


def test_a_run_over_an_unfinished_runs_leftovers_starts_clean(tmp_path):
    """`prepare` (everything before the ranks start) removes what a crashed attempt left: the
    metrics are appended to by the new run's writer, so a stale line would become its step 1."""
    from torchref.config import resolve_ref
    from torchref.launch import prepare

    out = tmp_path / "run"
    (out / "procs").mkdir(parents=True)
    (out / "procs" / "rank0.json").write_text("{}")
    (out / "logs").mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 9.5}\n')
    (out / "grads_step1.safetensors").write_bytes(b"")
    (tmp_path / "text.txt").write_text("some text to train on. " * 100)
    cfg, ref = resolve_ref(["model=gpt2-tiny", "model.n_layer=1", "model.n_embd=32", "model.n_head=2",
                            "train.seq_len=16", f"data={tmp_path / 'text.txt'}", f"out={out}", "strategy=single"])
    prepare(cfg, ref)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "data", "init", "job.json"]
