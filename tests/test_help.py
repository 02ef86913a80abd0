"""`jaxpar --help` and `jaxpar <command> --help`: generated from the dataclasses the commands parse
their keys into, so every key is listed with a default that parses back to the real default."""

import dataclasses
import re
import subprocess
import sys

import pytest

from gpt2common.grammar import setting
from jaxpar import cli
from jaxpar import config as C
from jaxpar.planner import cli as plan_cli
from jaxpar.run import help as H
from jaxpar.run import launch
from jaxpar.run import options as O


def test_every_key_has_a_doc_line_and_the_check_sees_a_missing_one():
    assert H.undocumented(H.documented_classes()) == []

    @dataclasses.dataclass(frozen=True)
    class Bare:
        good: int = setting(1, "documented")
        bad: int = 2
        empty: str = setting("", " ")

    assert H.undocumented([Bare]) == ["Bare.bad", "Bare.empty"]


@pytest.mark.parametrize("cmd", list(H.COMMANDS))
def test_each_command_help_exits_0_and_every_row_has_type_default_meaning(cmd, capsys):
    for flag in ("--help", "-h"):
        assert cli.main([cmd, "x=1", flag]) == 0
        out = capsys.readouterr().out
        assert out.startswith(f"usage: jaxpar {cmd} ")
        entries, _ = H.command_rows(cmd)
        assert entries and all(all(col.strip() for col in e) for e in entries)
        table = out.split("keys (type, default, meaning):\n")[1].split("\n\n")[0]
        # columns are separated by two or more spaces: key, type, default, meaning
        assert [tuple(re.split(r"\s{2,}", ln.strip())) for ln in table.splitlines()] == entries


def test_top_level_help_lists_every_command(capsys):
    for argv in (["--help"], ["-h"]):
        assert cli.main(argv) == 0
        out = capsys.readouterr().out
        listed = [ln.split()[0] for ln in out.split("commands:\n")[1].split("\n\n")[0].splitlines()]
        assert listed == list(H.COMMANDS) and set(listed) == set(cli.COMMANDS)


@pytest.mark.parametrize("tool", ["jaxpar", "torchref"])
def test_no_command_is_a_usage_error(tool, capsys):
    """`jaxpar` / `torchref` alone: the usage line and one error line on stderr, exit 2 (it printed the help
    and exited 0, so a script that lost its command went on as if it had run)."""
    from torchref import cli as torchref_cli
    from torchref import help as torchref_help

    main, names = {"jaxpar": (cli.main, cli.COMMANDS), "torchref": (torchref_cli.main, torchref_help.COMMANDS)}[tool]
    assert main([]) == 2
    out, err = capsys.readouterr()
    assert (out, err) == ("", f"usage: {tool} <command> [--config FILE.yaml] [key=value ...]\n"
                              f"error: no command given (choose from {', '.join(names)}; {tool} --help)\n")


def test_eval_help_gives_data_the_runs_default():
    """`jaxpar eval checkpoint=RUN` without data= scores the run's own val.bin (tests/run/test_train_cli.py);
    the help said data was required."""
    key, _, default, meaning = next(r for r in H.command_rows("eval")[0] if r[0] == "data")
    assert (default, "(required)" in meaning, "with hf= it is required" in meaning) == (H.RUNS, False, True)


def _parse_shown(text: str) -> str:
    return "" if text == '""' else text


def test_train_help_lists_exactly_the_keys_train_accepts_with_their_defaults():
    rows = H.config_rows()
    keys = [r[0] for r in rows]
    accepted = {"model"} | {f"{s}.{f.name}" for s, cls in C.SECTIONS.items() for f in dataclasses.fields(cls)} | {
        f.name for f in dataclasses.fields(C.Config) if f.name not in C.SECTIONS and f.name != "model_name"}
    assert len(keys) == len(set(keys)) == len(accepted) and set(keys) == accepted
    # every shown default, given back as key=value, yields the default Config
    assert C.apply_overrides(C.Config(), {k: _parse_shown(d) for k, _, d, _ in rows}) == C.Config()


def test_a_non_default_base_shows_its_values():
    cfg = C.resolve(["model=gpt2-tiny", "train.steps=7", "sharding.replicate=embed,mlp", "data=a b.txt"])
    shown = {k: d for k, _, d, _ in H.config_rows(cfg)}
    assert (shown["model"], shown["model.n_layer"], shown["train.steps"]) == ("gpt2-tiny", "2", "7")
    assert (shown["sharding.replicate"], shown["data"]) == ("embed,mlp", "'a b.txt'")


def test_option_keys_are_the_keys_the_commands_parse():
    assert launch.KEYS == set(O.names(O.LaunchOptions))
    assert plan_cli.PLAN_KEYS == O.names(plan_cli.PlanOptions)
    plan_keys = {r[0] for r in H.command_rows("plan")[0]}
    assert set(plan_cli.FIXED_KEYS) | set(plan_cli.CONFIG_KEYS) | set(plan_cli.PLAN_KEYS) <= plan_keys
    # sample's defaults are the ones run_sample applies
    assert (O.SampleOptions.max_new_tokens, O.SampleOptions.temperature, O.SampleOptions.top_k) == (100, 0.8, 40)


def test_unknown_prepare_key_lists_the_documented_ones(capsys, tmp_path):
    assert cli.main(["prepare", f"out={tmp_path / 'p'}", "bogus=1"]) == 2
    assert capsys.readouterr().err == "error: unknown key(s) bogus (valid: input, out, tokenizer, text_key, workers, val_fraction, seed, shard_tokens)\n"
    assert not (tmp_path / "p").exists()


def test_help_as_a_user_runs_it_exits_0_without_importing_jax():
    code = "import sys; from jaxpar.cli import main; rc = main(['train', '--help']); assert 'jax' not in sys.modules; sys.exit(rc)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "train.ckpt_every" in r.stdout and r.stderr == ""


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"], ["plan", "-h"]])
def test_help_into_a_closed_pipe_exits_0_quietly(argv):
    """`jaxpar --help | true`: the reader is gone before help is written. The help paths printed
    before the CLI's closed-pipe guard was in place: a BrokenPipeError traceback, exit 1."""
    import os

    read, write = os.pipe()
    os.close(read)  # every write to `write` now fails with EPIPE
    try:
        r = subprocess.run([sys.executable, "-m", "jaxpar.cli", *argv], stdout=write, stderr=subprocess.PIPE,
                           text=True, timeout=60)
    finally:
        os.close(write)
    assert (r.returncode, r.stderr) == (0, "")


@pytest.mark.parametrize("tool", ["jaxpar", "torchref"])
def test_version_names_the_project_and_its_stack_without_importing_it(tool):
    """`--version` (a bug report's first line) reads the installed metadata: it works where jax or
    torch would fail to start. Checked against independent sources: pyproject.toml and the
    imported modules' own __version__."""
    import os
    import platform
    import tomllib

    code = (f"import sys; from {tool}.cli import main; rc = main(['--version']); "
            "assert not {'jax', 'torch'} & set(sys.modules), sorted(sys.modules); sys.exit(rc)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stderr) == (0, "")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]["version"]
    lib = __import__({"jaxpar": "jax", "torchref": "torch"}[tool])
    line = r.stdout.rstrip("\n")
    assert line.startswith(f"{tool} {project} (python {platform.python_version()}, {lib.__name__} {lib.__version__}, ")
    assert r.stdout.count("\n") == 1 and line.endswith(")") and "not installed" not in line


def test_version_names_torchs_cuda_build(tmp_path):
    """PyPI's CUDA wheel of torch records `2.13.0` in its metadata while torch.__version__ (the build a bug
    report needs) is `2.13.0+cu130`: the line reads the latter from torch/version.py, without importing it.
    A fake distribution first on sys.path stands in for that wheel."""
    import os

    (tmp_path / "torch-2.13.0.dist-info").mkdir()
    (tmp_path / "torch-2.13.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.13.0\n")
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "version.py").write_text("__version__ = '2.13.0+cu130'\ncuda = '13.0'\n")
    code = ("import sys; from gpt2common.versions import installed; print(installed('torch')); "
            "assert 'torch' not in sys.modules")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.path.dirname(os.path.dirname(__file__))])}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert (r.returncode, r.stdout, r.stderr) == (0, "2.13.0+cu130\n", "")


def test_version_of_a_missing_distribution():
    from gpt2common.versions import installed

    assert installed("jaxpar-no-such-distribution") == "not installed"
