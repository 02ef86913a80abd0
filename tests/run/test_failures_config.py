"""Failure paths that need no training (in-process, fast): non-finite settings, unreadable
config files, the run-dir rules (restartable leftovers, resume from the run's own config.json),
torn metrics lines, the launcher's up-front mesh check and one-write error lines.

Independent reference: the exact messages and file contents written down by hand here."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess

import pytest

from gpt2common.grammar import load_yaml
from gpt2common.outdir import make_out
from jaxpar import cli
from jaxpar import config as C
from jaxpar.config import ConfigError
from jaxpar.run import launch, rundir
from jaxpar.run.metrics import truncate_after


@pytest.mark.parametrize("args,msg", [
    (["train.lr=nan"], "train.lr='nan' is not a finite number"),
    (["train.lr=inf"], "train.lr='inf' is not a finite number"),
    (["train.lr=-inf"], "train.lr='-inf' is not a finite number"),
    (["train.weight_decay=nan"], "train.weight_decay='nan' is not a finite number"),
    (["train.lr=1e400"], "train.lr='1e400' is not a finite number"),  # overflows to inf
    (["train.beta2=1"], "train.beta2=1.0 must be in [0, 1)"),
    (["train.eps=-1e-8"], "train.eps=-1e-08 must be >= 0"),
    (["train.min_lr_ratio=2"], "train.min_lr_ratio=2.0 must be in [0, 1]"),
    (["seed=-1"], "seed=-1 must be in [0, 2**32)"),
])
def test_non_finite_and_out_of_range_settings(args, msg):
    with pytest.raises(ConfigError) as e:
        C.resolve(["model=gpt2-tiny", *args])
    assert str(e.value) == msg


def test_config_flag_naming_a_directory_is_one_line(tmp_path, capsys):
    assert cli.main(["train", "--config", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"error: config file {str(tmp_path)!r} is a directory\n"


def _alias_bomb() -> str:
    """Nine levels of nine aliases: 9**9 = 387,420,489 keys once flattened, in about 600 bytes."""
    lines = ["l0: &l0 {" + ",".join(f"{k}: x" for k in "abcdefghi") + "}"]
    lines += [f"l{n}: &l{n} {{" + ",".join(f"{k}: *l{n - 1}" for k in "abcdefghi") + "}" for n in range(1, 9)]
    return "\n".join(lines) + "\nmodel: {n_layer: *l8}\n"


# The bomb runs in a process limited to 4 GB of address space: should the guard regress, it dies
# of a MemoryError within seconds instead of taking the host's memory.
_LIMITED_CLI = ("import os, resource, sys; resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30)); "
                "os.execv(sys.executable, [sys.executable, '-m', 'jaxpar.cli', *sys.argv[1:]])")


def test_an_alias_bomb_is_one_line_within_seconds(tmp_path):
    import sys
    import time

    from support.cli_helpers import clean_env

    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(_alias_bomb())
    assert len(bomb.read_bytes()) < 700
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", _LIMITED_CLI, "train", "--config", str(bomb), f"out={tmp_path / 'o'}"],
                       capture_output=True, text=True, timeout=60, env=clean_env())
    assert (r.returncode, r.stderr) == (2, f"error: config file {str(bomb)!r} uses a YAML alias (*l0 at line 2); "
                                           "config files take plain values only\n")
    assert time.monotonic() - t0 < 10  # the interpreter's start included
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("command", ["train", "mesh"])
def test_config_input_is_bounded(tmp_path, capsys, command):
    """An alias and a mapping nested 800 deep are refused from the parser's events, before
    anything is built: one line each, within a second (unbounded: an alias bomb takes gigabytes,
    deep nesting is a RecursionError)."""
    import time

    alias, deep = tmp_path / "alias.yaml", tmp_path / "deep.yaml"
    alias.write_text("train: &t {steps: 3}\neval: {windows: 1}\nmodel: {n_layer: 2}\npipeline: *t\n")
    deep.write_text("a: " + "{a: " * 800 + "1" + "}" * 800 + "\n")
    for path, msg in ((alias, "uses a YAML alias (*t at line 4); config files take plain values only"),
                      (deep, "nests deeper than 32 levels (line 1)")):
        t0 = time.perf_counter()
        assert cli.main([command, "--config", str(path), f"out={tmp_path / 'o'}"]) == 2
        assert time.perf_counter() - t0 < 1.0
        assert capsys.readouterr().err == f"error: config file {str(path)!r} {msg}\n"
    assert not (tmp_path / "o").exists()
    ok = tmp_path / "ok.yaml"  # an anchor without an alias, and the deepest real config: taken
    ok.write_text("train: &t {steps: 3}\npipeline: {layers_per_stage: [1, 1]}\n")
    assert load_yaml(str(ok)) == {"train.steps": 3, "pipeline.layers_per_stage": [1, 1]}


@pytest.mark.parametrize("text,msg", [
    ("train:\n  steps: 3\n  lr: 1.0e-3\n  lr: 3.0e-4\n", "gives 'lr' twice (lines 3 and 4)"),
    ("model: gpt2-tiny\nmodel: gpt2\n", "gives 'model' twice (lines 1 and 2)"),
    ("train: {steps: 3, steps: 4}\n", "gives 'steps' twice (lines 1 and 1)"),
    ("train.steps: 3\ntrain:\n  steps: 4\n", "gives train.steps twice (dotted and nested)"),
])
def test_a_key_given_twice_in_a_config_file_is_refused(tmp_path, capsys, text, msg):
    """PyYAML keeps a repeated key's last value: the run trained on lr 3e-4 without a word about
    the 1e-3 above it. YAML says keys are unique; one line names both places."""
    y = tmp_path / "c.yaml"
    y.write_text(text)
    # (train.steps=0: refused on its own, so nothing trains even where the key check fails)
    assert cli.main(["train", "--config", str(y), f"out={tmp_path / 'o'}", "train.steps=0"]) == 2
    assert capsys.readouterr().err == f"error: config file {str(y)!r} {msg}; a key takes one value\n"
    assert not (tmp_path / "o").exists()
    # the same keys once each, and the same leaf name in two sections, are taken
    y.write_text("train: {steps: 3, lr: 3.0e-4}\neval: {windows: 1}\nmodel: {n_layer: 2}\npipeline: {repeats: 1}\n")
    assert load_yaml(str(y)) == {"train.steps": 3, "train.lr": 3e-4, "eval.windows": 1, "model.n_layer": 2,
                                 "pipeline.repeats": 1}


def test_config_flag_forms(tmp_path, capsys):
    """`--config FILE` and `--config=FILE` (a path may hold '=': a sweep's run dirs do) are pulled
    out of argv; `--config` with nothing after it is one error line, not a run on the defaults."""
    assert C.split_config_flag(["a=1", "--config", "x.yaml", "b=2"]) == ("x.yaml", ["a=1", "b=2"])
    assert C.split_config_flag(["--config=runs/lr=3e-4/c.yaml", "a=1"]) == ("runs/lr=3e-4/c.yaml", ["a=1"])
    assert cli.main(["train", "train.steps=0", "--config"]) == 2  # (steps=0: a run never starts, even on a bug)
    assert capsys.readouterr().err == "error: --config needs a file path\n"
    assert cli.main(["train", "train.steps=0", "--config="]) == 2  # it trained on the defaults
    assert capsys.readouterr().err == "error: --config needs a file path\n"
    from torchref.cli import _split_config

    with pytest.raises(ConfigError, match="^--config needs a file$"):
        _split_config(["--config=", "strategy=single"])


def test_a_yaml_null_is_refused_not_the_string_none(tmp_path, capsys):
    """`out: ~` trained into a dir named 'None'; an Optional key still takes null."""
    y = tmp_path / "c.yaml"
    y.write_text("out: ~\n")
    assert cli.main(["train", "--config", str(y), "train.steps=0"]) == 2
    assert capsys.readouterr().err == "error: out is null in the config file; give it a value or leave it out\n"
    assert not (tmp_path / "None").exists()


@pytest.mark.parametrize("argv,line", [
    (["eval", "checkpoint=a", "hf=b", "data=c"], "eval needs exactly one of checkpoint=<run dir> or hf=<dir>"),
    (["eval", "data=c"], "eval needs exactly one of checkpoint=<run dir> or hf=<dir>"),
    (["prepare", "input=corpus.txt"], "prepare needs out=<dir>"),
    (["plot"], "plot takes run=<run dir> [out=<png>]"),
    (["plot", "out=x.png"], "plot takes run=<run dir> [out=<png>]"),
    # an input or output given twice: the last would win and the first be silently dropped
    (["plot", "run=a", "run=b"], "run= given twice ('a' and 'b'); it takes one value"),
    (["eval", "checkpoint=a", "data=c", "checkpoint=b"], "checkpoint= given twice ('a' and 'b'); it takes one value"),
    (["sample", "checkpoint=a", "prompt=x", "prompt=y"], "prompt= given twice ('x' and 'y'); it takes one value"),
    (["convert", "checkpoint=a", "to_hf=b", "to_hf=c"], "to_hf= given twice ('b' and 'c'); it takes one value"),
    (["prepare", "input=a", "input=b", "out=o"], "input= given twice ('a' and 'b'); it takes one value"),
    # an empty output path: prepare wrote into the current dir, convert ended in a FileNotFoundError traceback
    (["prepare", "out="], "out='' cannot be created (No such file or directory)"),
    (["convert", "checkpoint=a", "to_hf="], "to_hf='' cannot be created (No such file or directory)"),
    (["convert", "checkpoint=a", "to_state="], "to_state='' cannot be created (No such file or directory)"),
])
def test_command_arguments_missing_or_conflicting_are_one_line(argv, line, tmp_path, monkeypatch, capsys):
    """Checked before any file is read (none of these paths exists): exit 2, one line."""
    monkeypatch.chdir(tmp_path)
    assert cli.main(argv) == 2
    assert capsys.readouterr().err == f"error: {line}\n"
    assert list(tmp_path.iterdir()) == []


def test_a_repeated_config_key_still_overrides():
    """Config keys keep the override habit (`train $COMMON train.steps=10`): the last value wins."""
    assert C.resolve(["train.steps=5", "model=gpt2-tiny", "train.steps=7"]).train.steps == 7


def test_error_line_is_one_write(monkeypatch):
    """Two ranks sharing an unbuffered stderr join their lines when print() writes the
    text and the newline separately (a launch test then sees a torn line)."""
    writes = []

    class Recorder:
        def write(self, s):
            writes.append(s)

        def flush(self):
            pass

    monkeypatch.setattr("sys.stderr", Recorder())
    assert cli.main(["train", "model=gpt3"]) == 2
    assert writes == ["error: model='gpt3' is not a preset (choose from gpt2-tiny, gpt2, gpt2-medium, gpt2-large, "
                      "gpt2-xl)\n"]


def test_launch_refuses_an_impossible_mesh_before_starting_anything(monkeypatch, tmp_path):
    def no_spawn(*a, **k):
        raise AssertionError("a process was started")

    monkeypatch.setattr(subprocess, "Popen", no_spawn)
    with pytest.raises(ConfigError) as e:
        launch.main(["nprocs=2", "--", "train", "model=gpt2-tiny", "mesh.data=3"])
    assert str(e.value) == "mesh data=3×fsdp=1×tensor=1×pipe=1 (3 devices) cannot be split evenly over 2 processes"
    with pytest.raises(ConfigError, match=r"^unknown key 'train.stepz'"):
        launch.main(["nprocs=2", "--", "train", "train.stepz=1"])
    # a state that cannot continue the run: one line from the launcher, not one from every rank
    with pytest.raises(ConfigError) as e:
        launch.main(["nprocs=2", "--", "train", "model=gpt2-tiny", f"init_state={tmp_path / 'none'}",
                     f"out={tmp_path / 'run'}"])
    assert str(e.value) == f"init_state='{tmp_path / 'none'}' is not a directory"
    # inputs process 0 alone reads (data=) or every rank reads (init=, plan=): checked here once
    for key, line in (("data", "{!r} does not exist"), ("init", "{!r} is not an HF save_pretrained dir (no config.json)"),
                      ("plan", "{!r} does not exist")):
        with pytest.raises(ConfigError) as e:
            launch.main(["nprocs=2", "--", "train", "model=gpt2-tiny", f"{key}={tmp_path / 'none'}",
                         f"out={tmp_path / 'run'}"])
        assert str(e.value) == f"{key}=" + line.format(str(tmp_path / "none"))
    # the model eval / sample / inspect would load
    none = str(tmp_path / "none")
    for cmd, line in ((["eval", f"checkpoint={none}"], f"checkpoint={none!r} has no config.json (not a jaxpar run dir)"),
                      (["sample", f"checkpoint={none}"], f"checkpoint={none!r} has no config.json (not a jaxpar run dir)"),
                      (["eval", f"hf={none}", "data=x"], f"hf={none!r} is not an HF save_pretrained dir (no config.json)"),
                      (["inspect", f"init={none}"], f"init={none!r} is not an HF save_pretrained dir (no config.json)"),
                      (["eval", "checkpoint=a", "checkpoint=b"], "checkpoint= given twice ('a' and 'b'); it takes one value")):
        with pytest.raises(ConfigError) as e:
            launch.main(["nprocs=2", "--", *cmd])
        assert str(e.value) == line
    assert list(tmp_path.iterdir()) == []


# Stand-ins for the ranks `jaxpar launch` starts: each runs this script instead of `jaxpar.cli`,
# acting by its JAXPAR_PROCESS_ID (rank r takes RANK_ACTS[r]).
RANK_SCRIPT = """
import os, signal, sys, time
act = os.environ["RANK_ACTS"].split(",")[int(os.environ["JAXPAR_PROCESS_ID"])]
if act == "kill9":
    os.kill(os.getpid(), signal.SIGKILL)
elif act == "hang":
    time.sleep(60)
sys.exit(int(act))
"""
REAL_POPEN = subprocess.Popen


def _launch_fake_ranks(monkeypatch, acts: str, *opts) -> int:
    def fake(args, env):
        assert args[1:3] == ["-m", "jaxpar.cli"]
        return REAL_POPEN([args[0], "-c", RANK_SCRIPT], env={**env, "RANK_ACTS": acts})

    monkeypatch.setattr(subprocess, "Popen", fake)
    return launch.main(["nprocs=2", *opts, "--", "sample"])


def test_launch_names_the_dead_rank_not_the_one_that_lost_it(monkeypatch, capfd):
    """Rank 0 is killed (SIGKILL), rank 1 then exits with LOST_PEER_EXIT: the launcher blames
    rank 0 and exits with the shell's code for a SIGKILL, 128 + 9."""
    assert launch.LOST_PEER_EXIT == 3
    assert _launch_fake_ranks(monkeypatch, "kill9,3") == 137
    assert capfd.readouterr().err == "error: process 0 exited with code 137\n"
    # A rank still running is stopped (SIGTERM after the settle time) and named.
    assert _launch_fake_ranks(monkeypatch, "5,hang", "grace=1") == 5
    assert capfd.readouterr().err == "error: process 0 exited with code 5; stopping processes 1\n"


# ----------------------------------------------------------------------------- run dir


def _cfg(out, *args):
    return C.resolve(["model=gpt2-tiny", f"out={out}", *args])


def _no_ckpt(out):
    raise AssertionError("latest_step asked for a run dir without step dirs")


def test_failed_run_leftovers_are_restartable_anything_else_is_refused(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    for name in ("config.json", "metrics.jsonl"):
        (out / name).write_text("{}")
    (out / "data").mkdir()
    (out / "ckpt" / "3.orbax-checkpoint-tmp-1").mkdir(parents=True)  # a save cut short
    assert rundir.check_out_dir(_cfg(out), _no_ckpt) == (None, True)
    (out / "ckpt" / "3").mkdir()  # a step dir: a real run, never started over
    with pytest.raises(ConfigError) as e:
        rundir.check_out_dir(_cfg(out), _no_ckpt)
    assert str(e.value) == f"out={str(out)!r} is not empty; pass resume=true to continue it or choose another out"
    (out / "ckpt" / "3").rmdir()
    (out / "notes.txt").write_text("mine")  # a file jaxpar never writes
    with pytest.raises(ConfigError, match="is not empty"):
        rundir.check_out_dir(_cfg(out), _no_ckpt)
    (out / "notes.txt").unlink()
    with pytest.raises(ConfigError) as e:
        rundir.check_out_dir(_cfg(out, "resume=true"), _no_ckpt)
    assert str(e.value) == (f"resume=true but out={str(out)!r} holds no complete checkpoint "
                            "(start it over without resume=true)")


def test_unwritable_out_is_refused_before_anything_is_written(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError) as e:
        rundir.check_out_dir(_cfg(blocker / "run"), _no_ckpt)
    assert str(e.value) == f"out={str(blocker / 'run')!r} cannot be created: {str(blocker)!r} is not a directory"
    with pytest.raises(ConfigError) as e:
        rundir.check_out_dir(_cfg(blocker), _no_ckpt)
    assert str(e.value) == f"out={str(blocker)!r} exists and is not a directory"
    with pytest.raises(ConfigError, match=r"^out='/proc/jaxpar_run' cannot be created \("):
        make_out("/proc/jaxpar_run")  # refused even to root


def test_an_output_the_filesystem_refuses_is_one_line(tmp_path, capsys):
    """Writable to os.access (root) but refused by mkdir or open (/proc): one line naming the key
    and the OS reason, where each was a FileNotFoundError traceback."""
    from gpt2common import state as fmt
    from jaxpar.run.export import export_hf

    (tmp_path / "in.txt").write_text("some words to prepare. " * 20)
    assert cli.main(["prepare", f"input={tmp_path / 'in.txt'}", "out=/proc/jaxpar_x"]) == 2
    assert capsys.readouterr().err == "error: out='/proc/jaxpar_x' cannot be created (No such file or directory)\n"
    tiny = C.resolve(["model=gpt2-tiny"])
    with pytest.raises(ConfigError) as e:  # convert checkpoint= to_hf=: after the weights are read
        export_hf(str(tmp_path), "/proc/jaxpar_x", tiny, lambda: {})
    assert str(e.value) == "to_hf='/proc/jaxpar_x' cannot be created (No such file or directory)"
    with pytest.raises(ConfigError) as e:  # convert checkpoint= to_state=: named as given, not its .tmp
        fmt.write_state("/proc/jaxpar_x", {}, {}, {}, {}, {}, key="to_state")
    assert str(e.value) == "to_state='/proc/jaxpar_x' cannot be created (No such file or directory)"
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 5.0, "tokens_per_s": 10.0}) + "\n")
    assert cli.main(["plot", f"run={run}", "out=/proc/jaxpar_x.png"]) == 2
    assert capsys.readouterr().err == "error: out='/proc/jaxpar_x.png' cannot be written (No such file or directory)\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", "run"] and os.listdir(run) == ["metrics.jsonl"]


def _saved_run(tmp_path, *args):
    out = tmp_path / "run"
    out.mkdir()
    saved = _cfg(out, "model.n_layer=1", "train.steps=5", "train.lr=1e-3", "mesh.data=2", *args)
    (out / "config.json").write_text(C.dumps(saved))
    return out, saved


def test_resume_reads_the_runs_config_and_applies_only_given_keys(tmp_path):
    out, saved = _saved_run(tmp_path, "init=some/hf", "plan=auto")
    cfg = rundir.resolve_train({"out": str(out), "resume": "true", "train.steps": "9"}, None)
    assert cfg.model == saved.model and cfg.model.n_layer == 1 and cfg.mesh.data == 2
    assert (cfg.train.steps, cfg.train.lr, cfg.resume) == (9, 1e-3, True)
    assert (cfg.init, cfg.plan) == ("", "")  # the checkpoint holds the weights; the plan was applied
    # Repeating the run's own keys is fine; changing a shape is not.
    same = rundir.resolve_train({"out": str(out), "resume": "true", "model": "gpt2-tiny", "model.n_layer": "1"}, None)
    assert same.model == saved.model
    with pytest.raises(ConfigError) as e:
        rundir.resolve_train({"out": str(out), "resume": "true", "model": "gpt2-tiny"}, None)
    assert str(e.value) == "resume=true cannot change model.n_layer=2 (run has 1): start a new run in another out"
    with pytest.raises(ConfigError) as e:
        rundir.resolve_train({"out": str(out), "resume": "true", "data": "other.txt"}, None)
    assert str(e.value) == "resume=true cannot change data='other.txt' (run has ''): start a new run in another out"
    # Another tokenizer is another token stream; another n_positions is another wpe shape.
    with pytest.raises(ConfigError) as e:
        rundir.resolve_train({"out": str(out), "resume": "true", "tokenizer": "bpe"}, None)
    assert str(e.value) == "resume=true cannot change tokenizer='bpe' (run has 'byte'): start a new run in another out"
    with pytest.raises(ConfigError) as e:
        rundir.resolve_train({"out": str(out), "resume": "true", "model.n_positions": "300"}, None)
    assert str(e.value) == ("resume=true cannot change model.n_positions=300 (run has 256): start a new run in "
                            "another out")
    with pytest.raises(ConfigError) as e:
        rundir.resolve_train({"out": str(out), "resume": "true", "init": "x"}, None)
    assert str(e.value) == "init='x' cannot be combined with resume=true (the checkpoint holds the weights)"


def test_a_relative_data_path_is_saved_absolute_and_resume_compares_absolute_paths(tmp_path, monkeypatch):
    """data=pr/t.txt was saved as typed: resume=true (and eval, sample) from another directory found
    nothing there, or another dataset of that name, and the same path given absolute was refused as
    a change. A new run saves it absolute when it exists (a missing one stays as typed, for the
    error naming it); resume compares absolute paths; the built-in corpus ("") is not a path, and
    an older run's saved relative path is kept and compared as before."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pr").mkdir()
    (tmp_path / "pr" / "t.txt").write_text("some text")
    absolute = str(tmp_path / "pr" / "t.txt")
    new = {"model": "gpt2-tiny", "out": "run"}
    cfg = rundir.resolve_train({**new, "data": "pr/t.txt"}, None)
    assert cfg.data == absolute
    assert rundir.resolve_train({**new, "data": "pr/none.txt"}, None).data == "pr/none.txt"
    assert rundir.resolve_train(new, None).data == ""
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text(C.dumps(C.settings_of(cfg)))
    monkeypatch.chdir(tmp_path / "pr")  # another working directory
    for given in ({}, {"data": absolute}, {"data": "t.txt"}, {"data": os.path.join("..", "pr", "t.txt")}):
        assert rundir.resolve_train({"out": str(out), "resume": "true", **given}, None).data == absolute, given
    with pytest.raises(ConfigError) as e:  # pr/t.txt from here is another path: named absolute
        rundir.resolve_train({"out": str(out), "resume": "true", "data": "pr/t.txt"}, None)
    assert str(e.value) == (f"resume=true cannot change data='{tmp_path}/pr/pr/t.txt' (run has '{absolute}'): "
                            "start a new run in another out")
    # an older run saved the path as typed: it stays so, and is compared as typed
    (out / "config.json").write_text(C.dumps(C.settings_of(dataclasses.replace(cfg, data="pr/t.txt"))))
    assert rundir.resolve_train({"out": str(out), "resume": "true"}, None).data == "pr/t.txt"
    assert rundir.resolve_train({"out": str(out), "resume": "true", "data": "pr/t.txt"}, None).data == "pr/t.txt"
    with pytest.raises(ConfigError) as e:
        rundir.resolve_train({"out": str(out), "resume": "true", "data": absolute}, None)
    assert str(e.value) == f"resume=true cannot change data='{absolute}' (run has 'pr/t.txt'): start a new run in another out"


def test_a_relative_tokenizer_or_init_dir_is_saved_absolute_too(tmp_path, monkeypatch):
    """tokenizer=<GPT-2 dir> and init=<HF dir> are recorded like data= (sample reads the tokenizer
    files from either, resume compares tokenizer=); the names byte and bpe, and a hub name that is
    no path here, stay as typed."""
    monkeypatch.chdir(tmp_path)
    for d in ("tok", "byte", "hfdir"):
        (tmp_path / d).mkdir()
    new = {"model": "gpt2-tiny", "out": "run"}
    cfg = rundir.resolve_train({**new, "tokenizer": "tok"}, None)
    assert cfg.tokenizer == str(tmp_path / "tok")
    assert rundir.resolve_train({**new, "tokenizer": "byte"}, None).tokenizer == "byte"
    assert C.resolve_kv({"init": "hfdir"}).init == str(tmp_path / "hfdir")
    assert C.resolve_kv({"init": "gpt2"}).init == "gpt2"
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text(C.dumps(C.settings_of(cfg)))
    monkeypatch.chdir(tmp_path / "hfdir")
    assert rundir.resolve_train({"out": str(out), "resume": "true", "tokenizer": os.path.join("..", "tok")}, None).tokenizer == \
        str(tmp_path / "tok")
    with pytest.raises(ConfigError) as e:
        rundir.resolve_train({"out": str(out), "resume": "true", "tokenizer": "tok"}, None)
    assert str(e.value) == (f"resume=true cannot change tokenizer='{tmp_path}/hfdir/tok' (run has "
                            f"'{tmp_path}/tok'): start a new run in another out")


def test_resume_with_a_missing_or_corrupt_config_json(tmp_path):
    with pytest.raises(ConfigError) as e:
        rundir.resolve_train({"out": str(tmp_path / "none"), "resume": "true"}, None)
    assert str(e.value) == f"resume=true but out={str(tmp_path / 'none')!r} does not exist"
    with pytest.raises(ConfigError) as e:
        rundir.resolve_train({"out": str(tmp_path), "resume": "true"}, None)
    assert str(e.value) == f"resume=true but out={str(tmp_path)!r} has no config.json (not a jaxpar run dir)"
    # a bad value, a key this Config does not have (a hand edit, another version's config.json), a
    # section that is not an object, a file that is not an object: one line each, never a traceback
    from jaxpar.run.commands import run_config

    deep = "[" * 100_000 + "]" * 100_000  # json recurses per level: a RecursionError traceback
    # '{"bogus": 1}': an unknown top-level key was dropped, so any JSON object read as the defaults
    for text in ('{"model": {"n_layer": "two"}}', '{"train": {"bogus": 1}}', '{"bogus": 1}', '{"mesh": 5}', "[]",
                 deep):
        (tmp_path / "config.json").write_text(text)
        with pytest.raises(ConfigError) as e:
            rundir.resolve_train({"out": str(tmp_path), "resume": "true"}, None)
        assert str(e.value) == f"resume=true but {str(tmp_path / 'config.json')!r} is corrupt", text[:40]
        with pytest.raises(ConfigError) as e:  # eval / sample / convert read it the same way
            run_config(str(tmp_path))
        assert str(e.value) == f"checkpoint={str(tmp_path)!r}: config.json is corrupt", text[:40]


def test_a_config_json_that_cannot_be_read_or_is_mistyped_is_one_line(tmp_path):
    """A config.json that is a directory, not UTF-8, not JSON, or holds a value of the wrong type
    (a top-level one, or a null in a section: a TypeError in validate), and a checkpoint= that
    is a file: one line naming the path, never a traceback."""
    from jaxpar.run.commands import run_config

    cfg_json = tmp_path / "config.json"
    cfg_json.mkdir()
    with pytest.raises(ConfigError) as e:
        rundir.resolve_train({"out": str(tmp_path), "resume": "true"}, None)
    assert str(e.value) == f"resume=true but {str(cfg_json)!r} cannot be read (Is a directory)"
    with pytest.raises(ConfigError) as e:
        run_config(str(tmp_path))
    assert str(e.value) == f"checkpoint={str(tmp_path)!r}: config.json cannot be read (Is a directory)"
    cfg_json.rmdir()
    saved = json.loads(C.dumps(C.resolve(["model=gpt2-tiny"])))
    for doc in (b"\xff\xfe{}", b"not json", json.dumps({**saved, "seed": "x"}).encode(),
                json.dumps({**saved, "precision": None}).encode(),
                json.dumps({**saved, "train": {**saved["train"], "steps": None}}).encode()):
        cfg_json.write_bytes(doc)
        with pytest.raises(ConfigError) as e:
            rundir.resolve_train({"out": str(tmp_path), "resume": "true"}, None)
        assert str(e.value) == f"resume=true but {str(cfg_json)!r} is corrupt", doc
        with pytest.raises(ConfigError) as e:
            run_config(str(tmp_path))
        assert str(e.value) == f"checkpoint={str(tmp_path)!r}: config.json is corrupt", doc
    cfg_json.write_text(json.dumps({**saved, "seed": "7"}))  # what a YAML or key=value gives is still taken
    assert run_config(str(tmp_path)).seed == 7
    with pytest.raises(ConfigError) as e:
        run_config(str(cfg_json))
    assert str(e.value) == f"checkpoint={str(cfg_json)!r} has no config.json (not a jaxpar run dir)"


def test_a_checkpoint_or_init_that_is_a_file_is_one_line_in_every_command(tmp_path, monkeypatch, capsys):
    """eval, sample, convert and train init= on a regular file were a NotADirectoryError traceback;
    launch reports it once, from its precheck, before any process starts."""
    def no_spawn(*a, **k):
        raise AssertionError("a process was started")

    monkeypatch.setattr(subprocess, "Popen", no_spawn)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("")
    ckpt = "checkpoint='afile' has no config.json (not a jaxpar run dir)"
    init = "init='afile' is not an HF save_pretrained dir (no config.json)"
    for argv, line in ((["eval", "checkpoint=afile"], ckpt), (["sample", "checkpoint=afile"], ckpt),
                       (["convert", "checkpoint=afile", "to_hf=h"], ckpt),
                       (["convert", "checkpoint=afile", "to_state=s"], ckpt),
                       (["eval", "hf=afile", "data=x"], "hf='afile' is not an HF save_pretrained dir (no config.json)"),
                       (["launch", "nprocs=2", "--", "eval", "checkpoint=afile"], ckpt),
                       (["launch", "nprocs=2", "--", "sample", "checkpoint=afile"], ckpt),
                       (["launch", "nprocs=2", "--", "train", "model=gpt2-tiny", "init=afile", "out=o"], init),
                       (["launch", "nprocs=2", "--", "inspect", "model=gpt2-tiny", "init=afile"], init)):
        assert cli.main(argv) == 2, argv
        assert capsys.readouterr().err == f"error: {line}\n", argv
    assert os.listdir(tmp_path) == ["afile"]


def _tiny_hf_dir(path):
    from gpt2common import hf
    from gpt2common.init import init_params

    hf.save_hf(str(path), C.PRESETS["gpt2-tiny"], init_params(C.PRESETS["gpt2-tiny"], 0))
    return str(path)


@pytest.mark.parametrize("keys,shown", [
    (["model.n_layer=4"], "model.n_layer=4 (the weights have n_layer=2)"),
    (["model=gpt2"], "model=gpt2 (the weights have n_layer=2, n_embd=128, n_head=4, vocab_size=256, n_positions=256)"),
    (["model.vocab_size=300"], "model.vocab_size=300 (the weights have vocab_size=256)"),
    # judged against the weights, not the default preset (it was: not divisible by model.n_head=12)
    (["model.n_embd=256"], "model.n_embd=256 (the weights have n_embd=128)"),
    (["model=gpt2", "model.n_layer=3", "model.layer_norm_epsilon=1e-6"],
     "model=gpt2, model.n_layer=3, model.layer_norm_epsilon=1e-06 (the weights have n_layer=2, n_embd=128, n_head=4, "
     "vocab_size=256, n_positions=256, layer_norm_epsilon=1e-05)"),
])
def test_model_keys_that_disagree_with_init_are_refused(tmp_path, monkeypatch, capsys, keys, shown):
    """train init=<HF dir> model.n_layer=4 trained the HF dir's 2 layers without a word (its
    config.json replaced the keys). Refused as bisect refuses model keys beside hf=, by train,
    inspect and launch's precheck, before anything is written; the line names the keys."""
    def no_spawn(*a, **k):
        raise AssertionError("a process was started")

    monkeypatch.setattr(subprocess, "Popen", no_spawn)
    hf_dir = _tiny_hf_dir(tmp_path / "hf")
    line = f"error: model keys conflict with init={hf_dir!r}, whose weights set the model: {shown}\n"
    for argv in (["train", f"init={hf_dir}", *keys, f"out={tmp_path / 'o'}"], ["inspect", f"init={hf_dir}", *keys],
                 ["launch", "nprocs=2", "--", "train", f"init={hf_dir}", *keys, f"out={tmp_path / 'o'}"]):
        assert cli.main(argv) == 2, argv
        assert capsys.readouterr().err == line, argv
    (tmp_path / "c.yaml").write_text("\n".join(k.replace("=", ": ", 1) for k in keys) + "\n")
    assert cli.main(["train", "--config", str(tmp_path / "c.yaml"), f"init={hf_dir}", f"out={tmp_path / 'o'}"]) == 2
    assert capsys.readouterr().err == line
    assert sorted(os.listdir(tmp_path)) == ["c.yaml", "hf"]


def test_model_keys_that_agree_with_init_pass_and_attention_is_the_runs(tmp_path):
    """Keys the weights agree with are no conflict: examples/configs/finetune.yaml names the
    preset of its init=, and an init run's own config.json (every model key) starts it again.
    model.attention, like model.dropout, is the run's choice: it was dropped for the HF default."""
    from gpt2common import hf
    from jaxpar.run.loop import shaped_by_init
    from jaxpar.run.rundir import check_init_model_keys

    hf_dir = _tiny_hf_dir(tmp_path / "hf")
    check_init_model_keys({"init": hf_dir, "model": "gpt2-tiny", "model.layer_norm_epsilon": "1e-5"})
    cfg = shaped_by_init(C.resolve([f"init={hf_dir}", "model.attention=xla", "model.dropout=0"]),
                         hf.load_hf_config(hf_dir, "init"))
    assert (cfg.model.attention, cfg.model.n_layer, cfg.model_name) == ("xla", 2, f"hf:{hf_dir}")
    (tmp_path / "config.json").write_text(C.dumps(C.settings_of(cfg)))
    check_init_model_keys(load_yaml(str(tmp_path / "config.json")))


def test_truncate_drops_a_torn_last_line(tmp_path):
    p = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in (1, 2, 3)]
    p.write_text("".join(lines) + '{"step": 4, "loss": 0.2')  # what a kill -9 mid-write leaves
    truncate_after(str(p), 2)
    assert p.read_text() == "".join(lines[:2])
    truncate_after(str(p), 0)  # a restarted run starts the file over
    assert p.read_text() == ""


def test_a_section_given_a_value_names_it_as_a_section(tmp_path):
    """`train=5`, or `train: [1, 2]` in a YAML file: both said "unknown key 'train'", of a section
    that `--help` lists."""
    with pytest.raises(ConfigError) as e:
        C.resolve(["train=5"])
    assert str(e.value) == ("train='5': train is a section, not a key; set its keys (train.steps=..., or a mapping "
                            "under `train:` in YAML)")
    y = tmp_path / "c.yaml"
    y.write_text("model: gpt2-tiny\nmesh: [1, 2]\n")
    with pytest.raises(ConfigError) as e:
        C.resolve([], config_file=str(y))
    assert str(e.value) == ("mesh=[1, 2]: mesh is a section, not a key; set its keys (mesh.data=..., or a mapping "
                            "under `mesh:` in YAML)")
    with pytest.raises(ConfigError, match=r"^unknown key 'bogus'$"):  # an unknown bare key is still that
        C.resolve(["bogus=1"])


def test_checkpoint_naming_an_hf_dir_says_so(tmp_path, capsys):
    """`sample checkpoint=DIR` on what `convert to_hf=DIR` had just written read DIR's transformers
    config.json as a jaxpar run's (its keys unknown, so the defaults: GPT-2 124M) and then failed
    on a missing tokenizer or ckpt/. The HF dir is now named as such, with the commands that take it."""
    from gpt2common import hf
    from jaxpar.models.gpt2 import init_params
    from jaxpar.run.commands import run_config

    mc = dataclasses.replace(C.preset("gpt2-tiny"), n_layer=1, n_embd=16, n_head=2)
    hf.save_hf(str(tmp_path / "hf"), mc, init_params(mc, seed=0))
    line = (f"checkpoint={str(tmp_path / 'hf')!r} is an HF save_pretrained dir, not a jaxpar run dir: "
            "`jaxpar eval hf=` reads it, `jaxpar convert hf=` makes a run of it")
    for argv in (["sample", f"checkpoint={tmp_path / 'hf'}"], ["eval", f"checkpoint={tmp_path / 'hf'}"]):
        assert cli.main(argv) == 2
        assert capsys.readouterr().err == f"error: {line}\n"
    with pytest.raises(ConfigError) as e:
        run_config(str(tmp_path / "hf"))
    assert str(e.value) == line
