"""`jaxpar bisect` sizes its batch before it allocates: a batch whose
intermediates cannot fit the host is one line, exit 2, before JAX starts. In-process.
Reference: the byte count worked out by hand from the shapes in the docstring of bisect_bytes."""

from __future__ import annotations

import pytest

from gpt2common.grammar import ConfigError
from jaxpar.run import bisection


def test_the_estimate_counts_the_captured_intermediates_by_hand():
    a, _, _ = bisection.resolve_sides("jaxpar model=gpt2-tiny", "torchref strategy=single model=gpt2-tiny")
    # gpt2-tiny: L=2, D=128, H=4, V=256; bisect's batch B=8, T=32
    per_layer = 16 * 8 * 32 * 128 + 2 * 8 * 4 * 32 * 32
    assert bisection.bisect_bytes(a.cfg) == 8 * 4 * (2 * per_layer + 4 * 8 * 32 * 128 + 8 * 32 * 256) == 44_040_192


def test_a_batch_that_cannot_fit_is_refused_before_anything_is_allocated(monkeypatch, capsys):
    from jaxpar import cli

    monkeypatch.setattr(bisection, "available_bytes", lambda: 2**30)  # a 1 GiB host
    assert cli.main(["bisect", "jaxpar model=gpt2-tiny train.batch_size=1000", "jaxpar model=gpt2-tiny "
                     "train.batch_size=1000"]) == 2
    assert capsys.readouterr().err == (
        "error: train.batch_size=1000 at train.seq_len=32 does not fit a bisect: it keeps every intermediate of "
        "both sides, about 5.1 GiB, and this host has 1.0 GiB available; lower train.batch_size or "
        "train.seq_len\n")
    a, _, _ = bisection.resolve_sides("jaxpar model=gpt2-tiny", "jaxpar model=gpt2-tiny")
    bisection.check_fits(a.cfg)  # bisect's own batch (8 x 32: 42 MiB) fits


def test_a_hundred_thousand_rows_are_refused_on_any_host_here():
    a, _, _ = bisection.resolve_sides("jaxpar model=gpt2-tiny train.batch_size=100000",
                                      "jaxpar model=gpt2-tiny train.batch_size=100000")
    assert bisection.bisect_bytes(a.cfg) > 500 * 2**30 > bisection.available_bytes()
    with pytest.raises(ConfigError, match=r"^train.batch_size=100000 at train.seq_len=32 does not fit a bisect"):
        bisection.check_fits(a.cfg)
