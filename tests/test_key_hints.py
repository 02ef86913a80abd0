"""An unknown key names the key meant: `steps=10` (a section left out) or `trian.steps=10` (a typo) gets
"did you mean train.steps?", from jaxpar and torchref alike (gpt2common.grammar.unknown_key). Before,
both said only "unknown key 'steps'"."""

import pytest

from gpt2common.grammar import ConfigError
from jaxpar import cli
from jaxpar.config import resolve
from torchref.config import resolve_ref

HINTS = [("steps", "train.steps"), ("lr", "train.lr"), ("dropout", "model.dropout"), ("trian.steps", "train.steps"),
         ("stepz", "train.steps"), ("seq", "train.seq_len"), ("bogus", None), ("zzz.y", None)]


@pytest.mark.parametrize("key,meant", HINTS)
@pytest.mark.parametrize("tool", ["jaxpar", "torchref"])
def test_unknown_key_names_the_key_meant(tool, key, meant):
    with pytest.raises(ConfigError) as e:
        {"jaxpar": resolve, "torchref": resolve_ref}[tool]([f"{key}=1"])
    assert str(e.value) == f"unknown key {key!r}" + (f" (did you mean {meant}?)" if meant else "")


def test_a_known_section_still_lists_its_keys():
    with pytest.raises(ConfigError, match=r"^unknown key 'train.stepz' \(valid: train.steps, train.batch_size, "):
        resolve(["train.stepz=1"])


def test_the_cli_prints_the_hint_as_its_one_error_line(capsys):
    assert cli.main(["train", "steps=10"]) == 2
    assert capsys.readouterr().err == "error: unknown key 'steps' (did you mean train.steps?)\n"
