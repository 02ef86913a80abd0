"""tensor.sequence_parallel=true through `jaxpar train`: data=2 × tensor=4 on 8 emulated devices;
train, resume and evaluate equal one device (tests/support/schedules_cli.py)."""

from __future__ import annotations

from support.schedules_cli import train_resume_eval_matches_single_device


def test_sequence_parallel_train_resume_eval_match_single_device(tmp_path):
    train_resume_eval_matches_single_device(tmp_path, ["mesh.data=2", "mesh.tensor=4", "tensor.sequence_parallel=true"])
