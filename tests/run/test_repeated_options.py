"""One rule for an option given twice: a config key takes its last value
(`train $COMMON train.steps=10` overrides), every other option given twice is refused with one
line naming the key and both values; a jaxpar bisect side's init= / init_state= is refused, not
dropped. In-process, nothing runs. Reference: the messages written down by hand here."""

from __future__ import annotations

import pytest

from gpt2common.grammar import ConfigError


def twice(key, a, b) -> str:
    return f"{key}= given twice ({a!r} and {b!r}); it takes one value"


def test_config_flag_twice_is_refused_in_both_clis(tmp_path, capsys):
    from jaxpar.config import split_config_flag
    from torchref.cli import _split_config

    for argv in (["--config", "a.yaml", "x=1", "--config=b.yaml"], ["--config=a.yaml", "--config", "b.yaml"]):
        for split in (split_config_flag, _split_config):
            with pytest.raises(ConfigError) as e:
                split(argv)
            assert str(e.value) == twice("--config", "a.yaml", "b.yaml")
    assert split_config_flag(["--config", "a.yaml", "x=1"]) == ("a.yaml", ["x=1"])


def test_bisect_options_twice_are_refused_config_keys_take_the_last():
    from jaxpar.run.bisection import _words, split_args

    with pytest.raises(ConfigError) as e:
        split_args(["a=jaxpar", "a=torchref strategy=single", "b=jaxpar"])
    assert str(e.value) == twice("a", "jaxpar", "torchref strategy=single")
    with pytest.raises(ConfigError) as e:
        _words("a", "hf=/x seed=1 hf=/y")
    assert str(e.value) == "a='hf=/x seed=1 hf=/y': " + twice("hf", "/x", "/y")
    assert _words("a", "jaxpar seed=1 seed=2") == ("jaxpar", {"seed": "2"})


@pytest.mark.parametrize("key", ["init", "init_state"])
def test_a_jaxpar_bisect_sides_own_start_is_refused_not_dropped(key):
    from jaxpar.run.bisection import resolve_sides

    with pytest.raises(ConfigError) as e:
        resolve_sides(f"jaxpar model=gpt2-tiny {key}=/some/dir", "torchref strategy=single model=gpt2-tiny")
    assert str(e.value) == (f"a='jaxpar model=gpt2-tiny {key}=/some/dir': {key}= is not taken by bisect: both "
                            "sides start from one set of weights, the seed's init or an hf=DIR side's")


def test_plan_and_launch_options_twice_are_refused():
    from jaxpar.planner.cli import parse_args
    from jaxpar.run.launch import parse

    with pytest.raises(ConfigError) as e:
        parse_args(["model=gpt2-tiny", "out=a.json", "out=b.json"])
    assert str(e.value) == twice("out", "a.json", "b.json")
    with pytest.raises(ConfigError) as e:
        parse_args(["devices=8", "devices=16"])
    assert str(e.value) == twice("devices", "8", "16")
    assert parse_args(["train.batch_size=8", "train.batch_size=16"])["cfg"].train.batch_size == 16  # a config key
    with pytest.raises(ConfigError) as e:
        parse(["nprocs=2", "nprocs=4", "--", "train"])
    assert str(e.value) == "launch: " + twice("nprocs", "2", "4")
