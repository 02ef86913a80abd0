"""Bad input to `jaxpar eval` and `jaxpar convert` (in-process, one tiny HF dir): one `error:`
line on stderr, exit 2, nothing written or overwritten.

Independent reference: the exact messages and the directory contents written down here."""

from __future__ import annotations

import numpy as np
import pytest

from gpt2common import hf
from gpt2common.init import init_params
from gpt2common.model import ModelConfig
from jaxpar import cli

MC = ModelConfig(n_layer=1, n_embd=16, n_head=2, vocab_size=40, n_positions=16)


@pytest.fixture
def hf_dir(tmp_path):
    d = tmp_path / "hf"
    hf.save_hf(str(d), MC, init_params(MC, seed=0))
    return d


def _tokens(path, top: int):
    """100 token ids in [0, top], the last one == top."""
    ids = np.arange(100) % top
    ids[-1] = top
    ids.astype("<u2").tofile(path)
    return path


def _error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err.removesuffix("\n")


def test_eval_refuses_a_token_id_equal_to_the_vocab(hf_dir, tmp_path, capsys):
    """Ids run 0..vocab_size-1; id == vocab_size would be clamped by the embedding gather."""
    bad = _tokens(tmp_path / "bad.bin", MC.vocab_size)
    assert cli.main(["eval", f"hf={hf_dir}", f"data={bad}", "train.seq_len=8"]) == 2
    assert _error(capsys) == f"error: data={str(bad)!r} holds token id 40 >= model.vocab_size=40"


def test_eval_of_weights_with_a_nan_is_one_error_line(hf_dir, tmp_path, capsys):
    sd = hf.to_hf_state_dict(MC, hf.load_hf(str(hf_dir))[1])
    sd["transformer.ln_f.bias"][3] = np.nan
    from safetensors.numpy import save_file

    save_file(sd, str(hf_dir / hf.WEIGHTS))
    data = _tokens(tmp_path / "x.bin", 5)
    assert cli.main(["eval", f"hf={hf_dir}", f"data={data}", "train.seq_len=8"]) == 2
    assert _error(capsys) == (f"error: the loss of {str(hf_dir)!r} on data={str(data)!r} is nan: the weights are "
                              "not usable")
    assert capsys.readouterr().out == ""  # no JSON with a NaN in it


def test_convert_never_writes_into_a_non_empty_dir(hf_dir, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("mine")
    assert cli.main(["convert", f"hf={hf_dir}", f"out={out}"]) == 2
    assert _error(capsys) == f"error: out={str(out)!r} is not empty"
    assert [p.name for p in out.iterdir()] == ["config.json"] and (out / "config.json").read_text() == "mine"
    assert cli.main(["convert", f"checkpoint={tmp_path / 'none'}", f"to_hf={out}"]) == 2
    assert _error(capsys) == f"error: to_hf={str(out)!r} is not empty"
    assert [p.name for p in out.iterdir()] == ["config.json"]


def test_converted_run_and_hf_dir_eval_alike_in_fp32(hf_dir, tmp_path, capsys):
    """convert of a model with n_positions=16 (below the default train.seq_len) gives the run a
    window it can use, seq_len=16, so eval of the run needs no train.seq_len=; and eval of the HF dir
    with that window runs in the same exact fp32 (README: eval/sample default to fp32): both print
    the same loss and token count. Reference: each other (same weights, windows and dtype)."""
    import json

    from jaxpar.run.commands import run_config

    out = tmp_path / "run"
    assert cli.main(["convert", f"hf={hf_dir}", f"out={out}"]) == 0
    assert run_config(str(out)).train.seq_len == 16
    data = _tokens(tmp_path / "x.bin", MC.vocab_size - 1)
    capsys.readouterr()
    assert cli.main(["eval", f"checkpoint={out}", f"data={data}"]) == 0
    ran = json.loads(capsys.readouterr().out)
    assert cli.main(["eval", f"hf={hf_dir}", f"data={data}", "train.seq_len=16"]) == 0
    direct = json.loads(capsys.readouterr().out)
    assert ran["tokens"] == direct["tokens"] == 6 * 16  # (100 - 1) // 16 windows
    assert direct["loss"] == ran["loss"], (direct, ran)


def test_resume_of_a_converted_run_trains_from_its_weights(tmp_path, capsys):
    """`jaxpar convert hf=DIR out=RUN` writes step 0 with weights only; `train out=RUN resume=true`
    stopped at "no readable checkpoint step (... 'opt_state' was not found ...)". It now continues
    from those weights with fresh optimizer moments, which is what `init=DIR` starts from: the
    two runs' losses agree exactly, step for step (same seed, data and window)."""
    import json

    mc = ModelConfig(n_layer=1, n_embd=16, n_head=2, vocab_size=300, n_positions=32)
    hf.save_hf(str(tmp_path / "hf"), mc, init_params(mc, seed=0))
    conv, fresh = tmp_path / "conv", tmp_path / "fresh"
    assert cli.main(["convert", f"hf={tmp_path / 'hf'}", f"out={conv}"]) == 0
    capsys.readouterr()
    assert cli.main(["convert", f"checkpoint={conv}", f"to_state={tmp_path / 'st'}"]) == 2  # no moments to hand on
    assert _error(capsys) == f"error: checkpoint={str(conv)!r} step 0 holds no optimizer state (an imported HF model)"
    assert not (tmp_path / "st").exists()
    common = ["train.steps=3", "train.batch_size=2", "train.eval_every=0"]
    assert cli.main(["train", f"out={conv}", "resume=true", *common, "progress=plain"]) == 0, capsys.readouterr().err
    assert (f"resumed from step 0 ({conv / 'ckpt'}) with fresh optimizer moments: the step holds weights only"
            in capsys.readouterr().out.splitlines())
    assert cli.main(["train", f"init={tmp_path / 'hf'}", f"out={fresh}", "train.seq_len=32", *common,
                     "progress=none"]) == 0
    losses = [[json.loads(ln)["loss"] for ln in open(d / "metrics.jsonl")] for d in (conv, fresh)]
    assert len(losses[0]) == 3 and losses[0] == losses[1]
    assert sorted(p.name for p in (conv / "ckpt").iterdir()) == ["0", "3"]
