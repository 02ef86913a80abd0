"""A run's `config.json` is a valid `--config`: it starts the very same run again (the printed
resolved config is identical), and it holds settings only, not what one start did (resume,
dry_run, plan). The YAML examples under examples/configs resolve as they are."""

import json
import re
import shutil
from pathlib import Path

import pytest

from jaxpar import cli
from jaxpar import config as C

ROOT = Path(__file__).resolve().parents[2]
TINY = ["model=gpt2-tiny", "train.seq_len=16", "train.batch_size=2", "train.eval_every=0", "progress=none"]


def _config_line(stdout: str) -> str:
    (line,) = [ln for ln in stdout.splitlines() if ln.startswith("config: ")]
    return line


@pytest.mark.parametrize("args", [
    [],
    ["model=gpt2-tiny", "sharding.replicate=embed,mlp", "pipeline.layers_per_stage=1,1", "train.lr=1e-5",
     "data=my text.txt", "tokenizer=bpe", "init=some/dir", "model.layer_norm_epsilon=1e-6", "seed=7"],
    ["model=gpt2-medium", "model.n_layer=3", "mesh.data=-1", "train.remat=true", "resume=true", "plan=auto",
     "dry_run=true", "device_peak_flops=1.5e14"],
])
def test_saved_settings_read_back_as_a_config_file(tmp_path, args):
    cfg = C.resolve(args)
    saved = C.settings_of(cfg)
    (tmp_path / "config.json").write_text(C.dumps(saved))
    assert C.resolve([], str(tmp_path / "config.json")) == saved
    assert (saved.resume, saved.dry_run, saved.plan) == (False, False, "")
    # the rest is the run's: every other field as resolved
    assert C.to_dict(saved) == {**C.to_dict(cfg), **C.RUN_STATE}


def test_a_converted_runs_label_is_kept_and_a_preset_label_is_a_preset(tmp_path):
    mc = C.ModelConfig(n_layer=1, n_embd=32, n_head=2, vocab_size=40, n_positions=256)
    cfg = C.Config(model=mc, model_name="hf:some/dir")
    (tmp_path / "c.json").write_text(C.dumps(cfg))
    assert C.resolve([], str(tmp_path / "c.json")) == cfg
    # model= on the command line still picks a preset over the file's label
    assert C.resolve(["model=gpt2-tiny"], str(tmp_path / "c.json")).model == C.PRESETS["gpt2-tiny"]
    assert C.resolve(["model_name=gpt2-tiny"]).model == C.PRESETS["gpt2-tiny"]


def test_train_with_a_runs_own_config_json_prints_the_same_config(tmp_path, capsys):
    """Train, resume it further (resume=true is not saved), then start the saved config.json again
    from scratch: the printed resolved config and the file are identical."""
    out = tmp_path / "run"
    assert cli.main(["train", *TINY, "train.steps=2", f"out={out}"]) == 0
    capsys.readouterr()
    assert cli.main(["train", f"out={out}", "resume=true", "train.steps=3"]) == 0
    resumed_line, saved = _config_line(capsys.readouterr().out), (out / "config.json").read_text()
    assert json.loads(saved)["resume"] is False and json.loads(saved)["train"]["steps"] == 3
    assert resumed_line == "config: " + json.dumps(json.loads(saved), separators=(",", ":"))

    shutil.copy(out / "config.json", tmp_path / "reuse.json")
    shutil.rmtree(out)
    assert cli.main(["train", "--config", str(tmp_path / "reuse.json")]) == 0
    assert _config_line(capsys.readouterr().out) == resumed_line
    assert (out / "config.json").read_text() == saved


def test_a_run_on_a_relative_data_path_resumes_and_evaluates_from_another_directory(tmp_path, monkeypatch, capsys):
    """data=pr/p2 (a prepared dir, used in place) was saved as typed: `resume=true` and `eval` started
    from another directory stopped at "data='pr/p2' does not exist". Saved absolute, both find it."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.txt").write_text("the quick brown fox jumps over the lazy dog. " * 100)
    assert cli.main(["prepare", "input=t.txt", "out=pr/p2"]) == 0
    assert cli.main(["train", *TINY, "train.steps=2", "out=run", "data=pr/p2"]) == 0
    assert json.loads((tmp_path / "run" / "config.json").read_text())["data"] == str(tmp_path / "pr" / "p2")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    capsys.readouterr()
    assert cli.main(["train", f"out={tmp_path / 'run'}", "resume=true", "train.steps=3"]) == 0, capsys.readouterr().err
    assert cli.main(["eval", f"checkpoint={tmp_path / 'run'}", "train.batch_size=2"]) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["tokens"] > 0


EXAMPLES = sorted((ROOT / "examples" / "configs").glob("*.yaml"))
README_OUTS = set(re.findall(r"\bout=(runs/[\w.-]+)", (ROOT / "README.md").read_text()))  # runs/tiny, ...


def test_there_is_one_example_per_journey():
    assert [p.name for p in EXAMPLES] == ["finetune.yaml", "parallel.yaml", "pipeline.yaml", "tiny.yaml"]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_config_resolves_and_every_key_is_commented(path):
    cfg = C.resolve([], str(path))
    lines = path.read_text().splitlines()
    assert lines[0].startswith("# ") and "jaxpar train --config examples/configs/" + path.name in path.read_text()
    # each setting line carries a comment, on it or on the line above
    for i, ln in enumerate(lines):
        if ln.strip() and not ln.lstrip().startswith("#") and not ln.rstrip().endswith(":"):
            assert "#" in ln or lines[i - 1].lstrip().startswith("#"), (path.name, ln)
    # its own run dir: not one the README's commands write (a second new run there is refused)
    assert cfg.out.startswith(f"runs/{path.stem}") and cfg.out not in README_OUTS, (cfg.out, README_OUTS)
