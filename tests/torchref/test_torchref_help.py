"""`torchref train --help` and `torchref compare --help`: generated from torchref's own dataclasses
(torchref.help), so every key either command accepts is listed, with a default that parses back to the
real default. Before, both said `error: argument '--help' is not key=value` (exit 2)."""

import dataclasses
import re
import subprocess
import sys

import pytest

from torchref import config as RC
from torchref import help as H
from torchref import run_config as R
from torchref.cli import main
from torchref.compare import plan_runs


def _table(out: str) -> list[tuple[str, ...]]:
    table = out.split("keys (type, default, meaning):\n")[1].split("\n\n")[0]
    # columns are separated by two or more spaces: key, type, default, meaning
    return [tuple(re.split(r"\s{2,}", ln.strip())) for ln in table.splitlines()]


def _given_back(rows) -> list[str]:
    """Each shown default as key=value (`""` is the empty string)."""
    empty = '""'
    return [f"{k}={'' if d == empty else d}" for k, _, d, _ in rows]


@pytest.mark.parametrize("cmd", list(H.COMMANDS))
def test_each_command_help_exits_0_and_every_row_has_type_default_meaning(cmd, capsys):
    for argv in ([cmd, "--help"], [cmd, "x=1", "-h"]):
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert out.startswith(f"usage: torchref {cmd} ")
        entries, _ = H.command_rows(cmd)
        assert entries and all(all(col.strip() for col in e) for e in entries)
        assert _table(out) == entries


def test_train_help_lists_exactly_the_keys_train_holds_with_their_defaults():
    rows, notes = H.command_rows("train")
    keys = [r[0] for r in rows]
    own = set(RC._TOP) | {f"{s}.{RC._key(f.name)}" for s, cls in RC._SECTIONS.items() for f in dataclasses.fields(cls)}
    assert len(keys) == len(set(keys)) and set(keys) == own | R.HELD
    assert RC.resolve_ref(_given_back(rows)) == RC.resolve_ref([]) == (R.RunConfig(), RC.RefConfig())
    # every other `jaxpar train` key is named below the table, as ignored or refused
    named = set(re.findall(r"[\w.]*\w", " ".join(n.split(": ", 1)[1] for n in notes if n.startswith(("Accepted", "Refused")))))
    assert named == set(R.IGNORED)


def test_compare_help_lists_its_own_keys_and_each_runs():
    rows, _ = H.command_rows("compare")
    keys = [r[0] for r in rows]
    train = [r[0] for r in H.command_rows("train")[0]]
    # precision is each strategy's own (fp32, or the -amp ones' amp.dtype): not a key of the whole comparison
    assert keys == ["workers", "strategies", "out"] + [k for k in train if k not in ("strategy", "workers", "out",
                                                                                    "precision")]
    assert plan_runs(_given_back(rows)) == plan_runs([])
    out, runs = plan_runs([])
    assert (out, len(runs)) == ("runs/compare", 1 + 5 * 2)  # single, then 5 strategies at workers 2 and 4


def test_help_as_a_user_runs_it_imports_no_torch():
    code = ("import sys; from torchref.cli import main; rc = main(['train', '--help']); "
            "assert not {'torch', 'jax'} & set(sys.modules); sys.exit(rc)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stderr) == (0, "")
    assert "horovod.compression" in r.stdout and "train.grad_accum" in r.stdout
