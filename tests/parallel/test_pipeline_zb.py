"""pipeline.schedule=zb (ZB-H1 run by jaxpar/parallel/pipeline_exec.py) through `jaxpar train`:
data=2 × fsdp=2 × pipe=2, 4 microbatches; train, resume and evaluate equal one device."""

from __future__ import annotations

from support.schedules_cli import train_resume_eval_matches_single_device


def test_zb_train_resume_eval_match_single_device(tmp_path):
    train_resume_eval_matches_single_device(
        tmp_path, ["mesh.pipe=2", "mesh.data=2", "mesh.fsdp=2", "pipeline.schedule=zb", "pipeline.microbatches=4"])
