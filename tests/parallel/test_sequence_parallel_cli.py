"""tensor.sequence_parallel=true through `jaxpar train`: data=2 × tensor=4 on 8 emulated devices;
training and its evaluation equal one device (tests/support/schedules_cli.py). One run, no resume:
sequence parallelism changes activation shardings only, so its checkpoint is the tensor-parallel
one, whose stop and resume tests/parallel/test_pipeline_interleaved.py proves (data × tensor × pipe)."""

from __future__ import annotations

from support.schedules_cli import train_resume_eval_matches_single_device


def test_sequence_parallel_train_and_eval_match_single_device(tmp_path):
    train_resume_eval_matches_single_device(tmp_path, ["mesh.data=2", "mesh.tensor=4", "tensor.sequence_parallel=true"],
                                            resume=False)
