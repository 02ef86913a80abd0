"""Bad input from outside: any value for any key is either a config or one `error:` line.

README: "Bad input gets one line `error: ...` on stderr naming the offending values and exit
code 2". Hypothesis draws a key (every dotted key of `jaxpar train`, `model=<preset>`, and a
few unknown ones) and any text or number for it; `config.resolve` must return a Config or raise
ConfigError (never another exception, which the CLI would print as a traceback), and the line
the CLIs print for it must be one line however the value is spelled (line breaks, NEL,
U+2028 ... are escaped). Found this way: `sharding.replicate=<name with a line break>` printed
a two-line error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpt2common.grammar import field_types, one_line
from jaxpar import cli
from jaxpar.config import Config, ConfigError, resolve


def _keys() -> list[str]:
    out = ["model"]
    for name, tp in field_types(Config).items():
        if dataclasses.is_dataclass(tp):
            out += [f"{name}.{f.name}" for f in dataclasses.fields(tp)]
        elif name != "model_name":
            out.append(name)
    return out


KEYS = _keys()
VALUES = st.one_of(
    st.text(),
    st.integers(-(2**70), 2**70).map(str),
    st.floats().map(str),
    st.sampled_from(["nan", "-inf", "-1", "0", "1e400", "true", "none", "", "1,2", "[3,1]", "a\nb", "gpt2\r",
                     "head\u2028x", "1_000", "0x10"]),
)


def test_keys_cover_the_documented_ones():
    assert len(KEYS) == 58 and {"model", "model.attention", "pipeline.gather", "train.skip_nonfinite",
                                "sharding.replicate", "eval.windows", "progress", "train.ckpt_minutes",
                                "train.keep_checkpoints", "tensor.sequence_parallel", "log.wandb",
                                "log.wandb_project", "log.wandb_mode", "init_state"} <= set(KEYS)


@settings(max_examples=400, deadline=None)
@given(key=st.one_of(st.sampled_from(KEYS), st.sampled_from(["trian.steps", "model.n_layers", "mesh", "x.y.z"])),
       value=VALUES)
def test_any_value_is_a_config_or_one_error_line(key, value):
    try:
        resolve([f"{key}={value}"])
        return
    except ConfigError as e:
        msg = str(e)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        cli._error_line(msg)
    lines = err.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and err.getvalue().endswith("\n"), lines
    assert key.split(".")[0] in lines[0]  # names what it refuses


@settings(max_examples=300, deadline=None)
@given(msg=st.lists(st.one_of(st.text(max_size=4), st.sampled_from(list("\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"))),
                    max_size=6).map("".join))
def test_one_line_is_one_line_and_keeps_the_rest(msg):
    out = one_line(msg)
    assert len(out.splitlines()) <= 1
    assert all(line in out for line in msg.splitlines())  # every piece of the text is still there


@pytest.mark.parametrize("msg,want", [
    ("plain", "plain"),
    ("a\nb", "a\\nb"),
    ("a\r\nb\x85c\u2028d\x0ce", "a\\r\\nb\\x85c\\u2028d\\x0ce"),
    ("tab\tstays", "tab\tstays"),
])
def test_one_line_escapes_exactly_the_line_breaks(msg, want):
    assert one_line(msg) == want and len(one_line(msg).splitlines()) == 1


@pytest.mark.parametrize("tool,arg,want", [
    ("jaxpar", "sharding.replicate=embed,at\ntn",
     "error: sharding.replicate=embed,at\\ntn names unknown groups (at\\ntn); choose from embed, attn, mlp"),
    ("torchref", "precision=f\np32", "error: precision=f\\np32 contradicts strategy=single (it computes in fp32)"),
])
def test_cli_prints_a_value_with_a_line_break_on_one_line(tool, arg, want, tmp_path):
    from support.cli_helpers import run

    out = tmp_path / "run"
    r = run(["train", "model=gpt2-tiny", arg, f"out={out}"], tool=tool)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.splitlines() == [want]
    assert not out.exists()
