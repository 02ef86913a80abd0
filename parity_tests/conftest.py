"""Fixtures of the parity tests: one shared starting point per model shape, built once per pytest run."""

import os

import pytest

from parity_tests.common import ODD, TINY, write_data, write_init

SHAPES = {"gpt2-tiny": TINY, "odd": ODD}


@pytest.fixture(scope="session")
def parity_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("parity"))


@pytest.fixture(scope="session")
def shared(parity_root):
    """name -> (init HF dir, prepared data dir): numpy init (seed 0) through jaxpar's exporter."""
    out = {}
    for name, cfg in SHAPES.items():
        d = os.path.join(parity_root, name)
        out[name] = (write_init(os.path.join(d, "init"), cfg), write_data(os.path.join(d, "data"), cfg.vocab_size))
    return out
