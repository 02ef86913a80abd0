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
