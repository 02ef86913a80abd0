"""pipeline.schedule=interleaved (Megatron's virtual stages run by jaxpar/parallel/pipeline_exec.py)
through `jaxpar train`: data=2 × tensor=2 × pipe=2, 2 chunks of one layer per rank, 2 microbatches;
train, resume and evaluate equal one device."""

from __future__ import annotations

from support.schedules_cli import train_resume_eval_matches_single_device


def test_interleaved_train_resume_eval_match_single_device(tmp_path):
    train_resume_eval_matches_single_device(
        tmp_path, ["mesh.pipe=2", "mesh.data=2", "mesh.tensor=2", "pipeline.schedule=interleaved",
                   "pipeline.repeats=2", "pipeline.microbatches=2"])
